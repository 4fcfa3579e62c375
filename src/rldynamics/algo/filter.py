"""Group-level rollout filtering: per-group statistics, selection and filter metrics.

Design choices:
- Works on a ``[G, n]`` matrix of one per-trajectory metric (G groups of n trajectories each), so
  the caller decides what a row is (trajectory or episode) before calling in here.
- ``select_groups`` reproduces RAGEN's ``_select_top_groups`` (see ``docs/reference/ragen_behaviour.md``
  §2.4), including its quirks (linear top-p never keeps non-positive scores and returns nothing for an
  all-zero score vector). Unlike RAGEN, every sort is stable, so ties go to the lower group index and
  the selection is deterministic.
- Scores are taken in float32, as RAGEN's are, whatever dtype the caller passes: the selection is a
  function of the float32 scores. top_p does RAGEN's arithmetic: float32 softmax, float32 cumulative mass
  and a float32 threshold, in the same order of operations. At an exact mass boundary the rounding
  decides, and it decides as in RAGEN: 10 equal scores at p = 0.9 keep 9 groups (the float32 mass of 9
  groups, 0.90000004, reaches 0.9), where float64 arithmetic would keep 10. min_p's thresholds are float32
  too: at value 1 the smallest score passes ``score ≤ min/(1+1e-10) + 1e-10``, which float64 would refuse.
- Metrics are python floats with the ``rollout/`` keys of RAGEN's reward filter.
"""

from __future__ import annotations

import math

import torch

from rldynamics.metric_names import ROLLOUT, filter_metric

STRATEGIES: tuple[str, ...] = ("top_p", "top_k", "top_k_abs", "min_p")
KEEP_MODES: tuple[str, ...] = ("largest", "smallest")
PROB_MODES: tuple[str, ...] = ("linear", "softmax")
LOSS_SCALE_MODES: tuple[str, ...] = ("none", "linear", "sqrt")
_ZERO_TOL = 1e-10
# metric name (and aliases) -> key of group_stats
_METRIC_TO_STAT = {
    "reward_std": "std",
    "reward_variance": "std",
    "reward": "mean",
    "reward_mean": "mean",
    "reward_sum": "sum",
    "reward_max": "max",
}


