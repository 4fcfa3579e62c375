"""Held-out problems: validation that shares no problem with training, by content (`val.held_out`).

Seeds alone do not separate training from validation when an env has few distinct problems: one-step additions of
1..9 are 81 problems, and RAGEN-style seeding (validation seeds 123.., training seeds 0..) shows the same "7 + 5" to
both. With `val.held_out = f > 0` a problem is the text of the env's first observation after `reset(seed)`; the
SHA-256 of that text, read as a number u in [0, 1), puts it on the validation side when u < f and on the training
side otherwise. Every seed a stage asks for is kept when its problem is on the stage's side and replaced otherwise by
the first of `seed + k * PROBE_STRIDE` (k = 1, 2, ...) whose problem is. The split depends only on the problem's
text: the same on every rank, machine and run, whatever the seeds; a problem is never on both sides.

An env whose first observation does not depend on the seed has one problem: it cannot be split, and a
side it does not fall on raises a ValueError naming the key. `problem_key` also serves validation's standard error
over distinct problems (`train/stages.py`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from functools import lru_cache

PROBE_STRIDE = 1_000_003  # a prime: the probes of nearby seeds do not meet
MAX_PROBES = 256  # at f = 0.25 a validation seed needs 4 on average; 256 misses with probability ~1e-32


def problem_key(observation: str) -> str:
    """A short, stable name of a problem: the first 16 hex digits of the SHA-256 of its first observation."""
    return hashlib.sha256(observation.encode("utf-8")).hexdigest()[:16]


def on_validation_side(key: str, held_out: float) -> bool:
    """Whether the problem named `key` belongs to validation when a share `held_out` of problems is held out."""
    return int(key, 16) / 16 ** len(key) < held_out


def side_seeds(first_observation: Callable[[int], str], seeds: list[int], held_out: float,
               validation: bool) -> list[int]:
    """`seeds` with each seed whose problem is on the other side replaced by the first probe on this side.

    `first_observation(seed)` is the env's text after `reset(seed)`. `held_out` 0 returns `seeds` unchanged."""
    if held_out <= 0:
        return list(seeds)
    out = []
    for seed in seeds:
        for k in range(MAX_PROBES):
            probe = seed + k * PROBE_STRIDE
            if on_validation_side(problem_key(first_observation(probe)), held_out) == validation:
                out.append(probe)
                break
        else:
            side = "validation" if validation else "training"
            raise ValueError(f"val.held_out={held_out}: none of {MAX_PROBES} seeds from {seed} gives a problem on the "
                             f"{side} side; the env's first observation may not depend on the seed (one problem "
                             f"only). Set val.held_out=0 to split by seed alone.")
    return out


def env_first_observation(name: str, options: dict) -> Callable[[int], str]:
    """`first_observation(seed)` of the env `name` built with `options` (cached per process: the split and the
    standard error ask for the same seeds at every validation)."""
    return _cached(name, json.dumps(options, sort_keys=True, default=repr))


@lru_cache(maxsize=64)
def _cached(name: str, options_json: str) -> Callable[[int], str]:
    from rldynamics.envs import make_env  # the env table imports every env; this module stays below it
    env = make_env(name, **json.loads(options_json))
    return lru_cache(maxsize=65536)(env.reset)


__all__ = ["MAX_PROBES", "PROBE_STRIDE", "env_first_observation", "on_validation_side", "problem_key", "side_seeds"]
