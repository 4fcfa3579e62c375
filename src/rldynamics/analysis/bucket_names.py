"""Names and labels of reward-variance buckets. Pure Python: the plots label buckets with it and import no torch.

- Metric names are RAGEN's: ``bucket_<k>``, k = 1, 2, ... (``reference/ragen_behaviour.md`` §3.4).
- quantile: ``bucket_k`` is the k-th quantile bucket, lowest reward std first; labelled ``Q<k>``.
- fixed_rv: ``bucket_k`` is always the interval [k-1, k) of group reward std (the last one [5, ∞)), also
  when lower intervals are empty, so a name means the same interval at every step and in every run;
  labelled by its interval.
- zero bucket (``analysis.zero_bucket``): ``bucket_0`` holds the zero-variance groups, labelled ``RV=0``; the
  other names keep their meaning (quantile buckets of the remaining groups; fixed_rv's first interval becomes
  (0, 1)).
"""

from __future__ import annotations

import math
import re

FIXED_RV_EDGES: tuple[float, ...] = (1.0, 2.0, 3.0, 4.0, 5.0)  # [0,1), [1,2), ..., [4,5), [5, inf)
_BUCKET_RE = re.compile(r"^bucket_(\d+)$")


ZERO_BUCKET = "bucket_0"


def bucket_name(position: int, zero_bucket: bool = False) -> str:
    """The metric name of the bucket at 0-based `position`: ``bucket_<position + 1>``, or ``bucket_<position>``
    when position 0 is the zero bucket."""
    return f"bucket_{position if zero_bucket else position + 1}"


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


def bucket_label(bucket: str, mode: str = "quantile", zero_bucket: bool = False) -> str:
    """Axis label of a bucket: ``RV=0`` (the zero bucket), ``Q3`` (quantile), ``[2, 3)`` (fixed_rv; ``(0, 1)`` for
    the first interval when the zero bucket holds RV = 0); other names unchanged."""
    k = bucket_number(bucket)
    if k is None:
        return bucket
    if k == 0:
        return "RV=0"
    interval = fixed_rv_interval(bucket) if mode == "fixed_rv" else None
    if interval is None:
        return f"Q{k}"
    low, high = interval
    opening = "(" if zero_bucket and low == 0 else "["
    return f"{opening}{low:g}, {'∞' if math.isinf(high) else f'{high:g}'})"
