"""The log-prob and entropy of the kept positions, forward + backward: the eager composition against
`algo.logprobs.selected_logprobs` by chunk size, on one thread.

    python bench/logprobs.py [--rows 615] [--vocab 49152] [--repeats 6]

Logits [rows, vocab] (SmolLM2's vocabulary; 615 kept positions is one micro-batch of a `math-smollm2` update) in
bfloat16 and float32, seeded, with entropy; the loss weights the log-probs by 1 and the entropies by 0.01. The
eager composition is what the trainer ran before: cast to float32, log-softmax, gather, entropy from the
log-softmax, every temporary kept by autograd. Printed per dtype: the median milliseconds of forward + backward
after the first, and the largest difference of the log-probs, entropies and gradients from the composition's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rldynamics.algo.logprobs import selected_logprobs
from rldynamics.algo.losses import entropy_from_logprobs

CHUNKS = (2**16, 2**18, 2**20, 2**25)  # float32 entries per chunk; 2**25 is the size used off the CPU


def composition(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    every = torch.log_softmax(logits.float(), dim=-1)  # [M, V]
    return every.gather(-1, targets[:, None]).squeeze(-1), entropy_from_logprobs(every)  # [M], [M]


def timed(fn, logits: torch.Tensor, repeats: int) -> tuple[float, tuple[torch.Tensor, ...]]:
    """Median seconds of forward + backward after the first; the last (log-probs, entropies, gradient)."""
    seconds = []
    for _ in range(repeats + 1):
        z = logits.detach().clone().requires_grad_()
        start = time.perf_counter()
        logp, ent = fn(z)
        (logp.sum() + 0.01 * ent.sum()).backward()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:]), (logp.detach(), ent.detach(), z.grad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=615)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(args.rows, args.vocab, generator=gen) * 3  # [M, V]
    targets = torch.randint(0, args.vocab, (args.rows,), generator=gen)  # [M]
    print(f"{args.rows} x {args.vocab} logits, forward + backward, median of {args.repeats}, one thread")
    print("| dtype | form | ms | composition / form | max log-prob diff | max entropy diff | max gradient diff |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for dtype in (torch.bfloat16, torch.float32):
        logits = base.to(dtype)
        eager_s, want = timed(lambda z: composition(z, targets), logits, args.repeats)
        print(f"| {str(dtype).removeprefix('torch.')} | composition | {eager_s * 1e3:.0f} | 1.00 | – | – | – |")
        for elements in CHUNKS:
            seconds, got = timed(lambda z, e=elements: selected_logprobs(z, targets, 1.0, True, e), logits,
                                 args.repeats)
            diffs = [f"{(g.float() - w.float()).abs().max().item():.1e}" for g, w in zip(got, want, strict=True)]
            print(f"| {str(dtype).removeprefix('torch.')} | chunks of {elements} | {seconds * 1e3:.0f} | "
                  f"{eager_s / seconds:.2f} | {' | '.join(diffs)} |")


if __name__ == "__main__":
    main()
