"""Cost of the gradient probe, measured side by side with a training epoch and RAGEN's protocol.

    python bench/analysis_overhead.py [--repeats 3] [--groups 16 --group-size 8] [--threads 2] [--device cpu]

Builds the tiny default-size model (hidden 64, 2 layers, intermediate 256) and a training-size batch
(groups × group-size sequences of ~500 tokens, response mask = several ~8-token spans), then times,
interleaved in every repeat:

  (a) one actor update epoch (`update_actor`, mini-batch 32, micro-batch 16);
  (b) `gradient_probe`: 6 buckets + derived `all`, 3 components (entropy and KL coefficients non-zero);
  (c) a naive reference following RAGEN's protocol (docs/reference/ragen_behaviour.md §3.5–3.6): `all`
      recomputed as its own bucket, and for each bucket and each component a fresh forward + backward
      per micro-batch into `.grad`, then the global norm;
  (d) the three-reward-component analysis (`analysis.terms=[] analysis.reward_grad=true`): per-component
      advantages of correctness / format / length, one forward and three backward passes per micro-batch,
      6 buckets + `all`, cosine matrices and per-layer profiles;
  (e) the probe of (b) and the components of (d) together (the default terms with `analysis.reward_grad`);
  (f) the probe of (b) with `analysis.per_group`: every group differentiated alone, and 1000-resample bootstrap
      intervals over groups of every bucket norm and reg_share.

Prints the medians, the ratios b/a (target ≤ 2.6), c/b (target ≥ 2), d/a (target ≤ 2.6), e/a and f/b, and the
peak memory of each
phase above the resident memory before it (CPU: VmHWM after resetting it through /proc/self/clear_refs,
falling back to ru_maxrss; CUDA: torch.cuda.max_memory_allocated).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import re
import resource
import statistics
import time
from collections.abc import Callable

import torch

from rldynamics import metric_names as names
from rldynamics.algo.shares import sub_batch_share
from rldynamics.analysis.objective import ActorInputs, actor_terms, policy_loss_settings
from rldynamics.analysis.probe import ProbeSettings, gradient_probe
from rldynamics.config import AlgoConfig, TrainConfig
from rldynamics.models.forward import batch_logprobs, micro_batches
from rldynamics.models.tiny import build_tiny_model, build_tiny_tokenizer
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.train.actor import update_actor
from rldynamics.train.batch_ops import component_advantages

GRID = "######\n#_OX√#\n#_P__#\n#S___#\n######"
RAGEN_COMPONENT = {component: term for term, component in names.TERM_COMPONENT.items()}  # RAGEN's name -> term


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (each runs a, b and c once)")
    parser.add_argument("--groups", type=int, default=16, help="env groups in the batch")
    parser.add_argument("--group-size", type=int, default=8, help="sequences per group")
    parser.add_argument("--length", type=int, default=500, help="tokens per sequence (approximately)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def corpus() -> list[str]:
    """Sokoban-like texts for the tokenizer."""
    return [f"Turn {t}:\n{GRID}\nPlayer: ({t}, {t + 2})\n<think>push the box</think><answer>Up || Left</answer>"
            f"\nReward: -0.1" for t in range(1, 9)]


def make_batch(model, *, groups: int, group_size: int, length: int, seed: int):
    """A training-size batch: ~`length` tokens per row, 4-6 response spans of 6-10 tokens, GRPO-like advantages."""
    gen = torch.Generator().manual_seed(seed)
    n = groups * group_size
    input_ids = torch.randint(3, model.config.vocab_size, (n, length), generator=gen)  # [N, L]
    lengths = torch.randint(int(0.9 * length), length + 1, (n,), generator=gen)  # [N]
    positions = torch.arange(length)  # [L]
    attention_mask = (positions[None, :] < lengths[:, None]).long()  # [N, L]
    response_mask = torch.zeros(n, length)  # [N, L]
    for i in range(n):
        spans = int(torch.randint(4, 7, (1,), generator=gen))
        starts = torch.randint(1, int(lengths[i]) - 10, (spans,), generator=gen).tolist()
        for s in starts:
            response_mask[i, s : s + int(torch.randint(6, 11, (1,), generator=gen))] = 1.0
    group_ids = torch.arange(groups).repeat_interleave(group_size)  # [N]
    scores = torch.rand(n, generator=gen) * torch.rand(groups, generator=gen).repeat_interleave(group_size) * 4  # [N]
    components = torch.stack([(scores > 2).float(), (scores * 4).round() / 16, (scores / 4).clamp(max=1)], 1)  # [N, 3]
    batch = RolloutBatch(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                         scores=scores, group_ids=group_ids, reward_components=components,
                         reward_names=("correctness", "format", "length"), reward_weights=(0.34, 0.33, 0.33))
    by_group = scores.view(groups, group_size)  # [G, n]
    norm = ((by_group - by_group.mean(1, keepdim=True)) / (by_group.std(1, keepdim=True) + 1e-6)).view(n)  # [N]
    own, _ = batch_logprobs(model, input_ids.to(model.device), attention_mask.to(model.device), micro_batch_size=16)
    inputs = ActorInputs(old_logprobs=own + 0.02 * torch.randn(n, length, generator=gen),
                         advantages=norm[:, None] * response_mask,
                         ref_logprobs=own + 0.1 * torch.randn(n, length, generator=gen))
    group_std = {g: float(by_group[g].std()) for g in range(groups)}
    return batch, inputs, group_std


def naive_probe(model, batch, inputs, buckets: dict[str, torch.Tensor], algo: AlgoConfig, *, micro_batch_size: int,
                temperature: float) -> dict[str, float]:
    """RAGEN's protocol: per bucket (incl. `all`) and component, a fresh forward + backward per micro-batch; the
    norms under the probe's metric names (`grad_norm/<bucket>/<component>`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    settings = policy_loss_settings(algo)
    weights = settings.coefs
    out = {}
    for name, rows in buckets.items():
        mask = batch.response_mask[rows]  # [n_b, L]
        for comp, term in RAGEN_COMPONENT.items():
            model.zero_grad(set_to_none=True)
            for positions in micro_batches(torch.arange(rows.numel()), micro_batch_size):
                share = sub_batch_share(mask, positions, settings.agg)
                if share == 0.0:
                    continue
                terms, _ = actor_terms(model, batch, rows[positions], inputs, settings, temperature=temperature)
                (share * weights[term] * terms[term]).backward()
            grads = [p.grad for p in params if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            out[names.bucket_metric(names.GRAD_NORM, name, comp)] = float(norm)
            model.zero_grad(set_to_none=True)
    return out


def _hwm_kib() -> int | None:
    """Peak resident memory since the last reset (Linux), in KiB; None where unavailable."""
    try:
        with open("/proc/self/status") as f:
            return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1))
    except (OSError, AttributeError):
        return None


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


