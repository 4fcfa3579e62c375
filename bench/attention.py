"""Forward + backward of one attention call at a training step's shapes, by kernel and dtype, on one thread.

    python bench/attention.py [--rows 8] [--lengths 60,150,600] [--repeats 20]
    python bench/attention.py --gradient-error       # SmolLM2's gradient in bfloat16, against float32
    python bench/attention.py --gqa [--dtype float32]  # grouped key/value heads under a mask: repeated or not

SmolLM2-135M's attention (9 query heads of 64; the 3 key/value heads are repeated to 9 before the call, as
transformers does for SDPA), causal; above 150 positions the rows shrink so that a call holds about as many
tokens. Kernels: `flash` (PyTorch's fused SDPA kernel with `is_causal`, what transformers' `sdpa` attention runs),
`math` (SDPA's reference kernel with a boolean mask) and `eager` (two matmuls and a float32 softmax). Each is
timed in bfloat16 and in float32, and `flash_f32` is the fused kernel on bfloat16 inputs cast to float32 and its
output cast back (`models.precision.attend_in_float32`, what a bfloat16 model attends with on a CPU).
Milliseconds per call, the median of `--repeats` after 3 warm-up calls.

`--gradient-error`: the gradient of a log-prob objective (seeded advantages on the last 48 tokens of 8 rows of 150
seeded tokens) through SmolLM2-135M-Instruct computed in float32, then under bfloat16 autocast with bfloat16
attention and with float32 attention (`models.precision.compute_in`); printed: each one's relative error against
float32 and its norm.

`--gqa`: SmolLM2's 3 key/value heads under a mask (what every forward of a run has: left-padded generation,
padded or packed rows), repeated to 9 before the call (`repeat_kv`, what transformers' SDPA attention does whenever
a mask is given) against passed as they are (`enable_gqa=True`, `models.attention.GQA_SDPA`): a training
micro-batch's forward + backward (`--rows` x 200 positions, causal) and a decode step's forward (16 rows, one query
over 196 keys, two of them masked), with the largest difference of their outputs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa


def flash(q, k, v, mask):
    return sdpa(q, k, v, is_causal=True)


def flash_f32(q, k, v, mask):
    return sdpa(q.float(), k.float(), v.float(), is_causal=True).to(q.dtype)


def math(q, k, v, mask):
    with sdpa_kernel(SDPBackend.MATH):
        return sdpa(q, k, v, attn_mask=mask)


def eager(q, k, v, mask):
    w = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # [B, H, L, L]
    w = torch.softmax(w.float().masked_fill(~mask, float("-inf")), -1).to(q.dtype)
    return w @ v  # [B, H, L, D]


def milliseconds(fn, q, k, v, mask, repeats: int) -> float:
    times = []
    for i in range(3 + repeats):
        start = time.perf_counter()
        fn(q, k, v, mask).float().sum().backward()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def grouped(dtype: torch.dtype, rows: int, repeats: int) -> None:
    """Milliseconds per call of masked attention with SmolLM2's grouped heads, repeated against unrepeated."""

    def repeated(q, k, v, mask):
        k, v = (x[:, :, None].expand(x.shape[0], 3, 3, *x.shape[2:]).reshape(x.shape[0], 9, *x.shape[2:])
                for x in (k, v))
        return sdpa(q, k, v, attn_mask=mask)

    def unrepeated(q, k, v, mask):
        return sdpa(q, k, v, attn_mask=mask, enable_gqa=True)

    print("| call | repeat_kv ms | enable_gqa ms | repeat / gqa | largest output difference |")
    print("|---|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for name, (n, queries, keys) in {"training forward + backward": (rows, 200, 200),
                                     "decode step forward": (16, 1, 196)}.items():
        q = torch.randn(n, 9, queries, 64, generator=g).to(dtype).requires_grad_(queries > 1)
        k, v = (torch.randn(n, 3, keys, 64, generator=g).to(dtype).requires_grad_(queries > 1) for _ in range(2))
        mask = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries).expand(n, 1, queries, keys).clone()
        mask[:, :, :, :2] = False  # left padding
        mask[:, :, :2, :2] = True  # a padded query attends to padding, as transformers' masks keep softmax finite
        times = []
        for fn in (repeated, unrepeated):
            if queries > 1:
                times.append(milliseconds(fn, q, k, v, mask, repeats))
                continue
            with torch.no_grad():
                for _ in range(3):
                    fn(q, k, v, mask)
                start = time.perf_counter()
                for _ in range(repeats):
                    fn(q, k, v, mask)
                times.append(1000 * (time.perf_counter() - start) / repeats)
        with torch.no_grad():
            diff = (repeated(q, k, v, mask).float() - unrepeated(q, k, v, mask).float()).abs().max().item()
        print(f"| {name} ({n} x {queries} x {keys}) | {times[0]:.2f} | {times[1]:.2f} | {times[0] / times[1]:.2f} | "
              f"{diff:.1e} |")


def gradient_error() -> None:
    import copy
    import tempfile
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from rldynamics.models.forward import token_logprobs
    from rldynamics.models.precision import compute_in
    from sizes import model_dir

    with tempfile.TemporaryDirectory() as tmp:
        base = AutoModelForCausalLM.from_pretrained(model_dir("smollm2", Path(tmp)), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, base.config.vocab_size, (8, 150), generator=g)  # [8, 150]
    attn = torch.ones_like(ids)
    wanted = torch.zeros_like(ids, dtype=torch.bool)
    wanted[:, -48:] = True  # [8, 150] the "reply"
    adv = torch.randn(ids.shape, generator=g)  # [8, 150]

    def grad(model) -> torch.Tensor:
        lp, _ = token_logprobs(model, ids, attn, positions=wanted)
        (lp * adv * wanted).sum().backward()
        return torch.cat([p.grad.flatten().double() for p in model.parameters()])

    exact = grad(base)
    plain = copy.deepcopy(base)
    plain.zero_grad(set_to_none=True)
    plain.forward = torch.autocast("cpu", dtype=torch.bfloat16)(plain.forward)  # bfloat16 attention too
    ours = compute_in(copy.deepcopy(base), "bfloat16")
    ours.zero_grad(set_to_none=True)
    print(f"float32: gradient norm {exact.norm():.3f}")
    for name, model in (("bfloat16, bfloat16 attention", plain), ("bfloat16, float32 attention", ours)):
        got = grad(model)
        print(f"{name}: relative error {float((got - exact).norm() / exact.norm()):.4f}, norm {got.norm():.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--lengths", default="60,150,600")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--gradient-error", action="store_true")
    parser.add_argument("--gqa", action="store_true")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="with --gqa")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.gradient_error:
        return gradient_error()
    if args.gqa:
        return grouped(getattr(torch, args.dtype), args.rows, args.repeats)
    kernels = (flash, flash_f32, math, eager)
    print("| dtype | rows x positions | " + " | ".join(k.__name__ for k in kernels) + " |")
    print("|---|---|" + "---:|" * len(kernels))
    for dtype in (torch.bfloat16, torch.float32):
        for length in map(int, args.lengths.split(",")):
            rows = max(1, args.rows * 150 // length) if length > 150 else args.rows
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(rows, 9, length, 64, generator=g).to(dtype).requires_grad_() for _ in range(3))
            mask = torch.ones(length, length, dtype=torch.bool).tril()  # [L, L]
            cells = [f"{milliseconds(fn, q, k, v, mask, args.repeats):.1f}"
                     if dtype == torch.bfloat16 or fn is not flash_f32 else "–" for fn in kernels]
            print(f"| {str(dtype).removeprefix('torch.')} | {rows} x {length} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