def group_stats(values: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-group statistics of a per-trajectory metric.

    Args:
        values: ``[G, n]`` metric per trajectory, one row per group (equal group sizes, n ≥ 1).

    Returns:
        dict with ``std`` (unbiased, 0 when n == 1), ``mean``, ``max``, ``sum``; each ``[G]``.
    """
    if values.dim() != 2 or values.shape[1] < 1:
        raise ValueError(f"values must be [G, n] with n >= 1, got shape {tuple(values.shape)}")
    v = values if values.is_floating_point() else values.float()  # [G, n]
    std = v.std(dim=1, unbiased=True) if v.shape[1] > 1 else torch.zeros_like(v[:, 0])  # [G]
    return {"std": std, "mean": v.mean(dim=1), "max": v.max(dim=1).values, "sum": v.sum(dim=1)}


def group_scores(group_values: torch.Tensor, metric: str) -> torch.Tensor:
    """Selection score per group.

    Args:
        group_values: ``[G, n]`` per-trajectory rewards.
        metric: reward_std (alias reward_variance) -> std; reward (alias reward_mean) -> mean;
            reward_sum -> sum; reward_max -> max. Case-insensitive.

    Returns:
        ``[G]`` scores.
    """
    key = _METRIC_TO_STAT.get(metric.lower())
    if key is None:
        raise ValueError(f"metric must be one of {tuple(_METRIC_TO_STAT)}, got {metric!r}")
    return group_stats(group_values)[key]  # [G]


def _check_selection_args(strategy: str, value: float, keep: str, prob_mode: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if keep not in KEEP_MODES:
        raise ValueError(f"keep must be one of {KEEP_MODES}, got {keep!r}")
    if prob_mode not in PROB_MODES:
        raise ValueError(f"prob_mode must be one of {PROB_MODES}, got {prob_mode!r}")
    if not value >= 0:  # also rejects nan
        raise ValueError(f"value must be >= 0, got {value}")


def _ranked(candidates: torch.Tensor, cand_scores: torch.Tensor, keep: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates ordered best first (stable: ties keep the lower group index first)."""
    order = torch.sort(cand_scores, descending=keep == "largest", stable=True).indices  # [C]
    return candidates[order], cand_scores[order]  # [C], [C]


def _top_p_softmax(cand_scores: torch.Tensor, value: float, keep: str) -> int:
    """Number of best-ranked groups whose softmax mass first reaches ``value`` (RAGEN's float32 arithmetic).

    ``cand_scores`` (float32) are in candidate (group) order: the softmax normaliser is summed in that order, as
    in RAGEN.
    """
    logits = cand_scores if keep == "largest" else -cand_scores  # [C] float32
    probs = torch.sort(torch.softmax(logits, dim=0), descending=True).values  # [C]
    cum = torch.cumsum(probs, dim=0)  # [C] float32
    first = int(torch.searchsorted(cum, value))  # a python scalar is compared in cum's dtype (float32)
    return min(first + 1, cand_scores.numel())


def _top_p_linear(cand_scores: torch.Tensor, ranked_scores: torch.Tensor, value: float, eps: float) -> int:
    """Length of the walked prefix for linear top-p, or 0 when the threshold is never reached.

    As in RAGEN, the threshold is a float32 tensor (sum in candidate order) and the running sum, a python
    float, is compared with it in float32.
    """
    threshold = value * cand_scores.sum() - eps  # [] float32
    running, count = 0.0, 0
    for score in ranked_scores.tolist():
        if bool(running >= threshold) or score <= 0:
            break
        running += score
        count += 1
    return count if bool(running >= threshold) else 0


def _num_kept(
    cand_scores: torch.Tensor, ranked_scores: torch.Tensor, strategy: str, value: float, num_groups: int, *,
    prob_mode: str, keep: str, eps: float
) -> int:
    """How many of the best-ranked candidates top_p / top_k / top_k_abs keep (scores in candidate and rank order)."""
    num_cand = ranked_scores.numel()
    if strategy == "top_k":
        return max(1, min(int(value * num_groups), num_cand))
    if strategy == "top_k_abs":
        return max(1, min(int(value), num_cand))
    if value >= 1:  # top_p no-op
        return num_cand
    if prob_mode == "softmax":
        return _top_p_softmax(cand_scores, value, keep)
    return _top_p_linear(cand_scores, ranked_scores, value, eps)


def select_groups(
    scores: torch.Tensor,
    *,
    strategy: str,
    value: float,
    keep: str = "largest",
    prob_mode: str = "linear",
    include_zero: bool = True,
    eps: float = 0.01,
) -> torch.Tensor:
    """Choose which groups to keep, following RAGEN's rollout filter (``docs/reference/ragen_behaviour.md`` §2.4).

    Args:
        scores: ``[G]`` group scores (e.g. within-group reward std); taken in float32, as RAGEN's are.
        strategy: top_p (probability mass ``value``; ``value ≥ 1`` keeps every candidate) | top_k
            (``int(value·G)`` groups, clamped to [1, #candidates]) | top_k_abs (``int(value)``, clamped) |
            min_p (largest: ``score ≥ max·value - 1e-10``; smallest: ``score ≤ min/(value+1e-10) + 1e-10``).
        value: strategy parameter, ≥ 0.
        keep: largest keeps high scores, smallest keeps low scores.
        prob_mode: top_p only: softmax (mass of ``softmax(±score)``) or linear (mass of the raw scores,
            minus ``eps`` slack; non-positive scores stop the walk; may return nothing).
        include_zero: if False, groups with ``|score| ≤ 1e-10`` are dropped before selection.
        eps: slack for linear top_p.

    Returns:
        ``[K]`` sorted LongTensor of kept group indices (possibly empty).
    """
    _check_selection_args(strategy, value, keep, prob_mode)
    if scores.dim() != 1:
        raise ValueError(f"scores must be [G], got shape {tuple(scores.shape)}")
    scores32 = scores.detach().cpu().float()  # [G] float32
    candidates = torch.arange(scores.numel())  # [G]
    if not include_zero:
        candidates = candidates[scores32.abs() > _ZERO_TOL]  # [C]
    if candidates.numel() == 0:
        return candidates  # [0]
    cand_scores = scores32[candidates]  # [C] float32
    if strategy == "min_p":
        if keep == "largest":
            kept = candidates[cand_scores >= cand_scores.max() * value - _ZERO_TOL]  # [K]
        else:
            kept = candidates[cand_scores <= cand_scores.min() / (value + _ZERO_TOL) + _ZERO_TOL]  # [K]
        return kept.sort().values  # [K]
    ranked, ranked_scores = _ranked(candidates, cand_scores, keep)  # [C], [C]
    k = _num_kept(cand_scores, ranked_scores, strategy, value, scores.numel(), prob_mode=prob_mode, keep=keep,
                  eps=eps)
    return ranked[:k].sort().values  # [K]


def mean_or_zero(x: torch.Tensor) -> float:
    """The mean of a per-group statistic [G] (0.0 for no groups)."""
    return float(x.mean()) if x.numel() else 0.0


def kept_ratio(kept: torch.Tensor, num_groups: int) -> float:
    """Kept groups / all groups (0.0 for no groups): what the advantages' loss scaling reads."""
    return kept.numel() / num_groups if num_groups else 0.0


def filter_metrics(group_values: torch.Tensor, kept: torch.Tensor, scores: torch.Tensor,
                   prefix: str = ROLLOUT) -> dict[str, float]:
    """Metrics describing one filtering decision (RAGEN ``rollout/*`` names,
    ``docs/reference/ragen_behaviour.md`` §2.7).

    Args:
        group_values: ``[G, n]`` per-trajectory rewards.
        kept: ``[K]`` kept group indices (as returned by :func:`select_groups`).
        scores: ``[G]`` the selection scores.
        prefix: the metric namespace (``rollout``; a separate analysis batch: ``grad_analysis``).

    Returns:
        ``rollout/in_group_reward_{std,max,mean,sum}`` (mean over all groups),
        ``rollout/chosen_in_group_reward_{std,max,mean,sum}`` (mean over kept groups, 0 if none), the
        same without ``reward_`` for std/max/mean (the scoring metric is the reward here),
        ``rollout/filter_kept_count``, ``rollout/filter_kept_ratio`` and ``rollout/filter_zero_count``
        (groups with ``|score| ≤ 1e-10``).
    """
    if scores.shape != group_values.shape[:1]:
        raise ValueError(f"scores must be [G] = {tuple(group_values.shape[:1])}, got {tuple(scores.shape)}")
    stats = group_stats(group_values)  # each [G]
    kept = kept.long().cpu()  # [K]
    values: dict[str, float] = {}
    for name, per_group in stats.items():
        values[f"in_group_reward_{name}"] = mean_or_zero(per_group.detach().cpu())
        values[f"chosen_in_group_reward_{name}"] = mean_or_zero(per_group.detach().cpu()[kept])
    for name in ("std", "max", "mean"):
        values[f"in_group_{name}"] = values[f"in_group_reward_{name}"]
        values[f"chosen_in_group_{name}"] = values[f"chosen_in_group_reward_{name}"]
    values["filter_kept_count"] = float(kept.numel())
    values["filter_kept_ratio"] = kept_ratio(kept, group_values.shape[0])
    values["filter_zero_count"] = float((scores.abs() <= _ZERO_TOL).sum())
    return {filter_metric(prefix, name): v for name, v in values.items()}


def loss_scale(kept_ratio: float, mode: str) -> float:
    """Advantage multiplier after filtering (RAGEN ``filter_loss_scaling``).

    Args:
        kept_ratio: kept groups / all groups, in [0, 1].
        mode: none -> 1; linear -> r; sqrt -> sqrt(r).

    Returns:
        the scale as a python float.
    """
    if mode not in LOSS_SCALE_MODES:
        raise ValueError(f"loss scale mode must be one of {LOSS_SCALE_MODES}, got {mode!r}")
    if not 0.0 <= kept_ratio <= 1.0:
        raise ValueError(f"kept_ratio must be in [0, 1], got {kept_ratio}")
    return {"none": 1.0, "linear": kept_ratio, "sqrt": math.sqrt(kept_ratio)}[mode]
