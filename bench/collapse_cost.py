"""Cost of the collapse diagnostics' cross-scoring, ours against RAGEN's protocol, and against a training step.

    python bench/collapse_cost.py [--groups 8 --group-size 8 --turns 5] [--samples 64] [--repeats 3] [--threads 2]
                                  [--device cpu]

Builds the tiny default-size model (hidden 64, 2 layers; random weights: the replies are as long as the token
budget allows) and rolls out a Sokoban batch of the embedded preset's shape (groups x group-size trajectories,
`--turns` turns of up to 24 tokens). On that batch it draws the pairs of both modes once (first turn: one column
per group; trajectory-uniform: `--samples` pairs, each its own column), then times, interleaved in every repeat:

  (a) a training step without the diagnostics: the rollout, the old-log-prob pass and one actor update epoch
      (GRPO advantages, mini-batch 32, micro-batch 16);
  (b) ours: `cross_loglik` with each distinct prompt encoded once per micro-batch (shared prefix) and the scores of
      identical prompts copied, plus the metrics and 200 bootstrap resamples (`train/diagnostics/collapse.py`'s work);
  (c) naive (RAGEN's protocol, docs/reference/ragen_behaviour.md §5): every column's prompt with every reply
      forwarded as an independent full sequence [x_j | z_i] (N x C rows, no prefix reuse, no de-duplication of
      columns).

Prints the medians, the largest |L_ours - L_naive| (the two must agree), the ratios c/b per mode and overall
(goal ≥ 3) and b/a (the diagnostics' cost relative to a step when they run; divide by `collapse.compute_freq`
for the average over steps).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from rldynamics.algo.advantages import grpo_advantages
from rldynamics.analysis.collapse import bootstrap_intervals, collapse_metrics
from rldynamics.analysis.cross_scoring import Pairs, cross_loglik, first_turn_pairs, reply_lengths, trajectory_pairs
from rldynamics.analysis.objective import ActorInputs
from rldynamics.config import AlgoConfig, TrainConfig, make_config
from rldynamics.models.forward import batch_logprobs
from rldynamics.models.tiny import build_tiny_model, build_tiny_tokenizer
from rldynamics.rollout.agent import rollout
from rldynamics.train.actor import update_actor
from rldynamics.train.warmstart import tiny_corpus


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=8, help="env groups in the batch")
    parser.add_argument("--group-size", type=int, default=8, help="trajectories per group")
    parser.add_argument("--turns", type=int, default=5, help="turns per trajectory")
    parser.add_argument("--samples", type=int, default=64, help="collapse.num_samples")
    parser.add_argument("--micro-batch-size", type=int, default=128, help="collapse.micro_batch_size")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (each runs a, b and c once)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def ours(model, pairs: Pairs, pad_id: int, micro: int) -> torch.Tensor:
    """The stage's work for one mode: shared-prefix cross-scoring, metrics and bootstrap intervals. [N, C]"""
    loglik = cross_loglik(model, pairs, pad_id=pad_id, micro_batch_size=micro)  # [N, C]
    lengths = reply_lengths(pairs)
    collapse_metrics(loglik, lengths, pairs.column, pairs.classes, ema_std={})
    bootstrap_intervals(loglik, lengths, pairs.column, pairs.classes, resamples=200, seed=0)
    return loglik


def naive(model, pairs: Pairs, pad_id: int, micro: int) -> torch.Tensor:
    """RAGEN's protocol: every (column, reply) as its own full sequence, columns never merged. [N, C]"""
    separate = Pairs(pairs.prompts, pairs.replies, pairs.column, torch.arange(len(pairs.prompts)))
    return cross_loglik(model, separate, pad_id=pad_id, micro_batch_size=micro, shared_prefix=False)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = make_config(overrides=[f"env.max_turns={args.turns}"])
    tokenizer = build_tiny_tokenizer(tiny_corpus(cfg.env, num_seeds=20))
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, intermediate_size=256).to(args.device)
    seeds = list(range(args.groups))

    def roll():
        return rollout(model, tokenizer, seeds, args.group_size, cfg.env, temperature=1.0)

    batch = roll()
    generator = torch.Generator().manual_seed(args.seed)
    first, _ = first_turn_pairs(batch.input_ids, batch.response_mask, batch.group_ids, args.samples, generator)
    traj = trajectory_pairs(batch.input_ids, batch.response_mask, args.samples, generator)
    modes = {"first turn": first, "trajectory": traj}
    pad, micro = tokenizer.pad_token_id, args.micro_batch_size
    worst = max(float((ours(model, p, pad, micro) - naive(model, p, pad, micro)).abs().max()) for p in modes.values())

    algo, train = AlgoConfig(adv_estimator="grpo"), TrainConfig(mini_batch_size=32, micro_batch_size=16)
    trained = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-6)

    def step():
        b = roll()
        old, _ = batch_logprobs(trained, b.input_ids, b.attention_mask, micro_batch_size=16,
                                positions=b.response_mask)  # [N, L]
        inputs = ActorInputs(old_logprobs=old, advantages=grpo_advantages(b.scores, b.group_ids, b.response_mask))
        update_actor(trained, optimizer, b, inputs, algo, train)

    phases = {"a: training step": step}
    for name, pairs in modes.items():
        phases[f"b: ours, {name}"] = lambda p=pairs: ours(model, p, pad, micro)
        phases[f"c: naive, {name}"] = lambda p=pairs: naive(model, p, pad, micro)
    times: dict[str, list[float]] = {k: [] for k in phases}
    for _ in range(args.repeats):
        for name, fn in phases.items():  # interleaved: load changes hit every phase alike
            times[name].append(timed(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"batch: {len(batch)} trajectories of up to {batch.input_ids.shape[1]} tokens; device {args.device}, "
          f"{args.threads} thread(s), {args.repeats} repeat(s)")
    for name, pairs in modes.items():
        print(f"  {name}: {len(pairs.replies)} replies x {len(pairs.prompts)} columns "
              f"({int(pairs.classes.max()) + 1} distinct prompts)")
    for name, value in med.items():
        print(f"{name:<28} {value:8.3f} s")
    print(f"max |L_ours - L_naive| = {worst:.2e} nats")
    for name in modes:
        print(f"naive / ours, {name}: {med[f'c: naive, {name}'] / med[f'b: ours, {name}']:.2f}x")
    total_ours = sum(med[f"b: ours, {m}"] for m in modes)
    total_naive = sum(med[f"c: naive, {m}"] for m in modes)
    print(f"naive / ours, both modes: {total_naive / total_ours:.2f}x (goal >= 3)")
    print(f"diagnostics / training step (both modes, when due): {total_ours / med['a: training step']:.2f}")


if __name__ == "__main__":
    main()
