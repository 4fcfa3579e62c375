"""One decode step's linear layers of SmolLM2-135M, float32, one thread: `F.linear` (MKL's GEMM) against oneDNN's
inner product on weights packed once (`models.packed`, what the HF engine's rollout runs), side by side.

    python bench/packed_linears.py [--rows 1,4,16,64,368] [--repeats 5]

The weights have SmolLM2's shapes (30 blocks of q, k, v, o, gate, up, down and the 49152 x 576 LM head; random
values: the time does not depend on them) and are all distinct, so a step reads them from memory as generation does,
not from the cache. For each number of rows (a decode step's active trajectories; 368 is a prefill of two 184-token
prompts) it prints the milliseconds of one pass over every weight each way (the best of `--repeats`, alternating),
their ratio, and the largest relative difference of the outputs; then the seconds packing every weight takes, which a
rollout pays once.
"""

from __future__ import annotations

import argparse
import time

import torch

from rldynamics.models.packed import MIN_ELEMENTS, available

HIDDEN, INTER, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30  # SmolLM2-135M


def weights() -> list[torch.Tensor]:
    """[out, in] per linear: 30 blocks and the LM head."""
    block = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTER, HIDDEN), (INTER, HIDDEN),
             (HIDDEN, INTER)]
    shapes = block * LAYERS + [(VOCAB, HIDDEN)]
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(o, i, generator=gen) * 0.02 for o, i in shapes]


def one_pass(ws, packed, xs) -> tuple[float, list[torch.Tensor]]:
    """Seconds of one product per weight (packed where `packed` has it), and the outputs."""
    outs = []
    start = time.perf_counter()
    for w, p in zip(ws, packed, strict=True):
        x = xs[w.shape[1]]
        outs.append(torch.nn.functional.linear(x, w) if p is None
                    else torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
    return time.perf_counter() - start, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16,64,368")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not available():
        raise SystemExit("this PyTorch build has no oneDNN packed linear (torch.ops.mkldnn._reorder_linear_weight)")
    torch.set_num_threads(1)
    ws = weights()
    none = [None] * len(ws)
    print(f"{len(ws)} weights, {sum(w.numel() for w in ws) * 4 / 1e6:.0f} MB in float32; packed: those of at least "
          f"{MIN_ELEMENTS} entries, as the rollout packs them")
    print("| rows | F.linear ms | packed ms | F.linear / packed | max rel diff | packing s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        start = time.perf_counter()
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) if w.numel() >= MIN_ELEMENTS else None for w in ws]
        pack_s = time.perf_counter() - start
        xs = {n: torch.randn(rows, 1, n) for n in (HIDDEN, INTER)}
        plain_s, packed_s = [], []
        for _ in range(args.repeats):
            t, want = one_pass(ws, none, xs)
            plain_s.append(t)
            t, got = one_pass(ws, packed, xs)
            packed_s.append(t)
        diff = max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want, strict=True))
        print(f"| {rows} | {min(plain_s) * 1e3:.1f} | {min(packed_s) * 1e3:.1f} | {min(plain_s) / min(packed_s):.2f} | "
              f"{diff:.1e} | {pack_s:.2f} |", flush=True)


if __name__ == "__main__":
    main()
