"""The probe's bounded-memory mode against the exact one: error of every result, peak tensor memory, time.

    python bench/probe_memory.py [--sizes tiny h256] [--chunks 2 4 8] [--groups 8 --group-size 4 --length 128]

For each model size (the tiny default shape, or a random Qwen2 of `bench/sizes.py`'s shape) it probes one batch
with every result the probe reports switched on (task / entropy / KL, three reward components, per-group norms and
bootstrap intervals, sketches; 6 buckets + all), once whole (`analysis.memory_chunks=1`) and once per chunk count,
and prints per run:

  error     the largest relative difference from the whole probe over every metric, per-group norm, reward-component
            matrix entry and sketch entry (|x - x_1| / |x_1|; entries with |x_1| < 1e-12 compare absolutely)
  peak MiB  the largest number of bytes of tensor storage the probe allocated and held at once (`HeldBytes`: every
            new storage an operator returns, until it is freed; the model's own weights are not counted)
  seconds   wall time of one untracked run (single runs: read them as a rough ratio, not a timing)
"""

from __future__ import annotations

import argparse
import math
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from analysis_overhead import corpus, make_batch
from rldynamics.analysis.probe import ProbeResult, ProbeSettings, gradient_probe
from rldynamics.config import AlgoConfig
from rldynamics.models.tiny import build_tiny_model, build_tiny_tokenizer
from rldynamics.train.batch_ops import component_advantages
from sizes import SIZES

TINY = (64, 2)  # the default preset's embedded model: hidden 64, 2 layers


class HeldBytes(TorchDispatchMode):
    """Bytes of tensor storage allocated inside the block and still alive (`now`), and their maximum (`peak`).

    Every storage an operator returns that none of its inputs shares (so views and in-place results are not new) is
    counted until it is freed (a finalizer on the storage). Backward passes run their operators through the same
    dispatcher, so gradients and saved activations count too; tensors that existed before the block do not.
    """

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.peak = 0
        self._alive: set[int] = set()

    def _freed(self, key: int, size: int) -> None:
        self._alive.discard(key)
        self.now -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in self._alive or key in inputs:
                continue
            self._alive.add(key)
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out


def peak_bytes(fn) -> tuple[int, object]:
    """Run `fn()`; return the peak bytes of tensor storage it held at once (`HeldBytes`) and its result."""
    with HeldBytes() as held:
        out = fn()
    return held.peak, out


def flat_results(result: ProbeResult) -> dict[str, float]:
    """Every number a probe reports, by name: metrics, per-group norms, reward-component matrices, sketch entries."""
    out = dict(result.metrics)
    for gid, norms in result.group_norms.items():
        out.update({f"groups/{gid}/{k}": v for k, v in norms.items()})
    _numbers(result.reward_grad, "reward_grad", out)
    for key, sketch in result.sketches.items():
        out.update({f"sketch/{key}/{i}": float(x) for i, x in enumerate(sketch)})
    return out


def _numbers(value, key: str, out: dict[str, float]) -> None:
    """The numbers of a JSON-ready value (nested dicts and lists; None = NaN, names left out) into `out`."""
    if isinstance(value, dict):
        for k, v in value.items():
            _numbers(v, f"{key}/{k}", out)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _numbers(v, f"{key}/{i}", out)
    elif value is None or isinstance(value, (int, float)):
        out[key] = math.nan if value is None else float(value)


def worst_error(exact: dict[str, float], other: dict[str, float]) -> tuple[float, str]:
    """The largest relative difference over the common keys (NaN in both counts as equal) and its key."""
    assert exact.keys() == other.keys(), sorted(set(exact) ^ set(other))[:5]
    worst, where = 0.0, ""
    for key, x in exact.items():
        y = other[key]
        if math.isnan(x) and math.isnan(y):
            continue
        err = abs(y - x) / (abs(x) if abs(x) >= 1e-12 else 1.0)
        if not err <= worst:  # also a NaN on one side only
            worst, where = err, key
    return worst, where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "h256"], choices=sorted(SIZES))
    parser.add_argument("--chunks", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = build_tiny_tokenizer(corpus())
    algo = AlgoConfig(entropy_coef=0.001, kl_coef=0.001, kl_type="low_var_kl", loss_agg_mode="token-mean")
    print("| model | params | memory_chunks | seconds | peak MiB | peak / whole | worst relative error | where |")
    print("|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        hidden, layers = SIZES[size] if SIZES[size][0] is not None else TINY
        model = build_tiny_model(tokenizer, hidden_size=hidden, num_layers=layers, num_heads=max(4, hidden // 64),
                                 num_kv_heads=max(2, hidden // 128), intermediate_size=4 * hidden, seed=0)
        batch, inputs, group_std = make_batch(model, groups=args.groups, group_size=args.group_size,
                                              length=args.length, seed=0)
        comps = component_advantages(batch, AlgoConfig(adv_estimator="grpo"))  # name -> [N, L]
        weights = dict(zip(batch.reward_names, batch.reward_weights, strict=True))
        kw = dict(algo=algo, micro_batch_size=args.micro_batch, temperature=1.0, num_buckets=6, per_group=True,
                  resamples=200)
        params = sum(p.numel() for p in model.parameters())
        whole = None
        for chunks in (1, *args.chunks):
            def run(c=chunks):
                return gradient_probe(model, batch, inputs, group_std, ProbeSettings(memory_chunks=c, **kw), comps,
                                      weights)

            start = time.perf_counter()
            result = run()
            seconds = time.perf_counter() - start
            peak, _ = peak_bytes(run)
            flat = flat_results(result)
            if whole is None:
                whole = (flat, peak)
            error, where = worst_error(whole[0], flat)
            print(f"| {size} | {params:,} | {chunks} | {seconds:.1f} | {peak / 2**20:.1f} | {peak / whole[1]:.2f} | "
                  f"{error:.1e} | {where or '-'} |", flush=True)


if __name__ == "__main__":
    main()
