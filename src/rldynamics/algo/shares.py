"""Aggregation shares and global sums: how a sub-batch's loss enters the loss of the whole batch.

Every aggregation mode weights tokens uniformly within the rows it sees, so a loss aggregated over a batch is the
share-weighted sum of the same loss aggregated over each part of a partition (``sub_batch_share``). The update
(micro-batches of a mini-batch) and the gradient probe (micro-batches of a bucket, buckets of the batch) use these
shares, in one process or under ``torch.distributed``: there each rank holds a shard of the batch, shares are taken
against the aggregation of the rows of every rank together (rebuilt from gathered per-row token counts) and sums
of floats are all-reduced.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rldynamics.algo.losses import aggregation_weights


def sub_batch_share(mask: torch.Tensor, rows: torch.Tensor, mode: str) -> float:
    """Weight of `rows` in `aggregate(., mask, mode)` relative to aggregating `rows` alone.

    Every aggregation mode weights tokens uniformly within the rows it sees, so
    `aggregate(v, mask, mode) == sum over chunks of share(chunk) * aggregate(v[chunk], mask[chunk], mode)`.
    Returns 0 for rows without response tokens.
    """
    whole = aggregation_weights(mask, mode)[rows].sum()  # []
    alone = aggregation_weights(mask[rows], mode).sum()  # []
    return float(whole / alone) if alone > 0 else 0.0


def distributed() -> bool:
    """True when running under an initialised ``torch.distributed`` process group."""
    return dist.is_available() and dist.is_initialized()


def global_sum(values: list[float]) -> list[float]:
    """Element-wise sum of ``values`` over ranks (identity in one process)."""
    if not distributed():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=_collective_device())  # [K]
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def _collective_device() -> torch.device:
    """The device tensors must live on for collectives of the default backend."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def present_groups(group_ids: torch.Tensor, group_std: dict[int, float]) -> dict[int, float]:
    """``group id -> reward std`` for the groups among ``group_ids`` [N] (on any rank, when distributed)."""
    present = sorted(set(group_ids.tolist()))
    missing = [g for g in present if g not in group_std]
    if missing:
        raise ValueError(f"group_std has no reward std for group ids {missing[:10]}")
    local = {g: float(group_std[g]) for g in present}
    if not distributed():
        return local
    gathered: list[dict[int, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return {g: s for part in gathered for g, s in (part or {}).items()}


def _global_row_weights(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Total aggregation weight of each local row when the rows of ``mask`` on all ranks are aggregated together. [n]

    The weights of a row depend only on its token count and the width (every mode weights tokens uniformly
    within a row), so the global aggregation is rebuilt from the gathered per-row token counts.
    """
    counts = mask.bool().sum(-1).tolist()  # n ints
    gathered: list[tuple[list[int], int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (counts, mask.shape[-1]))
    width = max(w for _, w in gathered)
    every = torch.tensor([c for cs, _ in gathered for c in cs], dtype=torch.long)  # [N_global]
    count_mask = torch.arange(width)[None, :] < every[:, None]  # [N_global, width]
    weights = aggregation_weights(count_mask, mode).sum(-1)  # [N_global]
    offset = sum(len(cs) for cs, _ in gathered[: dist.get_rank()])
    return weights[offset : offset + len(counts)]  # [n]


def chunk_shares(mask: torch.Tensor, chunks: list[torch.Tensor], mode: str) -> list[float]:
    """``sub_batch_share`` of each chunk of local rows of ``mask``, the whole being these rows on every rank."""
    if not distributed():
        return [sub_batch_share(mask, chunk, mode) for chunk in chunks]
    row_weights = _global_row_weights(mask, mode)  # [n]
    out = []
    for chunk in chunks:
        alone = aggregation_weights(mask[chunk], mode).sum()  # []
        out.append(float(row_weights[chunk].sum() / alone) if alone > 0 else 0.0)
    return out


def bucket_shares(mask: torch.Tensor, bucket_rows: list[torch.Tensor], mode: str) -> list[float]:
    """Share of each bucket in the aggregation of the whole batch: ``g_all = Σ_b share_b · g_b``.

    Distributed: both the bucket's weight within the whole batch and its weight aggregated alone are
    summed over ranks before the ratio is taken.
    """
    if not distributed():
        return [sub_batch_share(mask, rows, mode) for rows in bucket_rows]
    whole_weights = _global_row_weights(mask, mode)  # [N]
    whole = [float(whole_weights[rows].sum()) for rows in bucket_rows]
    alone = [float(_global_row_weights(mask[rows], mode).sum()) for rows in bucket_rows]
    totals = global_sum(whole + alone)
    k = len(bucket_rows)
    return [totals[b] / totals[k + b] if totals[k + b] > 0 else 0.0 for b in range(k)]
