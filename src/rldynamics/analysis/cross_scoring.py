"""Cross-scoring for the collapse diagnostics: every sampled reply under every distinct prompt of the batch.

A (prompt x, reply z) pair is cut from a trajectory row: the reply is one turn's run of sampled tokens
(`response_mask`), the prompt everything before it (system, the user turns, the earlier turns of that
trajectory and the assistant header; with `env.enable_think` the prompt ends with the opened `<think>`). Z is the
whole reply as sampled (no re-tokenisation), so the diagnostic works with and without think mode.

- `turn_spans`: the reply spans of a row; `first_turn_pairs` / `trajectory_pairs`: RAGEN's two sampling modes.
- `prompt_classes`: distinct prompts (columns whose prompts are identical tokens share a class).
- `pair_rows`: the rows `[x_u | z_i]` of every distinct prompt u and reply i, prompt-major, with the reply tokens
  as the scored positions; `cross_loglik` forwards them with `models.forward.batch_logprobs` and its shared-prefix
  path, so each distinct prompt is encoded once per micro-batch and only the replies are forwarded on its cached
  keys and values (about U × |z| tokens per prompt, instead of U × N × (|x| + |z|) for independent sequences).
  `shared_prefix=False` is that naive protocol (`bench/collapse_cost.py` compares the two).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rldynamics.models.forward import batch_logprobs


@dataclass
class Pairs:
    """Sampled (prompt, reply) pairs and their columns.

    prompts: one token tensor per column (C of them); replies: one token tensor per row (N); column: [N] long,
    each row's column; classes: [C] long, the distinct prompt of each column (0..U-1 in order of first appearance).
    """

    prompts: list[torch.Tensor]
    replies: list[torch.Tensor]
    column: torch.Tensor
    classes: torch.Tensor

    @property
    def distinct(self) -> list[torch.Tensor]:
        """The U distinct prompts, in class order."""
        first = {}
        for j, c in enumerate(self.classes.tolist()):
            first.setdefault(c, j)
        return [self.prompts[first[c]] for c in sorted(first)]


def turn_spans(response_mask: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each run of sampled tokens in one row's `response_mask` [L] (one per turn), in order."""
    mask = torch.nn.functional.pad(response_mask.bool().int(), (1, 1))  # [L + 2]
    edges = mask[1:] - mask[:-1]  # [L + 1] +1 where a run starts, -1 after it ends
    starts = (edges == 1).nonzero().squeeze(1).tolist()
    ends = (edges == -1).nonzero().squeeze(1).tolist()
    return list(zip(starts, ends, strict=True))


def prompt_classes(prompts: list[torch.Tensor]) -> torch.Tensor:
    """Class of each prompt: equal token sequences share one (numbered in order of first appearance). [C]"""
    ids: dict[tuple, int] = {}
    return torch.tensor([ids.setdefault(tuple(p.tolist()), len(ids)) for p in prompts], dtype=torch.long)


def first_turn_pairs(input_ids: torch.Tensor, response_mask: torch.Tensor, group_ids: torch.Tensor,
                     num_samples: int, generator: torch.Generator) -> tuple[Pairs | None, int]:
    """First-turn pairs of every trajectory with a reply, one column per group (RAGEN's first-turn mode).

    Args:
        input_ids, response_mask: [M, L] the rollout's rows. group_ids: [M].
        num_samples: keep at most this many pairs, drawn without replacement (0: all).
    Returns:
        (pairs or None when fewer than 2 columns remain, number of valid rows before sampling).
    """
    valid = [r for r in range(input_ids.shape[0]) if turn_spans(response_mask[r])]
    count = len(valid)
    if num_samples and len(valid) > num_samples:
        pick = torch.randperm(len(valid), generator=generator)[:num_samples].sort().values
        valid = [valid[i] for i in pick.tolist()]
    groups: dict[int, int] = {}
    prompts, replies, column = [], [], []
    for r in valid:
        start, end = turn_spans(response_mask[r])[0]
        g = int(group_ids[r])
        if g not in groups:
            groups[g] = len(prompts)
            prompts.append(input_ids[r, :start])
        column.append(groups[g])
        replies.append(input_ids[r, start:end])
    if len(prompts) < 2:
        return None, count
    return Pairs(prompts, replies, torch.tensor(column), prompt_classes(prompts)), count


