"""Memory per rank of a training step with the gradient analysis: a model, checked against measured peak RSS.

    python bench/memory_model.py table                       # the docs/multi-device.md table: 0.5B / 3B / 7B on 1 and 8 x 80 GB
    python bench/memory_model.py predict --params 3b --world 8 [--dtype bfloat16] [--checkpointing] [--chunks 8] [...]
    python bench/memory_model.py check [--world 1 2] [--dtype float32 bfloat16] [--checkpointing 0 1] [--chunks 1 4]
                                                             # predicted vs measured peak RSS on CPU (tiny, 50M)

`budget` gives, for an architecture (parameter count from its shape), a compute dtype (`model.dtype`), activation
checkpointing (`model.gradient_checkpointing`), the number of ranks W, sharding (FSDP2 or replicas) and the analysis
settings (`analysis.memory_chunks` C), the bytes per rank of each part of a step. Weights, gradients and AdamW state
are float32 whatever the compute dtype (mixed precision, `models/precision.py`):

  weights     actor + reference (+ critic) float32 parameters, 1/W each when sharded
  optimizer   AdamW's two float32 moments (+ critic's), 1/W when sharded
  grads       the accumulated float32 gradient during the update (1/W when sharded, plus the largest FSDP2 unit's
              unsharded parameters and gradient)
  gathered    the full weights a rank holds during generation and the no-grad passes (sharded runs only), plus
              the largest unit's all-gather buffer
  kv_cache    generation: 2 x layers x kv width x (rows x tokens) per rank, in the compute dtype
  activations one micro-batch's forward saved for backward: per token and layer 4h float32 values (the two norms'
              input and output: the residual stream stays float32 under autocast) and 4h + 2kv + 4i in the compute
              dtype (the inputs of the attention and MLP projections, q, the attention output, k, v, the SwiGLU's
              four i-wide tensors), in bfloat16 3h more (autocast casts the input of q, k, v, gate and up each on
              its own); with checkpointing instead one float32 block input (h) per layer plus one block's values
              while it is recomputed. Plus the LM head's logits at the response positions and their gradient
              (compute dtype) with one float32 chunk of them, and in bfloat16 autocast's copy of every weight
              (2 B x P: cached through a forward and saved for backward by each linear layer); counted with
              saved-tensor hooks and the live tensors at the probe's peak on the 50M model
  analysis    the probe: float32 vectors of K terms for `all` and for the current bucket (2 K x 4 B per coordinate
              held), the count-sketch tables of those coordinates (5 B each), and per micro-batch the gradient it
              differentiates (one process or replicas: one float32 vector per term, replicas whole ones and also K
              whole accumulators, and four more float32 arrays of the LM head's chunk, kept from the one forward for
              the other terms while the first is differentiated; sharded: the .grad shard and the largest unit's
              unsharded parameters and gradient); per_group adds m K x 4 B per coordinate held. Coordinates held: P /
              W over W ranks; with C chunks (one process) the largest chunk, max(P / C, the embedding)

The peak is the largest phase: rollout (weights + optimizer + gathered + kv cache, and in bfloat16 the weights' copy
of one forward), update (weights + optimizer + grads + activations) or analysis (weights + optimizer + analysis +
activations), plus a fixed 22 MB of runtime overhead per process (measured with the tiny model, whose own buffers
are a few MB) and 21 MB more computing in bfloat16 (the CPU's bfloat16 kernels, measured alike). `check` runs those
phases of the trainer (`gathered` generation, the old / reference log-prob passes, `update_actor`, `gradient_probe`)
on a random Qwen2 set up as the trainer sets up its models (`compute_in`, `enable_checkpointing`, then FSDP2) in
fresh processes (torchrun for W > 1), reads each rank's peak RSS (VmHWM, reset first) above the RSS before the model
was built, and prints it beside `budget`'s peak for the same run (target: within 20 %).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

BYTES = {"float32": 4, "bfloat16": 2}  # compute dtypes (model.dtype)
STATE = 4  # bytes per parameter of the weights, the gradients and each AdamW moment: float32 in every compute dtype
GB = 1e9
CHUNK_ELEMENTS = 2**25  # algo.logprobs.OTHER_CHUNK_ELEMENTS: float32 entries per log-softmax chunk on a GPU
# glibc keeps freed blocks below its (adaptive) mmap threshold in the heap, so RSS would count memory that is free;
# a fixed 64 KiB threshold returns every large block on free and RSS follows live memory
MEASURE_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
RUNTIME = 22e6  # per process: kernel workspaces, allocator and thread overheads (measured: the tiny model)
RUNTIME_BFLOAT16 = 21e6  # more per process computing in bfloat16: the CPU's bfloat16 kernels (oneDNN; the tiny model)


@dataclass
class Arch:
    """The shape of a Qwen2-style decoder (what the memory depends on)."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool

    @property
    def kv(self) -> int:
        """Width of the keys (= of the values): kv heads x head dim."""
        return self.kv_heads * self.hidden // self.heads

    @property
    def block(self) -> int:
        """Parameters of one decoder block (attention with q/k/v biases, SwiGLU MLP, two norms)."""
        h, kv, i = self.hidden, self.kv, self.intermediate
        return h * h + h + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h

    @property
    def params(self) -> int:
        """All parameters (a tied LM head counts once)."""
        return self.layers * self.block + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


