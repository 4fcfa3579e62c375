"""Freed memory kept in the process for reuse, so the step's large tensors stop costing page faults (Linux, glibc).

glibc's malloc serves every block over its mmap threshold (at most 32 MiB) with a fresh `mmap` and unmaps it when
freed, and trims the heap's top when freed space passes 128 KiB. A training step allocates and frees the same large
tensors (activations, logits, gradients; SmolLM2's embedding gradient alone is 113 MB) every micro-batch, so each
one is faulted in page by page again: on a KVM guest, `torch.zeros(49152, 576)` plus one add took 103 ms this way
and 13 ms once the memory was kept (docs/benchmarks.md, "Kept memory"), and the SmolLM2 update went from 12-13.5 s to
10.8 s. `keep_freed_memory` turns mmap off for malloc (large blocks come from the heap) and raises the trim
threshold to 1 GiB, which is what vLLM's CPU docs get by preloading tcmalloc. The cost: the process keeps its peak
heap instead of returning it between steps.

Set `RLDYN_KEEP_MEMORY=0` to leave malloc as it is.

`available_memory` is what the machine can still give (Linux's MemAvailable), which `--nproc auto` weighs before it
starts a vLLM engine per rank.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters (malloc.h)
TRIM_THRESHOLD = 1 << 30  # bytes of free heap top kept before malloc gives memory back


def keep_freed_memory(environ: dict[str, str] | None = None) -> str:
    """Ask glibc's malloc to keep freed memory (see the module docstring); returns what was done, in words, for
    the run's environment record: `kept`, or why not."""
    environ = os.environ if environ is None else environ
    if environ.get("RLDYN_KEEP_MEMORY", "1") == "0":
        return "malloc's defaults (RLDYN_KEEP_MEMORY=0)"
    if not sys.platform.startswith("linux"):
        return f"malloc's defaults ({sys.platform})"
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "malloc's defaults (no glibc)"
    if mallopt(M_MMAP_MAX, 0) != 1 or mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return "malloc's defaults (mallopt refused)"
    return "kept"


def available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes the machine can give to new work without swapping (Linux's `MemAvailable`); None where unknown."""
    try:
        lines = Path(meminfo).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # kB
    return None
