"""Optimizer steps over mini-batches with exact gradient accumulation over micro-batches (actor and critic).

- Each mini-batch is one optimizer step. Its rows are split into micro-batches (from shortest to longest when
  `sort_by_length`, so each forward is trimmed to its own longest row, or keeping the rows of a shared prompt
  together with `shared_prefix`: `models.forward.row_order`); each micro-batch's loss is multiplied by
  `sub_batch_share`, the share of the mini-batch's aggregation weight its rows carry, so the accumulated gradient
  is that of the whole mini-batch aggregated at once, whatever the micro-batch size.
- Statistics are exact too: a loss value is weighted like the loss (`sub_batch_share`), a token-level mean
  (clip fractions, `ppo_kl`, `vpred_mean`) by the micro-batch's share of the mini-batch's response tokens.
- The gradient is clipped to `max_grad_norm` (the pre-clip norm is the `grad_norm` statistic); a non-finite norm
  skips the optimizer step and counts it in `skipped_steps`.
- Several ranks: every rank holds the whole batch and takes a contiguous block of each mini-batch's row order
  (`dist.rank_chunks`); shares are still taken against the whole mini-batch, so the gradients summed over ranks (FSDP2's
  reduce-scatter, or `sync_gradients` for replicas) and the statistics summed over ranks are those of one
  process. Sharded models run a forward/backward only in step with every rank: a rank with fewer micro-batches
  (or one without response tokens) runs its first row with weight 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rldynamics import dist
from rldynamics.algo.shares import sub_batch_share
from rldynamics.models.forward import row_order
from rldynamics.models.sharding import clip_gradients, is_sharded, sync_gradients
from rldynamics.rollout.batch import RolloutBatch

LossFn = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


def optimize(model, optimizer, batch: RolloutBatch, minis: list[torch.Tensor], loss_of: LossFn, *,
             stats: tuple[str, ...], token_stats: tuple[str, ...] = (), micro_batch_size: int, max_grad_norm: float,
             agg_mode: str, sort_by_length: bool = True, shared_prefix: bool = False) -> dict[str, float]:
    """One optimizer step per mini-batch of `minis` (row indices of `batch`); returns the step statistics.

    Args:
        loss_of: rows [n] -> (loss aggregated over those rows alone, {statistic: value}); called once per
            micro-batch that has response tokens.
        stats: the statistics `loss_of` reports, each a loss value aggregated like the loss, or, those also in
            `token_stats`, a mean over the rows' response tokens.
    Returns:
        The mean over optimizer steps of each statistic (share-weighted over a step's micro-batches) and of
        `grad_norm`, `skipped_steps` (a count) and `num_updates`.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    sums: dict[str, float] = {}
    for mini in minis:
        order = (row_order(batch.input_ids[mini], batch.attention_mask[mini], batch.response_mask[mini],
                           micro_batch_size, shared_prefix) if sort_by_length else torch.arange(len(mini)))  # [m]
        step = _step(model, optimizer, params, batch, mini, order, loss_of, stats, token_stats, micro_batch_size,
                     max_grad_norm, agg_mode)
        for k, v in step.items():
            sums[k] = sums.get(k, 0.0) + v
    count = len(minis)
    out = {k: v / max(count, 1) for k, v in sums.items() if k != "skipped_steps"}
    out["skipped_steps"] = sums.get("skipped_steps", 0.0)
    out["num_updates"] = float(count)
    return out


def _step(model, optimizer, params, batch: RolloutBatch, mini: torch.Tensor, order: torch.Tensor, loss_of: LossFn,
          stats: tuple[str, ...], token_stats: tuple[str, ...], micro_batch_size: int, max_grad_norm: float,
          agg_mode: str) -> dict[str, float]:
    """Accumulate the mini-batch gradient over micro-batches of `order` [m], clip, and step (skipped when the norm
    is not finite)."""
    optimizer.zero_grad(set_to_none=True)
    out = dict.fromkeys(stats, 0.0)
    for positions in dist.rank_chunks(order, micro_batch_size, lockstep=is_sharded(model)):
        share = 0.0 if positions is None else sub_batch_share(batch.response_mask[mini], positions, agg_mode)
        if share == 0.0 and not is_sharded(model):
            continue
        loss, values = loss_of(mini[order[:1] if positions is None else positions])
        (share * loss).backward()
        if share == 0.0:
            continue
        tokens = sub_batch_share(batch.response_mask[mini], positions, "token-mean")
        for k, v in values.items():
            out[k] += (tokens if k in token_stats else share) * v
    sync_gradients(model)
    out = dict(zip(out, dist.global_sum(list(out.values())), strict=True))
    grad_norm = clip_gradients(params, max_grad_norm)
    out["grad_norm"] = grad_norm
    finite = math.isfinite(grad_norm)
    if finite:
        optimizer.step()
    out["skipped_steps"] = float(not finite)
    optimizer.zero_grad(set_to_none=True)
    return out

