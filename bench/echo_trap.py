"""RAGEN's Echo Trap: an agent game trained without the reward-variance filter until it collapses, and beside it the
same seeds with RAGEN's filter (docs/agent-games.md).

    python bench/echo_trap.py run [--scenarios frozenlake-tiny] [--arms none,filter] [--seeds 0-4] [--parallel 2]
        [--out runs/echo_trap] [key=value ...]
    python bench/echo_trap.py table [--out runs/echo_trap]
    python bench/echo_trap.py claims [--out runs/echo_trap]
    python bench/echo_trap.py replies [--out runs/echo_trap]

Each (scenario, arm, seed) is one `rldyn train` process (one torch thread, `false_alarms.run_one`: a finished run is
skipped, an interrupted one resumes) into OUT/<scenario>-<arm>/<preset>/seed<s>, with early stopping off, the health
rules at their defaults (they warn, never act), and the collapse diagnostics on. Extra `key=value` arguments go to
every run (e.g. `model.path=runs/bandit-warm/checkpoints/step_17/actor` for a SmolLM2 scenario).

`table` reads the run directories alone. Per run: held-out validation success at the start, at its peak (the step)
and at the end, each with its standard error clustered by puzzle; the fall (peak minus end) in standard errors of
the difference; whether the run was trapped (the peak 2 standard errors above the start, the end 2 below the peak);
the step the replies froze (the first-turn MI below half its first value, and the policy entropy below half its mean
over the first five steps); the first health rule above `record` with its step, and its lead (the first validation
2 standard errors below the peak minus that step: positive = it warned before). Then per scenario and arm the
means over seeds with their standard errors, the mean share of groups with zero reward variance, and the mean share
of groups the filter kept.

`claims` gives RAGEN-2's two claims per scenario: the filter's effect on final success (filter minus none, with the
standard error of the difference over seeds) and whether the final first-turn MI ranks the runs' final success
better than the final policy entropy does (Spearman over the scenario's runs of both arms, with the paired
bootstrap interval of the difference of the absolute correlations).

`replies` reads the decoded samples each run keeps (`samples.jsonl`, `log.samples_per_step` a step) and prints, per
run and window of 10 steps, the share of first replies equal to the window's most common one (a frozen template),
and on Bandit the share that pulled the arm named first (a policy that pulls by position, not by name).
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
from pathlib import Path

import numpy as np

from false_alarms import ABOVE_RECORD, run_grid, run_one, validation
from rldynamics import metric_names as names
from rldynamics.tracking.run_dir import read_events, read_metrics, read_samples

COLLAPSE = ["collapse.enabled=true", "collapse.multi_turn_enabled=false"]
SCENARIOS = {  # name -> (preset, overrides)
    # the tiny model on FrozenLake 4x4 at 3.3 x the preset's learning rate, 100 steps (at 6.7 x it never rose)
    "frozenlake-tiny": ("frozenlake-tiny", ["train.lr=1e-3", "train.steps=100", "val.every=10",
                                            "val.env_groups=256"]),
    # SmolLM2-135M-Instruct on the two-armed bandit from its format-only warm start (model.path= the warm start)
    "bandit-smollm2": ("bandit-smollm2", ["collapse.micro_batch_size=16", "collapse.compute_freq=10"]),
}
# RAGEN's top-p 0.9 filter in its linear form, zero-variance groups never kept (RAGEN's gradient-analysis setting):
# the softmax form of `rescue.RAGEN_FILTER` keeps every group wherever reward spreads are below about 1 (softmax
# weights within e^1 of each other; on bandit-smollm2 it kept 8 of 8 groups at each of its first 6 steps)
FILTER = ["filter.strategy=top_p", "filter.value=0.9", "filter.prob_mode=linear", "filter.include_zero=false"]
ARMS = {"none": [], "filter": FILTER}  # no filter (RAGEN's StarPO), RAGEN's filter
COMMON = ["early_stop.enabled=false", "log.progress=false", *COLLAPSE]
SE_FACTOR = 2.0  # how many standard errors make a rise, a fall


def run(scenario: str, arm: str, seed: int, out: Path, extra: list[str]) -> Path:
    preset, overrides = SCENARIOS[scenario]
    return run_one(preset, seed, out / f"{scenario}-{arm}", None, [*COMMON, *overrides, *ARMS[arm], *extra])


def _first_below(series: list[tuple[int, float]], level: float) -> int | None:
    return next((step for step, x in series if x < level), None)


def summarize(run_dir: Path) -> dict:
    """One run's row of the table (see the module docstring)."""
    rows = read_metrics(run_dir)
    val = validation(run_dir)
    (_, start, se0), (s1, end, se1) = val[0], val[-1]
    peak_step, peak, peak_se = max(val, key=lambda v: v[1])  # the first of equal peaks
    fall_se = math.hypot(peak_se, se1)  # the standard error of peak minus end
    fall_step = next((s for s, x, se in val if s > peak_step and peak - x > SE_FACTOR * math.hypot(se, peak_se)),
                     None)
    mi = [(r["step"], r[names.FIRST_TURN_MI]) for r in rows if math.isfinite(r.get(names.FIRST_TURN_MI, math.nan))]
    entropy = [(r["step"], r[names.ENTROPY]) for r in rows if names.ENTROPY in r]
    events = [e for e in read_events(run_dir) if e.get("action") in ABOVE_RECORD]
    first = min(events, key=lambda e: e["step"], default=None)
    return {
        "run": f"{run_dir.parent.parent.name}/{run_dir.name}", "start": (start, se0), "peak": (peak, peak_se),
        "peak_step": peak_step, "end": (end, se1), "end_step": s1,
        "fall_se": (peak - end) / fall_se if fall_se > 0 else 0.0,
        "trapped": peak - start > SE_FACTOR * math.hypot(peak_se, se0) and peak - end > SE_FACTOR * fall_se,
        "fall_step": fall_step,
        "mi_froze": _first_below(mi, 0.5 * mi[0][1]) if mi and mi[0][1] > 0 else None,
        "entropy_froze": _first_below(entropy, 0.5 * statistics.fmean(x for _, x in entropy[:5])) if entropy else None,
        "first_rule": None if first is None else (first["rule"], first["step"]),
        "lead": None if first is None or fall_step is None else fall_step - first["step"],
        "final_mi": mi[-1][1] if mi else math.nan, "final_entropy": entropy[-1][1] if entropy else math.nan,
        "zero_variance": _mean_of(rows, names.HEALTH_ZERO_VARIANCE_SHARE),
        "kept": _mean_of(rows, names.FILTER_KEPT_RATIO),
    }


