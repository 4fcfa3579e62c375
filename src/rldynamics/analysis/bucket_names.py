"""Names and labels of reward-variance buckets. Pure Python: the plots label buckets with it and import no torch.

- Metric names are RAGEN's: ``bucket_<k>``, k = 1, 2, ... (``reference/ragen_behaviour.md`` §3.4).
- quantile: ``bucket_k`` is the k-th quantile bucket, lowest reward std first; labelled ``Q<k>``.
- fixed_rv: ``bucket_k`` is always the interval [k-1, k) of group reward std (the last one [5, ∞)), also
  when lower intervals are empty, so a name means the same interval at every step and in every run;
  labelled by its interval.
"""

from __future__ import annotations

import math
import re

FIXED_RV_EDGES: tuple[float, ...] = (1.0, 2.0, 3.0, 4.0, 5.0)  # [0,1), [1,2), ..., [4,5), [5, inf)
_BUCKET_RE = re.compile(r"^bucket_(\d+)$")


def bucket_name(position: int) -> str:
    """The metric name of the bucket at 0-based `position`: ``bucket_<position + 1>``."""
    return f"bucket_{position + 1}"


def bucket_number(bucket: str) -> int | None:
    """k of ``bucket_k``; None for any other name (e.g. ``all``)."""
    m = _BUCKET_RE.match(bucket)
    return int(m.group(1)) if m else None


def fixed_rv_interval(bucket: str) -> tuple[float, float] | None:
    """The reward-std interval [low, high) of a fixed_rv bucket name; None for other names."""
    k = bucket_number(bucket)
    if k is None or not 1 <= k <= len(FIXED_RV_EDGES) + 1:
        return None
    edges = (0.0, *FIXED_RV_EDGES, math.inf)
    return edges[k - 1], edges[k]


def bucket_label(bucket: str, mode: str = "quantile") -> str:
    """Axis label of a bucket: ``Q3`` (quantile), ``[2, 3)`` (fixed_rv); other names unchanged."""
    k = bucket_number(bucket)
    if k is None:
        return bucket
    interval = fixed_rv_interval(bucket) if mode == "fixed_rv" else None
    if interval is None:
        return f"Q{k}"
    low, high = interval
    return f"[{low:g}, {'∞' if math.isinf(high) else f'{high:g}'})"
