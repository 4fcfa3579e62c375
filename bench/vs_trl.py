"""Seconds per training step of rldynamics against TRL's GRPOTrainer on the same work, side by side.

    pip install -e ".[bench]"           # TRL 1.16.0 (install torch==2.13.0 alongside so no CUDA build comes in)
    python bench/vs_trl.py [--sizes tiny,h256,h512] [--rounds 3] [--steps 3]

The matched setting, per model size: the same weights (the embedded tiny model, or a randomly initialised
Qwen2 with the tiny tokenizer at hidden 256 / 4 layers and hidden 512 / 8 layers), the same one-turn Sokoban
prompts (token ids checked identical), the same reward (our env scores TRL's completions through the same
turn function), G groups x 8 samples, 24 new tokens at temperature 1 (no top-p / top-k), stop at the same
ids, one optimisation pass over one mini-batch in micro-batches of 16, no KL, no entropy bonus,
seq-mean-token-mean against TRL's `loss_type="grpo"`, std-normalised group advantages, AdamW with the same
lr / weight decay / max grad norm, one torch thread.

What differs: prompt order (TRL's sampler shuffles the dataset; the prompts are the same length), the sampled
tokens (each trainer's own seeded stream), and the per-step bookkeeping each trainer does (our run directory
writes and reward rows; TRL's logging).

Each round runs our trainer and TRL's in alternating processes, `--steps` steps each; a process's first step
(one-off costs) is dropped. Printed per size: median seconds per step of each, `TRL/ours` (TRL's seconds over
ours; > 1 means we are faster) and our per-phase medians.
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
from pathlib import Path

from sizes import model_dir

GROUPS = {"tiny": 8, "h256": 8, "h512": 2}  # env groups per step at each size (bench/sizes.py)
GROUP_SIZE, MICRO, NEW_TOKENS, LR = 8, 16, 24, 1e-6
PHASES = ("gen", "old_log_prob", "adv", "update_actor")


def our_overrides(model_path: str, groups: int, steps: int, run_dir: str) -> list[str]:
    """Our config for the matched setting."""
    return [f"model.path={model_path}", "env.max_turns=1", f"env.max_new_tokens={NEW_TOKENS}",
            f"train.env_groups={groups}", f"train.group_size={GROUP_SIZE}", f"train.steps={steps}",
            f"train.lr={LR}", "train.weight_decay=0.0", "train.ppo_epochs=1",
            f"train.mini_batch_size={groups * GROUP_SIZE}", f"train.micro_batch_size={MICRO}",
            "train.temperature=1.0", "algo.adv_estimator=grpo", "algo.norm_adv_by_std=true", "algo.kl_coef=0.0",
            "algo.entropy_coef=0.0", "algo.loss_agg_mode=seq-mean-token-mean", "filter.strategy=none",
            "analysis.enabled=false", "val.every=0", "val.before_train=false", "checkpoint.save_last=false",
            "checkpoint.every=0", "log.progress=false", "log.report=false", "log.samples_per_step=0",
            f"log.run_dir={run_dir}"]


def run_ours(model_path: str, groups: int, steps: int) -> dict:
    """Our trainer for `steps` steps; per-step seconds and per-phase seconds (first step dropped)."""
    from rldynamics.config import make_config
    from rldynamics.tracking.run_dir import read_metrics
    from rldynamics.train.trainer import train

    with tempfile.TemporaryDirectory() as tmp:
        rows = read_metrics(train(make_config(overrides=our_overrides(model_path, groups, steps, tmp))))[1:]
    return {"step": [r["timing_s/step"] for r in rows],
            "phases": {p: [r.get(f"timing_s/{p}", 0.0) for r in rows] for p in PHASES}}


def sokoban_rows(tokenizer, model, groups: int, steps: int):
    """(prompt text, env seed) of every group of our first `steps` steps, checked to tokenise to our ids."""
    from rldynamics.config import make_config, reward_names
    from rldynamics.envs import make_env
    from rldynamics.rollout.agent import RolloutContext, _start
    from rldynamics.rollout.chat import ChatPrompts
    from rldynamics.rollout.rewards import resolve_weights
    from rldynamics.train.stages import train_seeds

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


def run_trl(model_path: str, groups: int, steps: int) -> dict:
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
            bf16=False, fp16=False,
        )
        times = StepTimes()
        trainer = GRPOTrainer(model=model, reward_funcs=sokoban_reward, args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_list(rows), callbacks=[times])
        trainer.train()
    steps_s = [b - a for a, b in zip(times.ends, times.ends[1:], strict=False)]
    return {"step": steps_s[1:]}


def worker(side: str, model_path: str, groups: int, steps: int) -> dict:
    """Run one side in a fresh process (one torch thread) and return its timings."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    cmd = [sys.executable, __file__, "--worker", side, "--model", model_path, "--groups", str(groups),
           "--steps", str(steps)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{side} worker failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(size: str, path: str, rounds: int, steps: int) -> None:
    """Alternate the two trainers for `rounds` rounds and print the medians, the ratio and our phases."""
    groups = GROUPS[size]
    ours, trl, phases = [], [], {p: [] for p in PHASES}
    for r in range(rounds):
        for side in (("ours", "trl") if r % 2 == 0 else ("trl", "ours")):
            res = worker(side, path, groups, steps)
            (ours if side == "ours" else trl).extend(res["step"])
            for p, v in res.get("phases", {}).items():
                phases[p].extend(v)
    o, t = statistics.median(ours), statistics.median(trl)
    share = "  ".join(f"{p} {statistics.median(v):.3f}s ({statistics.median(v) / o:.0%})"
                      for p, v in phases.items() if v)
    print(f"{size:<6} batch {groups}x{GROUP_SIZE}  ours {o:.3f} s/step  TRL {t:.3f} s/step  TRL/ours {t / o:.2f}"
          f"   ({len(ours)}+{len(trl)} steps)", flush=True)
    print(f"       ours by phase: {share}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,h256,h512")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="steps per process (the first is dropped)")
    parser.add_argument("--worker", choices=("ours", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--groups", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import torch
        from transformers.utils import logging as hf_logging

        torch.set_num_threads(1)
        hf_logging.disable_progress_bar()
        run = run_ours if args.worker == "ours" else run_trl
        print(json.dumps(run(args.model, args.groups, args.steps)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            compare(size, model_dir(size, Path(tmp)), args.rounds, args.steps)


if __name__ == "__main__":
    main()
