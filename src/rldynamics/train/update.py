"""Optimizer steps over mini-batches with exact gradient accumulation over micro-batches (actor and critic).

- Each mini-batch is one optimizer step. Its rows are split into micro-batches (from shortest to longest when
  `sort_by_length`, so each forward is trimmed to its own longest row); each micro-batch's loss is multiplied by
  `sub_batch_share`, the share of the mini-batch's aggregation weight its rows carry, so the accumulated gradient
  is that of the whole mini-batch aggregated at once, whatever the micro-batch size.
- The gradient is clipped to `max_grad_norm` (the pre-clip norm is the `grad_norm` statistic); a non-finite norm
  skips the optimizer step and counts it in `skipped_steps`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rldynamics.algo.shares import sub_batch_share
from rldynamics.models.forward import by_length, micro_batches
from rldynamics.rollout.batch import RolloutBatch

LossFn = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


def optimize(model, optimizer, batch: RolloutBatch, minis: list[torch.Tensor], loss_of: LossFn, *,
             stats: tuple[str, ...], micro_batch_size: int, max_grad_norm: float, agg_mode: str,
             sort_by_length: bool = True) -> dict[str, float]:
    """One optimizer step per mini-batch of `minis` (row indices of `batch`); returns the step statistics.

    Args:
        loss_of: rows [n] -> (loss aggregated over those rows alone, {statistic: value}); called once per
            micro-batch that has response tokens.
        stats: the statistics `loss_of` reports.
    Returns:
        The mean over optimizer steps of each statistic (share-weighted over a step's micro-batches) and of
        `grad_norm`, `skipped_steps` (a count) and `num_updates`.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    sums: dict[str, float] = {}
    for mini in minis:
        step = _step(optimizer, params, batch, mini, loss_of, stats, micro_batch_size, max_grad_norm, agg_mode,
                     sort_by_length)
        for k, v in step.items():
            sums[k] = sums.get(k, 0.0) + v
    count = len(minis)
    out = {k: v / max(count, 1) for k, v in sums.items() if k != "skipped_steps"}
    out["skipped_steps"] = sums.get("skipped_steps", 0.0)
    out["num_updates"] = float(count)
    return out


def _step(optimizer, params, batch: RolloutBatch, mini: torch.Tensor, loss_of: LossFn, stats: tuple[str, ...],
          micro_batch_size: int, max_grad_norm: float, agg_mode: str, sort_by_length: bool) -> dict[str, float]:
    """Accumulate the mini-batch gradient, clip, and step (skipped when the norm is not finite)."""
    optimizer.zero_grad(set_to_none=True)
    out = dict.fromkeys(stats, 0.0)
    order = by_length(batch.attention_mask[mini]) if sort_by_length else torch.arange(len(mini))  # [n]
    for positions in micro_batches(order, micro_batch_size):
        share = sub_batch_share(batch.response_mask[mini], positions, agg_mode)
        if share == 0.0:
            continue
        loss, values = loss_of(mini[positions])
        (share * loss).backward()
        for k, v in values.items():
            out[k] += share * v
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    out["grad_norm"] = grad_norm
    finite = math.isfinite(grad_norm)
    if finite:
        optimizer.step()
    out["skipped_steps"] = float(not finite)
    optimizer.zero_grad(set_to_none=True)
    return out