ARCHS = {  # published Qwen2.5 shapes; tiny = the embedded model; 50m = the CPU check's random Qwen2
    "tiny": Arch(hidden=64, layers=2, intermediate=256, heads=4, kv_heads=2, vocab=320, tied=True),
    "50m": Arch(hidden=512, layers=8, intermediate=2048, heads=8, kv_heads=2, vocab=32000, tied=True),
    "0.5b": Arch(hidden=896, layers=24, intermediate=4864, heads=14, kv_heads=2, vocab=151936, tied=True),
    "3b": Arch(hidden=2048, layers=36, intermediate=11008, heads=16, kv_heads=2, vocab=151936, tied=True),
    "7b": Arch(hidden=3584, layers=28, intermediate=18944, heads=28, kv_heads=4, vocab=152064, tied=False),
}


@dataclass
class Setup:
    """One training configuration, as it matters for memory."""

    arch: Arch
    dtype: str = "bfloat16"  # compute dtype (model.dtype)
    checkpointing: bool = False  # model.gradient_checkpointing
    world: int = 1
    shard: bool = True  # FSDP2 (model.shard=true) when world > 1
    critic: bool = False  # GAE: a value model of the same backbone, with its own AdamW
    reference: bool = True  # the KL reference (loaded whenever the analysis runs)
    micro_rows: int = 4  # train.micro_batch_size
    tokens: int = 2048  # tokens per row (prompt + turns)
    response: float = 0.25  # fraction of a row's tokens that are sampled (the LM head runs there)
    gen_rows: int = 64  # rows generated at once per rank (env groups x group size / W)
    terms: int = 3  # analysed gradients: task, entropy, kl (+ reward components)
    sketch: bool = True
    per_group: int = 0  # groups of the largest bucket with analysis.per_group (0: off)
    chunks: int = 1  # analysis.memory_chunks (one process only)