def _mean_of(rows: list[dict], key: str) -> float:
    """The mean of `key` over the training steps that logged it (nan: none)."""
    xs = [r[key] for r in rows if r.get("step", 0) >= 1 and math.isfinite(r.get(key, math.nan))]
    return statistics.fmean(xs) if xs else math.nan


def _runs(out: Path, scenario: str, arm: str) -> list[Path]:
    preset = SCENARIOS[scenario][0]
    return sorted(p.parent for p in (out / f"{scenario}-{arm}" / preset).glob("seed*/metrics.jsonl")
                  if len(validation(p.parent)) >= 2)


def _pct(value_se: tuple[float, float]) -> str:
    return f"{100 * value_se[0]:.1f} ± {100 * value_se[1]:.1f}"


def _share(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0%}"


def _mean_se(xs: list[float]) -> str:
    if not xs:
        return "-"
    se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.nan
    return f"{100 * statistics.fmean(xs):.1f} ± {100 * se:.1f}"


def table(out: Path) -> str:
    lines = ["| run | start % | peak % (step) | end % (step) | fall / SE | trapped | MI halved at | entropy halved at "
             "| first rule above record (step) | lead |", "|---|---|---|---|---:|---|---:|---:|---|---:|"]
    means = ["", "| scenario | arm | seeds | start % | peak % | end % | trapped | zero-variance groups | groups kept |",
             "|---|---|---:|---|---|---|---:|---:|---:|"]
    for scenario in SCENARIOS:
        for arm in ARMS:
            rows = [summarize(r) for r in _runs(out, scenario, arm)]
            for s in rows:
                rule = "none" if s["first_rule"] is None else f"{s['first_rule'][0]} ({s['first_rule'][1]})"
                trapped = "yes" if s["trapped"] else "no"
                lines.append(f"| {s['run']} | {_pct(s['start'])} | {_pct(s['peak'])} ({s['peak_step']}) | "
                             f"{_pct(s['end'])} ({s['end_step']}) | {s['fall_se']:.1f} | {trapped}"
                             f" | {s['mi_froze'] or '-'} | {s['entropy_froze'] or '-'} | {rule} | "
                             f"{'-' if s['lead'] is None else s['lead']} |")
            if rows:
                means.append(f"| {scenario} | {arm} | {len(rows)} | "
                             + " | ".join(_mean_se([s[k][0] for s in rows]) for k in ("start", "peak", "end"))
                             + f" | {sum(s['trapped'] for s in rows)} of {len(rows)} | "
                             + " | ".join(_share(statistics.fmean(s[k] for s in rows))
                                          for k in ("zero_variance", "kept"))
                             + " |")
    return "\n".join(lines + means)


