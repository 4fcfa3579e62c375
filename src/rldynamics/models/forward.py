"""Forward passes that turn a model into per-token quantities aligned with `input_ids` positions.

Entry `t` of every returned `[N, L]` tensor describes token `t` predicted from the prefix `< t`; column 0
is zero. This is the one place that shifts logits against labels.
"""

from __future__ import annotations

import torch

from rldynamics.algo.losses import entropy_from_logits


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float = 1.0,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the given tokens (and the entropy of each predictive distribution).

    Args:
        input_ids: [N, L] token ids (right-padded).
        attention_mask: [N, L].
        temperature: logits are divided by it (the sampling temperature of the rollout).
    Returns:
        logprobs [N, L] and entropy [N, L] (or None), zero in column 0.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()  # [N, L-1, V]
    logits = logits / temperature  # [N, L-1, V]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [N, L-1]
    logprobs = torch.nn.functional.pad(logp, (1, 0))  # [N, L]
    entropy = torch.nn.functional.pad(entropy_from_logits(logits), (1, 0)) if with_entropy else None  # [N, L]
    return logprobs, entropy


def token_values(critic, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Critic values V(prefix < t) aligned like `token_logprobs`. [N, L]"""
    values = critic(input_ids=input_ids, attention_mask=attention_mask).float()  # [N, L]
    return torch.nn.functional.pad(values[:, :-1], (1, 0))  # [N, L]


def micro_batches(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Split a row-index vector into consecutive chunks of at most `size`."""
    return list(torch.split(rows, size))


@torch.no_grad()
def batch_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, micro_batch_size: int,
                   temperature: float = 1.0, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` over a whole batch in micro-batches, without gradients. ([N, L], [N, L] | None)"""
    device = next(model.parameters()).device
    logps, ents = [], []
    for rows in micro_batches(torch.arange(input_ids.shape[0]), micro_batch_size):
        lp, ent = token_logprobs(model, input_ids[rows].to(device), attention_mask[rows].to(device),
                                 temperature=temperature, with_entropy=with_entropy)
        logps.append(lp.cpu())
        ents.append(ent.cpu() if ent is not None else None)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)  # [N, L]


@torch.no_grad()
def batch_values(critic, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                 micro_batch_size: int) -> torch.Tensor:
    """`token_values` over a whole batch in micro-batches, without gradients. [N, L]"""
    device = next(critic.parameters()).device
    out = [token_values(critic, input_ids[rows].to(device), attention_mask[rows].to(device)).cpu()
           for rows in micro_batches(torch.arange(input_ids.shape[0]), micro_batch_size)]
    return torch.cat(out)  # [N, L]