def trajectory_pairs(input_ids: torch.Tensor, response_mask: torch.Tensor, num_samples: int,
                     generator: torch.Generator) -> Pairs | None:
    """RAGEN's trajectory-uniform mode: `num_samples` (0: one per turn) draws with replacement of a trajectory,
    then one of its turns, both uniformly; each drawn pair is its own column (identical prompts share a class).
    None when fewer than 2 pairs."""
    spans = [turn_spans(response_mask[r]) for r in range(input_ids.shape[0])]
    rows = [r for r, s in enumerate(spans) if s]
    total = sum(len(spans[r]) for r in rows)
    draws = min(num_samples or total, total)
    if draws < 2:
        return None
    traj = torch.randint(0, len(rows), (draws,), generator=generator).tolist()
    prompts, replies = [], []
    for t in traj:
        r = rows[t]
        start, end = spans[r][int(torch.randint(0, len(spans[r]), (1,), generator=generator))]
        prompts.append(input_ids[r, :start])
        replies.append(input_ids[r, start:end])
    return Pairs(prompts, replies, torch.arange(draws), prompt_classes(prompts))


def pair_rows(prompts: list[torch.Tensor], replies: list[torch.Tensor],
              pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows `[x_u | z_i]` for every prompt u (outer) and reply i (inner), right-padded with `pad_id`.

    Returns input_ids [U·N, W], attention_mask [U·N, W], positions [U·N, W] (1 on the reply's tokens).
    """
    n = len(replies)
    width = max(len(p) for p in prompts) + max(len(z) for z in replies)
    ids = torch.full((len(prompts) * n, width), pad_id, dtype=torch.long)  # [U·N, W]
    attn = torch.zeros_like(ids)  # [U·N, W]
    positions = torch.zeros(ids.shape, dtype=torch.float32)  # [U·N, W]
    for u, x in enumerate(prompts):
        for i, z in enumerate(replies):
            row, a, b = u * n + i, len(x), len(x) + len(z)
            ids[row, :a], ids[row, a:b] = x, z
            attn[row, :b] = 1
            positions[row, a:b] = 1.0
    return ids, attn, positions


def sequence_loglik(logprobs: torch.Tensor, positions: torch.Tensor, num_prompts: int) -> torch.Tensor:
    """Per-row sums of the reply's token log-probs, as the matrix L[i, u] (rows: replies, columns: prompts).

    Args: logprobs, positions: [U·N, W] (prompt-major rows of `pair_rows`). Returns [N, U] float64.
    """
    sums = (logprobs.double() * positions.double()).sum(1)  # [U·N]
    return sums.view(num_prompts, -1).T  # [N, U]


RowPass = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Callable], torch.Tensor]


def cross_loglik(model, pairs: Pairs, *, pad_id: int, micro_batch_size: int, temperature: float = 1.0,
                 shared_prefix: bool = True, row_pass: RowPass | None = None) -> torch.Tensor:
    """L[i, j] = log p(z_i | x_j) under `model` for every reply i and column j, without gradients. [N, C] float64

    Each distinct prompt is scored once (`Pairs.distinct`) and its scores are copied to every column of its class.
    `row_pass(ids, attn, positions, compute)`, when given, runs `compute(rows) -> logprobs [n, W]` over a split of
    the rows (several ranks) and returns the whole [U·N, W]; the plain call otherwise.
    """
    distinct = pairs.distinct
    ids, attn, positions = pair_rows(distinct, pairs.replies, pad_id)  # [U·N, W] each

    def compute(rows: torch.Tensor) -> torch.Tensor:
        logprobs, _ = batch_logprobs(model, ids[rows], attn[rows], micro_batch_size=micro_batch_size,
                                     temperature=temperature, positions=positions[rows],
                                     shared_prefix=shared_prefix)  # [n, W]
        return logprobs

    logprobs = compute(torch.arange(ids.shape[0])) if row_pass is None else row_pass(ids, attn, positions, compute)
    return sequence_loglik(logprobs, positions, len(distinct))[:, pairs.classes]  # [N, C]


def reply_lengths(pairs: Pairs) -> torch.Tensor:
    """|z_i| of each row. [N]"""
    return torch.tensor([len(z) for z in pairs.replies], dtype=torch.float64)
