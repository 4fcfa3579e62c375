"""Split groups into reward-variance buckets for per-bucket gradient analysis.

Design choices:
- Input is one score per group (normally the within-group reward std, "RV"); output is group indices, so
  the caller maps groups to rows and this module never sees a batch.
- ``quantile`` follows RAGEN's ``split_into_buckets`` (``docs/reference/ragen_behaviour.md`` §3.4): equal
  bucket sizes with the remainder going to the highest bucket. RAGEN leaves the order of tied scores
  unspecified; here the sort is stable, so ties go to the lower group index first.
- ``fixed_rv`` uses RAGEN's fixed edges 0..5 (tuned to Sokoban's reward scale) and ignores
  ``num_buckets``; it expects non-negative scores (a std) and rejects anything else. It always returns
  all six intervals, empty ones included, so position k is interval k and ``bucket_3`` always names
  [2, 3) (RAGEN's naming; see ``metric_names.py``); callers skip the empty ones.
- ``zero_bucket``: groups whose score is at most ``ZERO_RV_TOL`` (identical rewards, up to float rounding)
  get a bucket of their own at position 0 (``bucket_0``), returned even when empty. The others are split as
  above, with one change to quantile buckets: groups whose scores are equal (consecutive differences within
  ``ZERO_RV_TOL`` in ascending order) always share a bucket. Each cut of the equal-size split that falls
  inside such a run of ties moves to the nearer end of the run (to its upper end on an exact middle, so the
  tied groups join the lower bucket); cuts that meet merge, so long runs of ties can leave fewer buckets.
- Buckets are ordered lowest score first and each is a sorted index list.
"""

from __future__ import annotations

import torch

from rldynamics.metric_names import FIXED_RV_EDGES

BUCKET_MODES: tuple[str, ...] = ("quantile", "fixed_rv")
ZERO_RV_TOL = 1e-6
"""Reward std at or below which a group counts as zero-variance (and two stds as tied). Identical rewards give
exactly 0; float32 rewards of magnitude up to ~10 (every shipped env) that are equal but were summed in another
order differ by at most a few 1e-7."""


def _quantile_cuts(scores: torch.Tensor, num_buckets: int, keep_ties: bool) -> tuple[list[int], list[int]]:
    """The stable ascending order of the groups and the bucket boundaries in it (first 0, last G)."""
    num_groups = scores.numel()
    num_b = min(num_buckets, num_groups)
    sorted_scores, order = torch.sort(scores, stable=True)  # [G], [G]
    size = num_groups // num_b
    cuts = [b * size for b in range(1, num_b)]
    if keep_ties:
        cuts = _cuts_outside_ties(sorted_scores, cuts)
    return order.tolist(), [0, *cuts, num_groups]


def _cuts_outside_ties(sorted_scores: torch.Tensor, cuts: list[int]) -> list[int]:
    """Move each cut that splits a run of tied scores to the nearer end of the run (the upper end on a tie)."""
    num_groups = sorted_scores.numel()
    new_run = torch.ones(num_groups, dtype=torch.bool)  # [G] True where a run of ties starts
    new_run[1:] = (sorted_scores[1:] - sorted_scores[:-1]) > ZERO_RV_TOL
    starts = new_run.nonzero().squeeze(1).tolist() + [num_groups]
    moved = []
    for cut in cuts:
        lo = max(s for s in starts if s <= cut)
        hi = min(s for s in starts if s >= cut)
        moved.append(lo if cut - lo < hi - cut else hi)
    return sorted({c for c in moved if 0 < c < num_groups})


def _quantile_buckets(scores: torch.Tensor, num_buckets: int, keep_ties: bool) -> list[list[int]]:
    """Equal-size buckets over the stable ascending order; the last bucket takes the remainder."""
    order, bounds = _quantile_cuts(scores, num_buckets, keep_ties)
    return [sorted(order[lo:hi]) for lo, hi in zip(bounds, bounds[1:], strict=False)]


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


def assign_buckets(group_scores: torch.Tensor, *, mode: str = "quantile", num_buckets: int = 6,
                   zero_bucket: bool = False) -> list[list[int]]:
    """Assign every group to one score bucket.

    Args:
        group_scores: ``[G]`` per-group score, normally the within-group reward std ("RV").
        mode: quantile (``B = min(num_buckets, G)`` buckets of ``G // B`` groups in ascending score
            order, the highest bucket also taking the ``G % B`` remainder) or fixed_rv (intervals
            [0,1), [1,2), [2,3), [3,4), [4,5), [5,∞); scores must be ≥ 0).
        num_buckets: ≥ 1; used by quantile only (with ``zero_bucket``: buckets of the non-zero groups).
        zero_bucket: put the groups with score ≤ ``ZERO_RV_TOL`` first, in a bucket of their own, and keep tied
            scores in one quantile bucket (module docstring).

    Returns:
        Buckets, lowest scores first; each a sorted list of group indices. Together they partition
        ``range(G)``. quantile buckets are never empty; fixed_rv returns all six intervals (empty ones
        included), so the bucket at position k is always interval k. With ``zero_bucket`` the zero bucket
        comes first (position 0, maybe empty) and the buckets above follow it.
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
    if mode == "fixed_rv":
        buckets = _fixed_rv_buckets(scores)
        if not zero_bucket:
            return buckets
        zero = [g for g in buckets[0] if scores[g] <= ZERO_RV_TOL]
        return [zero, [g for g in buckets[0] if scores[g] > ZERO_RV_TOL], *buckets[1:]]
    if not zero_bucket:
        return _quantile_buckets(scores, num_buckets, keep_ties=False)
    is_zero = scores <= ZERO_RV_TOL  # [G]
    rest = (~is_zero).nonzero().squeeze(1)  # [G'] indices of the non-zero groups
    above = _quantile_buckets(scores[rest], num_buckets, keep_ties=True) if rest.numel() else []
    return [is_zero.nonzero().squeeze(1).tolist(), *[[int(rest[i]) for i in b] for b in above]]
