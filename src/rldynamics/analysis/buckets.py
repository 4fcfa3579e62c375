"""Split groups into reward-variance buckets for per-bucket gradient analysis.

Design choices:
- Input is one score per group (normally the within-group reward std); output is group indices, so
  the caller maps groups to rows and this module never sees a batch.
- ``quantile`` follows RAGEN's ``split_into_buckets`` (``reference/ragen_behaviour.md`` §3.4): equal
  bucket sizes with the remainder going to the highest bucket. RAGEN leaves the order of tied scores
  unspecified; here the sort is stable, so ties go to the lower group index first.
- ``fixed_rv`` uses RAGEN's fixed edges 0..5 (tuned to Sokoban's reward scale) and ignores
  ``num_buckets``; it expects non-negative scores (a std) and rejects anything else. It always returns
  all six intervals, empty ones included, so position k is interval k and ``bucket_3`` always names
  [2, 3) (RAGEN's naming; see ``bucket_names.py``); callers skip the empty ones.
- Buckets are ordered lowest score first and each is a sorted index list.
"""

from __future__ import annotations

import torch

from rldynamics.analysis.bucket_names import FIXED_RV_EDGES

BUCKET_MODES: tuple[str, ...] = ("quantile", "fixed_rv")


def _quantile_buckets(scores: torch.Tensor, num_buckets: int) -> list[list[int]]:
    """Equal-size buckets over the stable ascending order; the last bucket takes the remainder."""
    num_groups = scores.numel()
    num_b = min(num_buckets, num_groups)
    order = torch.sort(scores, stable=True).indices.tolist()  # G
    size = num_groups // num_b
    bounds = [b * size for b in range(num_b)] + [num_groups]
    return [sorted(order[bounds[b] : bounds[b + 1]]) for b in range(num_b)]


def _fixed_rv_buckets(scores: torch.Tensor) -> list[list[int]]:
    """Buckets by value: bucket b holds scores in [b, b+1) for b < 5, the last one [5, inf); empty ones kept."""
    if not bool((scores >= 0).all()):  # also rejects nan
        raise ValueError("fixed_rv bucketing expects non-negative group scores (reward std)")
    edges = torch.tensor(FIXED_RV_EDGES, dtype=scores.dtype)  # [5]
    which = torch.bucketize(scores, edges, right=True).tolist()  # G values in 0..5
    buckets: list[list[int]] = [[] for _ in range(len(FIXED_RV_EDGES) + 1)]
    for group, b in enumerate(which):
        buckets[b].append(group)
    return buckets


def assign_buckets(group_scores: torch.Tensor, *, mode: str = "quantile", num_buckets: int = 6) -> list[list[int]]:
    """Assign every group to one score bucket.

    Args:
        group_scores: ``[G]`` per-group score, normally the within-group reward std ("RV").
        mode: quantile (``B = min(num_buckets, G)`` buckets of ``G // B`` groups in ascending score
            order, the highest bucket also taking the ``G % B`` remainder) or fixed_rv (intervals
            [0,1), [1,2), [2,3), [3,4), [4,5), [5,∞); scores must be ≥ 0).
        num_buckets: ≥ 1; used by quantile only.

    Returns:
        Buckets, lowest scores first; each a sorted list of group indices. Together they partition
        ``range(G)``. quantile buckets are never empty; fixed_rv returns all six intervals (empty ones
        included), so the bucket at position k is always interval k.
    """
    if mode not in BUCKET_MODES:
        raise ValueError(f"mode must be one of {BUCKET_MODES}, got {mode!r}")
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    if group_scores.dim() != 1:
        raise ValueError(f"group_scores must be [G], got shape {tuple(group_scores.shape)}")
    scores = group_scores.detach().cpu()  # [G]
    if scores.numel() == 0:
        return []
    if mode == "quantile":
        return _quantile_buckets(scores, num_buckets)
    return _fixed_rv_buckets(scores)