def budget(s: Setup) -> dict[str, float]:
    """Bytes per rank of each part of a step and of each phase (module docstring); `peak` is the largest phase."""
    a, w, c = s.arch, STATE, BYTES[s.dtype]
    p = a.params
    critic = p - (0 if a.tied else a.vocab * a.hidden) + a.hidden + 1 if s.critic else 0  # backbone + value head
    sharded = s.world > 1 and s.shard
    part = 1 / s.world if sharded else 1.0  # the share of a parameter vector a rank holds
    unit = max(a.block, a.vocab * a.hidden * (1 if a.tied else 2)) * w  # the largest FSDP2 unit, gathered whole
    tokens = s.micro_rows * s.tokens
    logits = s.micro_rows * s.tokens * s.response * a.vocab
    copy = p * c if c < w else 0.0  # autocast's compute-dtype copies of the weights during a forward
    casts = 3 * a.hidden if c < w else 0  # autocast casts the input of q, k, v, gate and up each on its own
    block = 4 * a.hidden * w + (4 * a.hidden + 2 * a.kv + 4 * a.intermediate + casts) * c  # a token's saved values
    saved = tokens * (a.layers * a.hidden * w + block) if s.checkpointing else tokens * a.layers * block
    head = logits * 2 * c + min(logits, CHUNK_ELEMENTS) * 4  # the logits, their gradient, one float32 chunk
    out = {
        "weights": (p * (1 + s.reference) + critic) * w * part,
        "optimizer": 2 * (p + critic) * w * part,
        "grads": p * w * part + (2 * unit if sharded else 0),
        "gathered": p * w + unit if sharded else 0.0,
        "kv_cache": 2 * a.layers * a.kv * s.gen_rows * s.tokens * c,
        "activations": saved + copy + head,
    }
    held = p / s.world if s.chunks == 1 else max(p / s.chunks, a.vocab * a.hidden)  # coordinates the probe holds
    probe = 2 * s.terms * held * 4 + (5 * held if s.sketch else 0) + s.per_group * s.terms * held * 4
    if sharded:
        probe += p / s.world * w + 2 * unit
    else:  # autograd.grad's output of one term over the coordinates held; replicas accumulate whole vectors; the
        # first term's backward runs while the forward's float32 chunk is kept for the others (four more arrays)
        probe += (p if s.world > 1 else held) * 4 + (s.terms * p * 4 if s.world > 1 else 0)
        probe += min(logits, CHUNK_ELEMENTS) * 4 * 4
    out["analysis"] = probe
    base = out["weights"] + out["optimizer"]
    out["rollout"] = base + out["gathered"] + out["kv_cache"] + copy
    out["update"] = base + out["grads"] + out["activations"]
    out["analysis phase"] = base + out["analysis"] + out["activations"]
    runtime = RUNTIME + (RUNTIME_BFLOAT16 if c < w else 0)
    out["peak"] = max(out["rollout"], out["update"], out["analysis phase"]) + runtime
    return out


# ---------------------------------------------------------------------------------------------- the docs/multi-device.md table