def measure(fn: Callable[[], object], device: str) -> tuple[float, float]:
    """Run `fn` once; return (seconds, peak MiB above the memory in use before it)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            base = _rss_kib() * 1024
        except OSError:
            base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated()
    else:
        hwm = _hwm_kib()
        peak = hwm * 1024 if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return seconds, max(peak - base, 0) / 2**20


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = build_tiny_tokenizer(corpus())
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, intermediate_size=256).to(args.device)
    batch, inputs, group_std = make_batch(model, groups=args.groups, group_size=args.group_size, length=args.length,
                                          seed=args.seed)
    algo = AlgoConfig(entropy_coef=0.001, kl_coef=0.001, kl_type="low_var_kl", loss_agg_mode="token-mean")
    train = TrainConfig(mini_batch_size=32, micro_batch_size=16, ppo_epochs=1, shuffle=False)
    trained = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-6)
    settings = ProbeSettings(algo=algo, micro_batch_size=train.micro_batch_size, temperature=1.0, num_buckets=6)
    comps = component_advantages(batch, AlgoConfig(adv_estimator="grpo"))  # name -> [N, L]
    weights = dict(zip(batch.reward_names, batch.reward_weights, strict=True))
    only_components = dataclasses.replace(settings, terms=())
    result = gradient_probe(model, batch, inputs, group_std, settings)
    buckets = {names.ALL: torch.arange(len(batch))}
    for name in sorted({b for b, _, _ in result.groups}, key=names.bucket_number):
        gids = torch.tensor([g for b, g, _ in result.groups if b == name])  # [G_b]
        buckets[name] = torch.isin(batch.group_ids, gids).nonzero().squeeze(1)  # [n_b]
    naive = naive_probe(model, batch, inputs, buckets, algo, micro_batch_size=train.micro_batch_size, temperature=1.0)
    worst = max(abs(naive[k] - result.metrics[k]) / max(naive[k], 1e-12) for k in naive)
    phases = {
        "a: update_actor epoch": lambda: update_actor(trained, optimizer, batch, inputs, algo, train),
        "b: gradient_probe": lambda: gradient_probe(model, batch, inputs, group_std, settings),
        "c: naive (RAGEN protocol)": lambda: naive_probe(model, batch, inputs, buckets, algo,
                                                         micro_batch_size=train.micro_batch_size, temperature=1.0),
        "d: 3 reward components": lambda: gradient_probe(model, batch, inputs, group_std, only_components, comps,
                                                         weights),
        "e: probe + 3 components": lambda: gradient_probe(model, batch, inputs, group_std, settings, comps, weights),
        "f: probe, per group + CIs": lambda: gradient_probe(model, batch, inputs, group_std,
                                                            dataclasses.replace(settings, per_group=True)),
    }
    times: dict[str, list[float]] = {k: [] for k in phases}
    peaks: dict[str, float] = dict.fromkeys(phases, 0.0)
    for _ in range(args.repeats):
        for name, fn in phases.items():  # interleaved, so load changes hit all three alike
            seconds, peak = measure(fn, args.device)
            times[name].append(seconds)
            peaks[name] = max(peaks[name], peak)
    tokens = int(batch.attention_mask.sum())
    print(f"device={args.device} threads={torch.get_num_threads()} batch={len(batch)}x{batch.input_ids.shape[1]} "
          f"tokens={tokens} response_tokens={int(batch.response_mask.sum())} buckets={len(buckets) - 1}+all "
          f"repeats={args.repeats}")
    print(f"naive vs probe grad norms: max relative difference {worst:.2e}")
    print(f"{'phase':28s} {'median s':>9s} {'min s':>8s} {'max s':>8s} {'peak MiB':>9s}")
    med = {}
    for name in phases:
        med[name] = statistics.median(times[name])
        print(f"{name:28s} {med[name]:9.3f} {min(times[name]):8.3f} {max(times[name]):8.3f} {peaks[name]:9.1f}")
    a, b, c, d, e, f = (med[k] for k in phases)
    print(f"b/a = {b / a:.2f}  (target <= 2.6)")
    print(f"c/b = {c / b:.2f}  (target >= 2)")
    print(f"d/a = {d / a:.2f}  (target <= 2.6: one forward and three backward passes)")
    print(f"e/a = {e / a:.2f}")
    print(f"f/b = {f / b:.2f}  (per-group gradients and bootstrap intervals against the bucket probe)")


if __name__ == "__main__":
    main()
