"""Sweep protocols: a name and values expand to points, each a label and the `key=value` overrides it adds.

The built-in protocols reproduce RAGEN's intervention scripts (`run_top_p_sweep.sh`, `run_kl_sweep.sh`,
`run_entropy_sweep.sh`) as overrides on top of any preset, so the same protocol runs on the CPU tiny preset
and on a GPU preset with a real model. Every point carries the full override set it applies; nothing
else about the point is implicit. Labels follow the scripts' directory names (`0.9`, `nofilter`, `kl0.003`).

- `top_p`: RV-filter strength. top_p, softmax, largest, reward std, loss scaling none; KL 0.001 (k1) and
  entropy 0.001 on. `1.0` keeps zero-variance groups out (include_zero false); `nofilter` is value 1.0
  with include_zero true (a true no-filter run).
- `kl`: KL loss coefficient, entropy 0, filter off (value 1.0; include_zero true unless `exclude_zero`).
  At 0 no reference model is loaded and no KL term is computed (the trainer loads one only when > 0).
- `entropy`: entropy coefficient, KL 0, filter off as in `kl`.
- `custom`: any config keys over given values; several keys make the full grid.

This module imports no torch.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

TOP_P_VALUES = ("1.0", "0.98", "0.95", "0.9", "0.8", "0.6", "0.4", "nofilter")
COEF_VALUES = ("0", "0.001", "0.003", "0.01", "0.03", "0.1")
NOFILTER = "nofilter"

FILTER_SETTINGS = ("filter.strategy=top_p", "filter.keep=largest", "filter.metric=reward_std",
                   "filter.loss_scaling=none")
TOP_P_FIXED = (*FILTER_SETTINGS, "filter.prob_mode=softmax", "algo.kl_coef=0.001", "algo.kl_type=k1",
               "algo.entropy_coef=0.001")
PROTOCOLS = ("top_p", "kl", "entropy", "custom")


class SweepError(ValueError):
    """Bad sweep input (protocol, values, keys, out directory); the message says how to fix it."""


@dataclass(frozen=True)
class Point:
    """One sweep point: its directory label, the swept value(s) as typed, and every override it applies."""

    label: str
    value: str
    overrides: tuple[str, ...]


@dataclass
class Protocol:
    """A named sweep: the swept config keys and its points, in order."""

    name: str
    keys: tuple[str, ...]
    points: list[Point] = field(default_factory=list)


def split_values(text: str) -> list[str]:
    """`"0.9,nofilter"` -> `["0.9", "nofilter"]`; commas inside brackets stay (`"[5,5],[6,6]"` -> 2 values)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out.append(cur.strip())
    if any(v == "" for v in out):
        raise SweepError(f"--values {text!r} has an empty entry; give a comma-separated list, e.g. 0.9,nofilter")
    return out


def _number(value: str, what: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise SweepError(f"{what} value {value!r} is not a number") from None
    if number < 0:
        raise SweepError(f"{what} value {value!r} must be >= 0")
    return number


def top_p(values: list[str] | None = None) -> Protocol:
    """RAGEN's top-p sweep over `filter.value` (`nofilter` = 1.0 with zero-variance groups kept)."""
    points = []
    for v in values or TOP_P_VALUES:
        if v == NOFILTER:
            points.append(Point(v, v, (*TOP_P_FIXED, "filter.value=1.0", "filter.include_zero=true")))
        else:
            _number(v, "top_p (or `nofilter`)")
            points.append(Point(v, v, (*TOP_P_FIXED, f"filter.value={v}", "filter.include_zero=false")))
    return Protocol("top_p", ("filter.value",), points)


def _coef_protocol(name: str, key: str, prefix: str, fixed: tuple[str, ...], values: list[str] | None,
                   exclude_zero: bool) -> Protocol:
    filter_off = (*FILTER_SETTINGS, "filter.value=1.0", f"filter.include_zero={str(not exclude_zero).lower()}")
    points = []
    for v in values or COEF_VALUES:
        _number(v, name)
        points.append(Point(f"{prefix}{v}", v, (*filter_off, *fixed, f"{key}={v}")))
    return Protocol(name, (key,), points)


def kl(values: list[str] | None = None, exclude_zero: bool = False) -> Protocol:
    """RAGEN's KL sweep over `algo.kl_coef` (entropy 0, filter off)."""
    return _coef_protocol("kl", "algo.kl_coef", "kl", ("algo.entropy_coef=0.0", "algo.kl_type=k1"), values,
                          exclude_zero)


def entropy(values: list[str] | None = None, exclude_zero: bool = False) -> Protocol:
    """RAGEN's entropy sweep over `algo.entropy_coef` (KL 0, filter off)."""
    return _coef_protocol("entropy", "algo.entropy_coef", "ent", ("algo.kl_coef=0.0",), values, exclude_zero)


def custom(keys: list[str], values: list[list[str]]) -> Protocol:
    """Any config keys over their values; several keys give the full grid (first key varies slowest)."""
    if not keys:
        raise SweepError("custom needs at least one config key, e.g. `rldyn sweep custom train.lr --values 1e-4,3e-4`")
    if len(values) != len(keys):
        raise SweepError(f"custom: {len(keys)} key(s) ({', '.join(keys)}) but {len(values)} --values list(s); "
                         "give one --values per key, in the same order")
    if len(set(keys)) != len(keys):
        raise SweepError(f"custom: a key is given twice ({', '.join(keys)})")
    leaves = [k.rsplit(".", 1)[-1] for k in keys]
    names = leaves if len(set(leaves)) == len(leaves) else list(keys)
    points = []
    for combo in itertools.product(*values):
        label = "_".join(f"{n}{_safe(v)}" for n, v in zip(names, combo, strict=True))
        overrides = tuple(f"{k}={v}" for k, v in zip(keys, combo, strict=True))
        points.append(Point(label, ",".join(combo), overrides))
    return Protocol("custom", tuple(keys), points)


def _safe(value: str) -> str:
    """A value as a directory-name fragment: anything but letters, digits and `._+-` becomes `-`."""
    return re.sub(r"[^A-Za-z0-9._+-]", "-", value)


def expand(name: str, values: list[list[str]] | None = None, keys: list[str] | None = None,
           exclude_zero: bool = False) -> Protocol:
    """The protocol `name` with its points; `values` holds one list per swept key (None = the defaults)."""
    keys = keys or []
    if name not in PROTOCOLS:
        raise SweepError(f"unknown sweep {name!r}; choose one of: {', '.join(PROTOCOLS)}")
    if name == "custom":
        return _check_labels(custom(keys, values or []))
    if keys:
        raise SweepError(f"unexpected argument(s) {' '.join(keys)}: overrides are key=value; config keys to sweep "
                         "are only given with `custom`")
    if values and len(values) > 1:
        raise SweepError(f"{name} takes one --values list")
    if exclude_zero and name == "top_p":
        raise SweepError("--exclude-zero applies to the kl and entropy sweeps; top_p sets include_zero per point")
    vals = values[0] if values else None
    protocol = top_p(vals) if name == "top_p" else (kl if name == "kl" else entropy)(vals, exclude_zero)
    return _check_labels(protocol)


def _check_labels(protocol: Protocol) -> Protocol:
    labels = [p.label for p in protocol.points]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise SweepError(f"point(s) {', '.join(twice)} given more than once in --values")
    return protocol
