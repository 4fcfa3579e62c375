"""One AdamW step over SmolLM2-135M's parameter shapes, by implementation, on one thread.

    python bench/optimizer_step.py [--steps 5]

The trainer's AdamW (`train.setup.adamw`: `train.optim=adamw_torch_fused`, or `adamw_torch`, the per-parameter loop)
and torch's `foreach` form, on float32 parameters shaped like SmolLM2-135M-Instruct's (30 blocks of 4 attention
and 3 MLP matrices and 2 norms, the tied 49152 x 576 embedding, the final norm: 134.5M values) with seeded
gradients. Printed: the median seconds per step after the first, and the largest absolute and relative
difference of the weights after `--steps` steps from the loop's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rldynamics.train.setup import adamw

HIDDEN, MLP, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152
BLOCK = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (MLP, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP),
         (HIDDEN,), (HIDDEN,)]
SHAPES = [(VOCAB, HIDDEN), *BLOCK * LAYERS, (HIDDEN,)]


def run(kind: str, steps: int) -> tuple[list[torch.Tensor], list[float]]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in SHAPES]
    if kind == "foreach":
        opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, foreach=True)
    else:
        opt = adamw(params, 1e-5, 0.01, kind)
    grads, times = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=grads) * 1e-3
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return [p.detach() for p in params], times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loop, loop_times = run("adamw_torch", args.steps)
    print(f"{sum(p.numel() for p in loop) / 1e6:.1f}M parameters, {args.steps} steps, 1 thread")
    print("| AdamW | s/step | loop / it | max abs diff from the loop | max rel diff |\n|---|---:|---:|---:|---:|")
    base = statistics.median(loop_times)
    print(f"| adamw_torch (loop) | {base:.3f} | 1.00 | 0 | 0 |")
    for kind in ("adamw_torch_fused", "foreach"):
        params, times = run(kind, args.steps)
        diff = max(float((p - q).abs().max()) for p, q in zip(params, loop, strict=True))
        rel = max(float(((p - q).abs() / q.abs().clamp_min(1e-6)).max()) for p, q in zip(params, loop, strict=True))
        print(f"| {kind} | {statistics.median(times):.3f} | {base / statistics.median(times):.2f} | {diff:.2e} "
              f"| {rel:.2e} |")


if __name__ == "__main__":
    main()
