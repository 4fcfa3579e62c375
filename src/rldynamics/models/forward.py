"""Forward passes that turn a model into per-token quantities aligned with `input_ids` positions.

Entry `t` of every returned `[N, L]` tensor describes token `t` predicted from the prefix `< t`; column 0
is zero. This is the one place that shifts logits against labels.
"""

from __future__ import annotations

import inspect

import torch
from torch.utils.checkpoint import checkpoint

from rldynamics.algo.losses import entropy_from_logits


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float = 1.0,
                   with_entropy: bool = False, positions: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the given tokens (and the entropy of each predictive distribution).

    Args:
        input_ids: [N, L] token ids (right-padded).
        attention_mask: [N, L].
        temperature: logits are divided by it (the sampling temperature of the rollout).
        positions: optional [N, L] mask of the tokens whose log-probs are needed (the response mask). Then
            columns past the last attended one are trimmed, the LM head and the log-softmax run only at the
            positions that predict those tokens, in chunks of at most `CHUNK_ELEMENTS` logits (so a large
            vocabulary never materialises [N, L, V] float32), and every other entry is 0.
    Returns:
        logprobs [N, L] and entropy [N, L] (or None), zero in column 0.
    """
    if positions is not None:
        return _selected_logprobs(model, input_ids, attention_mask, positions.bool(), temperature, with_entropy)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()  # [N, L-1, V]
    logits = logits / temperature  # [N, L-1, V]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [N, L-1]
    logprobs = torch.nn.functional.pad(logp, (1, 0))  # [N, L]
    entropy = torch.nn.functional.pad(entropy_from_logits(logits), (1, 0)) if with_entropy else None  # [N, L]
    return logprobs, entropy


CHUNK_ELEMENTS = 2**25  # float32 logits per chunk of the selected log-softmax (128 MiB)


def _selected_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
                       temperature: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` computed only where `positions` [N, L] is set (zeros elsewhere)."""
    n, length = input_ids.shape
    width = int(attention_mask.any(0).nonzero().max()) + 1 if attention_mask.any() else 1  # trailing padding dropped
    ids, attn, wanted = input_ids[:, :width], attention_mask[:, :width], positions[:, 1:width]  # [N, W], [N, W-1]
    wanted = wanted & attn[:, 1:].bool()  # [N, W-1] token t, predicted at position t-1
    keep = torch.nn.functional.pad(wanted, (0, 1))  # [N, W] the predicting positions
    logits = _logits_at(model, ids, attn, keep)  # [M, V]
    targets = ids[:, 1:][wanted]  # [M]
    logp, ent = _chunked_logprobs(logits, targets, temperature, with_entropy)  # [M], [M] | None

    def place(values: torch.Tensor) -> torch.Tensor:
        grid = values.new_zeros(n, width - 1).masked_scatter(wanted, values)  # [N, W-1]
        return torch.nn.functional.pad(grid, (1, length - width))  # [N, L]

    return place(logp), (place(ent) if with_entropy else None)


def _logits_at(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Logits [M, V] at the `keep` [N, L] positions, row by row; the LM head runs only there when the model
    takes a boolean `logits_to_keep` (transformers' causal LMs), else the full logits are indexed."""
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep).logits
        if logits.dim() == 2 and logits.shape[0] == int(keep.sum()):
            return logits  # [M, V]
    return model(input_ids=input_ids, attention_mask=attention_mask).logits[keep]  # [M, V]


def _chunked_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                      with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 log-prob of `targets` [M] (and entropy) under `logits` [M, V] / temperature, in chunks of rows.

    With several chunks and gradients on, each chunk is recomputed in backward (activation checkpointing),
    so the float32 temporaries of only one chunk exist at a time.
    """
    step = max(1, CHUNK_ELEMENTS // max(logits.shape[-1], 1))
    recompute = torch.is_grad_enabled() and logits.requires_grad and logits.shape[0] > step
    parts = []
    for start in range(0, logits.shape[0], step):
        args = (logits[start:start + step], targets[start:start + step], temperature, with_entropy)
        parts.append(checkpoint(_logprob_chunk, *args, use_reentrant=False) if recompute else _logprob_chunk(*args))
    if not parts:
        empty = logits.new_zeros(0, dtype=torch.float32)  # [0]
        return empty, (empty if with_entropy else None)
    logp = torch.cat([p[0] for p in parts])  # [M]
    return logp, (torch.cat([p[1] for p in parts]) if with_entropy else None)


def _logprob_chunk(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                   with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    z = logits.float() / temperature  # [m, V]
    logp = torch.log_softmax(z, dim=-1).gather(-1, targets[:, None]).squeeze(-1)  # [m]
    return logp, (entropy_from_logits(z) if with_entropy else torch.zeros_like(logp))  # [m], [m]


def token_values(critic, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Critic values V(prefix < t) aligned like `token_logprobs`. [N, L]"""
    values = critic(input_ids=input_ids, attention_mask=attention_mask).float()  # [N, L]
    return torch.nn.functional.pad(values[:, :-1], (1, 0))  # [N, L]


def micro_batches(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Split a row-index vector into consecutive chunks of at most `size`."""
    return list(torch.split(rows, size))


def by_length(attention_mask: torch.Tensor) -> torch.Tensor:
    """Row indices of `attention_mask` [N, L] from shortest to longest (stable), so consecutive micro-batches
    hold rows of similar length and each is trimmed to its own longest row. [N]"""
    return torch.argsort(attention_mask.sum(1), stable=True)  # [N]


@torch.no_grad()
def batch_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, micro_batch_size: int,
                   temperature: float = 1.0, with_entropy: bool = False, positions: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` over a whole batch in micro-batches, without gradients. ([N, L], [N, L] | None)"""
    device = next(model.parameters()).device
    order = by_length(attention_mask) if positions is not None else torch.arange(input_ids.shape[0])  # [N]
    logps, ents = [], []
    for rows in micro_batches(order, micro_batch_size):
        lp, ent = token_logprobs(model, input_ids[rows].to(device), attention_mask[rows].to(device),
                                 temperature=temperature, with_entropy=with_entropy,
                                 positions=None if positions is None else positions[rows].to(device))
        logps.append(lp.cpu())
        ents.append(ent.cpu() if ent is not None else None)
    back = torch.argsort(order)  # [N] original row order
    return torch.cat(logps)[back], (torch.cat(ents)[back] if with_entropy else None)  # [N, L]


@torch.no_grad()
def batch_values(critic, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                 micro_batch_size: int) -> torch.Tensor:
    """`token_values` over a whole batch in micro-batches, without gradients. [N, L]"""
    device = next(critic.parameters()).device
    out = [token_values(critic, input_ids[rows].to(device), attention_mask[rows].to(device)).cpu()
           for rows in micro_batches(torch.arange(input_ids.shape[0]), micro_batch_size)]
    return torch.cat(out)  # [N, L]
