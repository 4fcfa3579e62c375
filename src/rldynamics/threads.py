"""How many CPU threads torch computes with: the one owner of that choice (imports no torch; sweeps use it too).

Precedence: `model.threads` (when > 0), else an exported `OMP_NUM_THREADS`, else half of the cores this process may
use, at most 4 (`default_threads`).

Why not torch's own default (every core): torch's OpenMP threads meet at a barrier after every parallel region, so
while another process holds one of the cores the whole team waits for the thread that is not running. On a 2-core
machine shared with other work (load average about 8), three forward + backward passes of the default tiny model
(batch 32 x 160 tokens) took 0.6-1.0 s on 1 thread and 7.3-7.7 s on 2 (docs/training.md, "CPU threads"). Half of
the cores leaves the other half to the rest of the machine; the cap of 4 is where the default model's 64-wide
matrices leave a larger team little to split.

Ranks (`rldyn train --nproc auto`, the default; `auto_ranks`): two processes meet only where a step gathers or sums
(a few times a step, not after every parallel region), so on a CPU a second rank uses a second core without the
team's fragility: on an idle 2-core machine the default job's step took 1.8x less time on two ranks than on one
process, and beside one other 1-thread job the same time as one process (docs/training.md, "CPU ranks and threads").
Each rank then computes on half of its share of the cores (`rank_threads`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

MAX_DEFAULT = 4


def usable_cores() -> int:
    """Cores this process may use (its CPU affinity where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_threads(cores: int) -> int:
    """Half of `cores`, at least 1 and at most `MAX_DEFAULT`."""
    return max(1, min(MAX_DEFAULT, cores // 2))


def explicit_threads(environ: Mapping[str, str] = os.environ) -> int | None:
    """The thread count the environment sets explicitly (`OMP_NUM_THREADS`, a positive integer), else None."""
    value = environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def choose_threads(setting: int, environ: Mapping[str, str] = os.environ, cores: int | None = None) -> tuple[int, str]:
    """(threads, where the number comes from, in words) for `model.threads=setting` (0: not set)."""
    if setting > 0:
        return setting, f"model.threads={setting}"
    exported = explicit_threads(environ)
    if exported is not None:
        return exported, f"OMP_NUM_THREADS={exported}"
    cores = cores or usable_cores()
    return default_threads(cores), f"half of the {cores} usable cores, at most {MAX_DEFAULT}; model.threads=N sets it"


AUTO_RANKS = 2


def auto_ranks(cores: int, threads_chosen: bool) -> int:
    """Ranks `--nproc auto` starts on a CPU: `AUTO_RANKS` where that many cores are usable and no thread count was
    chosen (`model.threads`, an exported `OMP_NUM_THREADS`: the user's budget, a sweep's slot), else 1."""
    return AUTO_RANKS if cores >= AUTO_RANKS and not threads_chosen else 1


def rank_threads(cores: int, ranks: int) -> int:
    """Threads of each of `ranks` ranks on `cores` cores: half of a rank's share (`default_threads`), at least 1."""
    return default_threads(cores // ranks)
