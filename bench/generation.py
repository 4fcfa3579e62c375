"""HF-engine generation alone (`rollout.agent.generate_with_logprobs`), this checkout against another, alternating.

    python bench/generation.py [--model tiny|smollm2] [--groups 8] [--group-size 8] [--prompt 180] [--new 24]
                               [--repeats 8] [--rounds 3] [--baseline-src DIR]

Each process loads the model (float32, one torch thread, freed memory kept as the trainer keeps it), builds
`--groups` random prompts of `--prompt` token ids (seeded), each shared by `--group-size` rows, and generates
`--new` tokens for every row `--repeats` times with keyed sampling (`train.row_seeded_sampling`: the tokens
depend only on the weights, the prompts and the keys). It prints the median seconds of a generation and a digest of
the last replies. With `--baseline-src` (another checkout's `src/`) the two sides alternate for `--rounds` rounds
in fresh processes, and the closing line gives baseline / ours of the medians and whether the tokens are the same.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

OURS = Path(__file__).resolve().parents[1] / "src"


def worker(args: argparse.Namespace) -> None:
    import torch

    from rldynamics.config import make_config
    from rldynamics.memory import keep_freed_memory
    from rldynamics.models.loading import load_model_and_tokenizer, resolve_model_path
    from rldynamics.rollout.agent import generate_with_logprobs
    from rldynamics.train.warmstart import tiny_corpus

    torch.set_num_threads(1)
    keep_freed_memory()
    cfg = make_config()
    model, tokenizer = load_model_and_tokenizer(resolve_model_path(args.model, lambda: tiny_corpus(cfg.env)))
    rng = random.Random(0)
    prompts = [p for _ in range(args.groups)
               for p in [[rng.randrange(10, len(tokenizer) - 10) for _ in range(args.prompt)]] * args.group_size]
    rows = len(prompts)
    times, replies = [], []
    for r in range(args.repeats):
        start = time.perf_counter()
        replies, _ = generate_with_logprobs(model, tokenizer, prompts, args.new, 1.0, [tokenizer.eos_token_id],
                                            row_keys=list(range(rows * r, rows * (r + 1))))
        times.append(time.perf_counter() - start)
    print(f"RESULT {statistics.median(times):.4f} {hashlib.md5(str(replies).encode()).hexdigest()[:12]}")


def run_side(src: Path, args: argparse.Namespace) -> tuple[float, str]:
    """(median seconds, digest) of one worker process running the code under `src`."""
    cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--groups", str(args.groups),
           "--group-size", str(args.group_size), "--prompt", str(args.prompt), "--new", str(args.new),
           "--repeats", str(args.repeats)]
    out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(src)}, check=True, capture_output=True, text=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    seconds, digest = line.split()[1:]
    return float(seconds), digest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny (the default preset's model) or smollm2")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=180, help="prompt length in tokens")
    parser.add_argument("--new", type=int, default=24, help="new tokens per row")
    parser.add_argument("--repeats", type=int, default=8, help="generations per process")
    parser.add_argument("--rounds", type=int, default=3, help="processes per side")
    parser.add_argument("--baseline-src", type=Path, help="another checkout's src/, run alternately with this one")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    sides = [("ours", OURS)] + ([("baseline", args.baseline_src)] if args.baseline_src else [])
    results: dict[str, list[tuple[float, str]]] = {name: [] for name, _ in sides}
    for r in range(args.rounds):
        for name, src in sides[::-1] if r % 2 else sides:
            results[name].append(run_side(src, args))
            seconds, digest = results[name][-1]
            print(f"round {r + 1} {name:8s} {seconds:.3f} s a generation  replies {digest}", flush=True)
    medians = {name: statistics.median(s for s, _ in runs) for name, runs in results.items()}
    for name, m in medians.items():
        print(f"{name}: median {m:.3f} s a generation ({args.groups} x {args.group_size} rows, {args.new} new tokens)")
    if args.baseline_src:
        same = len({d for runs in results.values() for _, d in runs}) == 1
        print(f"baseline / ours {medians['baseline'] / medians['ours']:.2f}; the same tokens: {same}")


if __name__ == "__main__":
    main()