def claims(out: Path) -> str:
    from rldynamics.plots.collapse import spearman, spearman_interval

    lines = []
    for scenario in SCENARIOS:
        runs = {arm: [summarize(r) for r in _runs(out, scenario, arm)] for arm in ARMS}
        a, b = ([s["end"][0] for s in runs[arm]] for arm in ("filter", "none"))
        if a or b:
            lines.append(f"{scenario}:")
        if len(a) > 1 and len(b) > 1:
            diff = statistics.fmean(a) - statistics.fmean(b)
            se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
            lines.append(f"  final success with the filter {_mean_se(a)} %, without {_mean_se(b)} %: "
                         f"{100 * diff:+.1f} points" + (f", {diff / se:+.2f} SE of the difference" if se else ""))
        ok = np.array([f for f in ((s["end"][0], s["final_mi"], s["final_entropy"]) for arm in ARMS
                                   for s in runs[arm]) if all(math.isfinite(v) for v in f)])
        if len(ok) < 3:
            continue
        lines.append(f"  Spearman of the final validation success over its {len(ok)} runs (95 % bootstrap interval):")
        for i, what in ((1, "final first-turn MI"), (2, "final policy entropy")):
            lo, hi = spearman_interval(ok[:, 0], ok[:, i], 2000)
            lines.append(f"    {what}: {spearman(ok[:, 0], ok[:, i]):+.2f} [{lo:+.2f}, {hi:+.2f}]")
        rng = np.random.default_rng(0)
        diffs = np.array([abs(spearman(ok[j, 0], ok[j, 1])) - abs(spearman(ok[j, 0], ok[j, 2]))
                          for j in rng.integers(0, len(ok), (2000, len(ok)))])
        diffs = diffs[np.isfinite(diffs)]
        point = abs(spearman(ok[:, 0], ok[:, 1])) - abs(spearman(ok[:, 0], ok[:, 2]))
        lines.append(f"    |rho MI| - |rho entropy|: {point:+.2f} [{np.percentile(diffs, 2.5):+.2f}, "
                     f"{np.percentile(diffs, 97.5):+.2f}] (paired bootstrap over runs)")
    return "\n".join(lines)


FIRST_REPLY = re.compile(r"<\|im_start\|>assistant\n(.*?)(?:<\|im_end\|>|$)", re.S)  # chatml: SmolLM2's and tiny's
BANDIT_ARMS = re.compile(r"Arms: (\S+) and (\S+)\.")


def _reply_shares(samples: list[dict]) -> tuple[float, float]:
    """The share of first replies equal to the most common one, and (Bandit) the share that pulled the arm named
    first (nan: no such sample)."""
    first = [(m.group(1).strip(), s["text"]) for s in samples if (m := FIRST_REPLY.search(s["text"]))]
    texts = [reply for reply, _ in first]
    common = max(map(texts.count, set(texts))) / len(texts) if texts else math.nan
    named_first = [f"<answer>{arms.group(1)}</answer>" in reply.replace(" ", "")
                   for reply, text in first if (arms := BANDIT_ARMS.search(text))]
    return common, statistics.fmean(named_first) if named_first else math.nan


def replies(out: Path, window: int = 10) -> str:
    lines = ["| run | steps | samples | most common first reply | pulled the arm named first |",
             "|---|---|---:|---:|---:|"]
    runs = [(f"{sc}-{arm}/{r.name}", r) for sc in SCENARIOS for arm in ARMS for r in _runs(out, sc, arm)]
    for name, run_dir in runs:
        by_window: dict[int, list[dict]] = {}
        for sample in read_samples(run_dir):
            by_window.setdefault((sample["step"] - 1) // window, []).append(sample)
        for w, samples in sorted(by_window.items()):
            common, named_first = _reply_shares(samples)
            lines.append(f"| {name} | {w * window + 1}-{(w + 1) * window} | {len(samples)} | {_share(common)} | "
                         f"{_share(named_first)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("run", "table", "claims", "replies"))
    parser.add_argument("--scenarios", default="frozenlake-tiny")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--seeds", default="0-4")
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/echo_trap"))
    parser.add_argument("extra", nargs="*", help="key=value for every run")
    args = parser.parse_intermixed_args(argv)
    if args.what == "run":
        run_grid(args.out, args.scenarios, args.arms, args.seeds, args.parallel,
                 lambda sc, arm, seed: run(sc, arm, seed, args.out, args.extra))
    print({"claims": claims, "replies": replies}.get(args.what, table)(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