def table() -> str:
    """0.5B / 3B / 7B computing in bfloat16 (float32 weights, gradients and AdamW state), KL reference, no critic,
    analysis of 3 terms: on one device whole, in 8 chunks (and checkpointed), on 8 devices (and checkpointed), of
    80 GB; 128 rows of 2048 tokens generated per step (16 groups x 8), micro-batches of one row."""
    rows = ["| model | ranks | probe | checkpointing | weights | optimizer | grads | gathered | activations | analysis "
            "| peak | fits 80 GB |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in ("0.5b", "3b", "7b"):
        for world, chunks, ckpt in ((1, 1, False), (1, 8, False), (1, 8, True), (8, 1, False), (8, 1, True)):
            s = Setup(ARCHS[name], world=world, chunks=chunks, checkpointing=ckpt, gen_rows=128 // world, micro_rows=1)
            m = budget(s)
            cells = [f"{m[k] / GB:.1f}" for k in ("weights", "optimizer", "grads", "gathered", "activations",
                                                   "analysis", "peak")]
            rows.append(f"| {name.upper()} ({ARCHS[name].params / 1e9:.2f}B) | {world} | "
                        f"{'whole' if chunks == 1 else f'{chunks} chunks'} | {'on' if ckpt else 'off'} | "
                        f"{' | '.join(cells)} | {'yes' if m['peak'] <= 80 * GB else 'no'} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------- the CPU check


def _worker(spec: dict, out: str) -> None:
    """One rank: the memory-heavy phases of a step on a random Qwen2 set up as the trainer sets up its models (float32
    weights computing in `spec["dtype"]`, optionally checkpointed), its peak RSS above the start."""
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from analysis_overhead import _hwm_kib, _rss_kib
    from rldynamics import dist
    from rldynamics.analysis.objective import ActorInputs
    from rldynamics.analysis.probe import ProbeSettings, gradient_probe
    from rldynamics.config import AlgoConfig, TrainConfig
    from rldynamics.models.forward import batch_logprobs
    from rldynamics.models.precision import compute_in, enable_checkpointing
    from rldynamics.models.sharding import gathered, wrap
    from rldynamics.rollout.batch import RolloutBatch
    from rldynamics.train.actor import update_actor

    torch.set_num_threads(1)
    dist.init_from_env()
    a = ARCHS[spec["model"]]
    rows, tokens, micro_rows, gen_rows = spec["rows"], spec["tokens"], spec["micro_rows"], spec["gen_rows"]
    config = Qwen2Config(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
                         num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, intermediate_size=a.intermediate,
                         tie_word_embeddings=a.tied, max_position_embeddings=max(tokens, 256))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, a.vocab, (rows, tokens), generator=gen)  # [N, L]
    response = torch.zeros(rows, tokens)  # [N, L]
    response[:, tokens - tokens // 4:] = 1.0  # the last quarter was sampled
    batch = RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=response,
                         scores=torch.randn(rows, generator=gen), group_ids=torch.arange(rows) // 2)

    def prepared(model):  # as train.setup.prepare
        model = compute_in(model, spec["dtype"])
        return enable_checkpointing(model) if spec["checkpointing"] else model

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := RSS now
    start = _rss_kib()
    torch.manual_seed(0)
    model = wrap(prepared(Qwen2ForCausalLM(config).eval()), shard=True)
    ref = wrap(prepared(Qwen2ForCausalLM(config).eval().requires_grad_(False)), shard=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    with gathered(model), torch.no_grad():  # generation on gathered weights
        model.generate(input_ids=ids[:gen_rows, :8], attention_mask=torch.ones(gen_rows, 8, dtype=torch.long),
                       max_new_tokens=spec["gen_tokens"], min_new_tokens=spec["gen_tokens"], do_sample=False,
                       pad_token_id=0)
    with gathered(model):
        old, _ = batch_logprobs(model, ids, batch.attention_mask, micro_batch_size=micro_rows, positions=response)
    with gathered(ref):
        ref_lp, _ = batch_logprobs(ref, ids, batch.attention_mask, micro_batch_size=micro_rows, positions=response)
    inputs = ActorInputs(old_logprobs=old, advantages=torch.randn(rows, tokens, generator=gen) * response,
                         ref_logprobs=ref_lp)
    algo = AlgoConfig(entropy_coef=0.001, kl_coef=0.001, loss_agg_mode="token-mean")
    stds = {g: float(g % 3) for g in range(rows)}
    update_actor(model, optimizer, batch, inputs, algo,  # first: the optimizer state exists from the second step on
                 TrainConfig(mini_batch_size=rows, micro_batch_size=micro_rows, ppo_epochs=1))
    gradient_probe(model, batch, inputs, stds, ProbeSettings(algo=algo, micro_batch_size=micro_rows, temperature=1.0,
                                                             num_buckets=2, memory_chunks=spec["chunks"]))
    peak = (_hwm_kib() - start) * 1024
    with open(f"{out}/rank{dist.rank()}.json", "w") as f:
        json.dump({"peak": peak, "params": sum(p.numel() for p in model.parameters())}, f)
    dist.close()


# 8 rows in 4 groups: the probe's 2 buckets of 4 rows and the update's mini-batch of 8 give every rank of 2 full
# micro-batches of the 50M model, as a real step's buckets do (the model assumes micro_rows rows per forward)
RUNS = {"tiny": dict(micro_rows=4, tokens=256, rows=8, gen_rows=8, gen_tokens=32),
        "50m": dict(micro_rows=2, tokens=1024, rows=8, gen_rows=4, gen_tokens=32)}


def check(models: list[str], worlds: list[int], dtypes: list[str], checkpointing: list[bool],
          chunks: list[int]) -> None:
    """Predicted vs measured peak RSS per rank for the tiny model and the 50M model (CPU), for every combination of
    the settings given (chunks > 1 in one process only)."""
    print("| model | params | ranks | compute | checkpointing | memory_chunks | predicted peak MB | "
          "measured peak MB (max over ranks) | measured / predicted |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in models:
        for world, dtype, ckpt, c in itertools.product(worlds, dtypes, checkpointing, chunks):
            if world > 1 and c > 1:
                continue
            spec = dict(RUNS[name], model=name, dtype=dtype, checkpointing=ckpt, chunks=c)
            with tempfile.TemporaryDirectory() as out:
                launch = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                              "--standalone", f"--nproc-per-node={world}"]
                subprocess.run([*launch, __file__, "_worker", json.dumps(spec), out], check=True,
                               env={**os.environ, **MEASURE_ENV})
                measured = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world)]
            s = Setup(ARCHS[name], dtype=dtype, checkpointing=ckpt, chunks=c, world=world, critic=False,
                      **{k: RUNS[name][k] for k in ("micro_rows", "tokens", "gen_rows")})
            predicted = budget(s)["peak"]
            peak = max(m["peak"] for m in measured)
            print(f"| {name} | {measured[0]['params']:,} | {world} | {dtype} | {'on' if ckpt else 'off'} | {c} | "
                  f"{predicted / 1e6:.1f} | {peak / 1e6:.1f} | {peak / predicted:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("table")
    predict = sub.add_parser("predict")
    predict.add_argument("--params", choices=sorted(ARCHS), default="3b")
    predict.add_argument("--dtype", choices=sorted(BYTES), default="bfloat16", help="compute dtype (model.dtype)")
    predict.add_argument("--checkpointing", action="store_true", help="model.gradient_checkpointing=true")
    predict.add_argument("--world", type=int, default=8)
    predict.add_argument("--replicas", action="store_true", help="model.shard=false")
    predict.add_argument("--critic", action="store_true")
    predict.add_argument("--micro-rows", type=int, default=4)
    predict.add_argument("--tokens", type=int, default=2048)
    predict.add_argument("--gen-rows", type=int, default=16)
    predict.add_argument("--terms", type=int, default=3)
    predict.add_argument("--per-group", type=int, default=0)
    predict.add_argument("--chunks", type=int, default=1, help="analysis.memory_chunks (one process)")
    check_p = sub.add_parser("check")
    check_p.add_argument("--world", type=int, nargs="+", default=[1, 2])
    check_p.add_argument("--models", nargs="+", default=["tiny", "50m"], choices=sorted(RUNS))
    check_p.add_argument("--dtype", nargs="+", default=["float32"], choices=sorted(BYTES))
    check_p.add_argument("--checkpointing", nargs="+", type=int, default=[0], choices=[0, 1])
    check_p.add_argument("--chunks", nargs="+", type=int, default=[1])
    sub.add_parser("_worker").add_argument("args", nargs=2)
    args = parser.parse_args()
    if args.command == "table":
        print(table())
    elif args.command == "predict":
        if args.chunks > 1 and args.world > 1:
            parser.error("--chunks > 1 runs in one process (--world 1)")
        s = Setup(ARCHS[args.params], dtype=args.dtype, checkpointing=args.checkpointing, world=args.world,
                  shard=not args.replicas, critic=args.critic, micro_rows=args.micro_rows, tokens=args.tokens,
                  gen_rows=args.gen_rows, terms=args.terms, per_group=args.per_group, chunks=args.chunks)
        print(f"{args.params}: {s.arch.params / 1e9:.3f}B parameters, float32 weights computing in {args.dtype}, "
              f"{args.world} ranks")
        for key, value in budget(s).items():
            print(f"  {key:16s} {value / GB:8.2f} GB")
    elif args.command == "check":
        check(args.models, args.world, args.dtype, [bool(c) for c in args.checkpointing], args.chunks)
    else:
        spec, out = args.args
        _worker(json.loads(spec), out)


if __name__ == "__main__":
    main()
