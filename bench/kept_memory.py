"""What keeping freed memory saves (`rldynamics.memory`): the same tensor churn with glibc's defaults and with freed
memory kept, each in a fresh process, alternating.

    python bench/kept_memory.py [--rounds 3] [--rows 49152] [--cols 576]

The churn is what a training step does to its largest tensors: allocate (zeros) a `rows x cols` float32 tensor,
add to it, free both, `--repeats` times (default SmolLM2-135M's embedding gradient, 113 MB). With glibc's defaults
each such block is a fresh `mmap` whose pages fault in on first touch; kept, the heap reuses them. Prints seconds
per repeat (best of the repeats) for each, and defaults / kept.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def churn(rows: int, cols: int, repeats: int) -> float:
    """Best seconds of one allocate + add + free of a [rows, cols] float32 tensor."""
    import torch

    torch.set_num_threads(1)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        grad = torch.zeros(rows, cols)
        total = grad + 1.0
        del grad, total
        best = min(best, time.perf_counter() - start)
    return best


def worker(keep: bool, args) -> float:
    env = dict(os.environ, RLDYN_KEEP_MEMORY="1" if keep else "0", OMP_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--worker", "--rows", str(args.rows), "--cols", str(args.cols),
           "--repeats", str(args.repeats)]
    return json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout)["s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=49152)
    parser.add_argument("--cols", type=int, default=576)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        from rldynamics.memory import keep_freed_memory

        keep_freed_memory()  # reads RLDYN_KEEP_MEMORY
        print(json.dumps({"s": churn(args.rows, args.cols, args.repeats)}))
        return
    got = {False: [], True: []}
    for r in range(args.rounds):
        for keep in ((False, True) if r % 2 == 0 else (True, False)):
            got[keep].append(worker(keep, args))
    defaults, kept = min(got[False]), min(got[True])
    print(f"{args.rows} x {args.cols} float32 ({args.rows * args.cols * 4 / 1e6:.0f} MB), allocate + add + free: "
          f"malloc defaults {defaults * 1e3:.1f} ms, kept {kept * 1e3:.1f} ms, defaults / kept {defaults / kept:.1f}")


if __name__ == "__main__":
    main()
