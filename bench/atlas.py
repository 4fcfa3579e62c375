"""The pathology atlas on SmolLM2-135M-Instruct (docs/failure-modes.md): runs that each produce one known failure, a
healthy control, and the table of what the health monitor saw in them.

    python bench/atlas.py run [NAME ...] [--out runs/atlas]    # the scenarios (all by default), one after another
    python bench/atlas.py table [--out runs/atlas]             # the table, from the run directories alone
    python bench/atlas.py claims [--out runs/atlas] --sweep DIR [--sweep DIR]   # RAGEN-2's two claims
    python bench/atlas.py figures [--out runs/atlas] [--to docs/figures/atlas]   # each run's health timeline

Every scenario is `rldyn train --preset math-smollm2` with the collapse diagnostics on (first turn only: the task has
one) and its own overrides (`SCENARIOS`); the control is the preset itself. `run` starts each one as its own
`rldyn train` process into OUT/<name> and skips a run whose last step is done; an interrupted one resumes from its
latest checkpoint (`checkpoint.resume=latest`), so the atlas can be run a piece at a time. One thread per run
(`model.threads=1`): two runs fit this 2-core CPU side by side (`run NAME` in two shells).

`table` reads OUT/<name>/metrics.jsonl and events.jsonl and prints, per run: the start (validation success at step 0,
the policy before any update, at the training temperature), training success at its worst and last steps,
validation success first and last (with the standard error over distinct problems), the step success fell (the
first step t >= 2 at which training success, and the step after it, are both more than 0.1 below the start), every
rule that fired with its first step and action, the lead time (the step success fell minus the first step any rule
fired: positive = warned before), and how the run ended.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
from pathlib import Path

from rldynamics import metric_names as names
from rldynamics.tracking.run_dir import read_events, read_metrics

PRESET = "math-smollm2"
COMMON = ["model.threads=1", "collapse.enabled=true", "collapse.multi_turn_enabled=false",
          "collapse.micro_batch_size=16"]  # 128 rows per cross-scoring forward peak at several GB of logits
SHORT = ["train.steps=15", "val.every=5", "checkpoint.every=1", "checkpoint.keep_last=4"]
HOT = "train.lr=1e-3"  # 100 x the preset's learning rate
SCENARIOS: dict[str, list[str]] = {
    # the preset as shipped (30 steps, validation every 10): the false alarms of every rule are counted here
    "control": [],
    # the update blows up: nothing acts (the spike rule only warns); 25 steps, so that RAGEN's reward-variance early
    # stop (a 10-step baseline, then 10 steps below a tenth of it) can fire
    "blowup": [*SHORT, HOT, "health.grad_spike=warn", "train.steps=25"],
    # the same, and the first rule that fires on it stops the run
    "blowup_stop": [*SHORT, HOT, "health.truncation=stop", "health.repetition=stop", "health.policy_drift=stop",
                    "health.entropy_collapse=stop"],
    # no entropy bonus (the preset has none), 10 x the learning rate, sampling at temperature 0.7
    "entropy_collapse": [*SHORT, "train.lr=1e-4", "train.temperature=0.7"],
    # the length component outweighs correctness 8 to 1 and asks for 200 characters (a worked reply is ~60)
    "reward_hacking": [*SHORT, "train.lr=3e-5", "env.reward_weights.correctness=0.1", "env.reward_weights.format=0.1",
                       "env.reward_weights.length=0.8", "env.math.length_target=200"],
    # a reward that does not depend on the question (format only): one fixed reply scores as well as any
    "template_collapse": [*SHORT, "train.lr=3e-5", "env.reward_weights.correctness=0", "env.reward_weights.format=1",
                          "env.reward_weights.length=0", "train.steps=10"],
    # the vLLM engine samples weights up to 3 steps old, uncorrected, then with truncated importance sampling
    "stale_sampler": [*SHORT, "train.lr=3e-5", "rollout.engine=vllm", "rollout.sync_every=4"],
    "stale_sampler_tis": [*SHORT, "train.lr=3e-5", "rollout.engine=vllm", "rollout.sync_every=4", "algo.tis_cap=2"],
}
FALL = 0.1  # how far below its start training success must be, two steps in a row, to have fallen
ENV = "math"  # the preset's env: its success metrics
TRAIN_SUCCESS = names.env_metric(ENV, names.SUCCESS)
VAL_SUCCESS = names.val_success(ENV)
VAL_SUCCESS_SE = names.env_metric(ENV, names.SUCCESS_SE, validation=True)


def run(scenarios: list[str], out: Path) -> None:
    for name in scenarios:
        rows = _metrics(out / name)
        steps = [int(a.split("=")[1]) for a in SCENARIOS[name] if a.startswith("train.steps=")] or [30]
        stopped = rows and any(names.early_stop_reason(k) is not None for k in rows[-1])
        if rows and (rows[-1].get("step", 0) >= steps[-1] or stopped):
            print(f"{name}: done", flush=True)
            continue
        resume = ["checkpoint.resume=latest"] if (out / name / "checkpoints").is_dir() else []
        cmd = ["rldyn", "train", "--preset", PRESET, f"log.run_dir={out}", f"log.name={name}", *COMMON,
               *SCENARIOS[name], *resume]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=False)


def _metrics(run_dir: Path) -> list[dict]:
    """The run's metrics rows; none for a run not started yet."""
    return read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []


def fall(rows: list[dict], env: str = ENV, val_start: bool = True) -> tuple[float, int | None]:
    """The start of a run's metrics rows (validation success at step 0, the policy before any update, where
    `val_start`: the validation samples at the training temperature, as this preset's does; else training success
    at its first step) and the step training success fell (the first step t >= 2 at which it, and the step after it,
    are both more than FALL below the start; None: it did not)."""
    train_key, val_key = names.env_metric(env, names.SUCCESS), names.val_success(env)
    train = {r["step"]: r[train_key] for r in rows if train_key in r}
    val = [(r["step"], r[val_key]) for r in rows if val_key in r] if val_start else []
    steps = sorted(train)
    start = val[0][1] if val and val[0][0] == 0 else train[steps[0]] if steps else 0.0
    low = [s for s in steps if train[s] < start - FALL]
    return start, next((s for s, t in zip(steps, steps[1:], strict=False) if s >= 2 and s in low and t in low), None)


def summarize(run_dir: Path) -> dict:
    """One run's row of the atlas table (see the module docstring)."""
    rows = read_metrics(run_dir)
    events = read_events(run_dir)
    train = {r["step"]: r[TRAIN_SUCCESS] for r in rows if TRAIN_SUCCESS in r}
    val = [(r["step"], r[VAL_SUCCESS], r.get(VAL_SUCCESS_SE)) for r in rows if VAL_SUCCESS in r]
    steps = sorted(train)
    start, fell = fall(rows)
    fired: dict[str, tuple[int, str]] = {}
    for e in events:
        if e.get("rule") not in (None, "rollback") and e["rule"] not in fired:
            fired[e["rule"]] = (e["step"], e.get("action", ""))
    first = min((s for s, _ in fired.values()), default=None)
    stopped = [reason for r in rows for k in r if (reason := names.early_stop_reason(k)) is not None]
    return {"run": run_dir.name, "steps": steps[-1] if steps else 0, "train_start": start,
            "train_last": train[steps[-1]] if steps else None, "train_min": min(train.values()) if train else None,
            "val": val, "fell": fell, "fired": fired, "lead": None if fell is None or first is None else fell - first,
            "ended": f"stopped: {stopped[0]}" if stopped else "ran to the end",
            "entropy": [r.get(names.ENTROPY) for r in rows if names.ENTROPY in r],
            "mi": [(r["step"], r[names.FIRST_TURN_MI]) for r in rows if names.FIRST_TURN_MI in r]}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def table(out: Path) -> str:
    lines = ["| run | steps | success: start / training min / training last (%) | validation first -> last (%, ± SE) | "
             "success fell at | rules fired (first step, action) | lead (steps) | ended |",
             "|---|---:|---|---|---:|---|---:|---|"]
    for name in SCENARIOS:
        if not (out / name / "metrics.jsonl").is_file():
            continue
        s = summarize(out / name)
        v = s["val"]
        val = "-" if not v else f"{_pct(v[0][1])} -> {_pct(v[-1][1])} (± {_pct(v[-1][2])}, step {v[-1][0]})"
        fired = ", ".join(f"{rule} ({step}, {action})" for rule, (step, action) in
                          sorted(s["fired"].items(), key=lambda kv: kv[1][0])) or "none"
        lines.append(f"| {name} | {s['steps']} | {_pct(s['train_start'])} / {_pct(s['train_min'])} / "
                     f"{_pct(s['train_last'])} | {val} | {s['fell'] or '-'} | {fired} | "
                     f"{'-' if s['lead'] is None else s['lead']} | {s['ended']} |")
    return "\n".join(lines)


MARGINS = {  # the signal each rule reads, as logged: (column, metric, reduce over the run's steps)
    "entropy / start": (names.ENTROPY, "min_ratio"),  # entropy_collapse: below 0.1 x the mean of the first 5
    "truncated": (names.RESPONSE_CLIP_RATIO, "max"),  # truncation: above 0.5
    "repeating": (names.HEALTH_REPETITION_RATE, "max"),  # repetition: above 0.3
    "zero-variance groups": (names.HEALTH_ZERO_VARIANCE_SHARE, "max"),  # reward_variance_collapse: 0.9, 5 steps
    "PPO KL": (names.PPO_KL, "max"),  # policy_drift: above 0.1
    "clipped": (names.PG_CLIPFRAC, "max"),  # policy_drift: above 0.3
    "sampler KL (k3)": (names.rollout_corr("k3_kl"), "max"),  # mismatch: above 0.01
    "MI / first": (names.FIRST_TURN_MI, "min_ratio_first"),  # template_collapse: below 0.5
    "length share": (names.health_reward_share("length"), "max"),  # reward_component: above 0.95 or below -0.1
}


def margins(out: Path) -> str:
    """Per run, the extreme of each rule's signal over its steps: how close the healthy control came to each
    threshold, and how far past it the failing runs went."""
    lines = ["| run | " + " | ".join(MARGINS) + " |", "|---|" + "---:|" * len(MARGINS)]
    for name in SCENARIOS:
        rows = _metrics(out / name)
        if not rows:
            continue
        cells = []
        for key, how in MARGINS.values():
            xs = [r[key] for r in rows if key in r and r.get("step", 0) >= 1 and math.isfinite(r[key])]
            if not xs:
                cells.append("-")
            elif how == "max":
                cells.append(f"{max(xs):.3g}")
            elif how == "min_ratio":
                cells.append(f"{min(xs) / statistics.mean(xs[:5]):.3g}")
            else:
                cells.append(f"{min(xs) / xs[0]:.3g}" if xs[0] > 0 else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def claims(out: Path, sweeps: list[Path]) -> str:
    """RAGEN-2's two claims on these runs: the filter (the sweeps' top-p 0.9 against no filter, over their seeds) and
    whether the final MI tracks final success better than the entropy (over every finished single-turn run here)."""
    import numpy as np

    from rldynamics.plots.collapse import ENTROPY, MI, final_value, spearman, spearman_interval
    from rldynamics.plots.data import load_run
    from rldynamics.sweep.summary import run_result

    lines = []
    finals: dict[str, list[float]] = {}
    dirs = [d for sweep in sweeps for d in sorted(sweep.glob("*/seed*")) if (d / "metrics.jsonl").is_file()]
    results = [run_result(d) for d in dirs]
    for r in results:
        if math.isfinite(r.final):
            finals.setdefault(r.label, []).append(r.final)
    for label, xs in finals.items():
        se = statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else math.nan
        lines.append(f"{label}: final validation {100 * statistics.mean(xs):.1f} ± {100 * se:.1f} % "
                     f"(mean ± SE over {len(xs)} seeds: {', '.join(f'{100 * x:.1f}' for x in xs)})")
    if len(finals) == 2 and all(len(xs) > 1 for xs in finals.values()):
        (a, xa), (b, xb) = finals.items()
        diff = statistics.mean(xa) - statistics.mean(xb)
        se = (statistics.variance(xa) / len(xa) + statistics.variance(xb) / len(xb)) ** 0.5
        lines.append(f"{a} - {b}: {100 * diff:+.1f} points, SE of the difference {100 * se:.1f} ({diff / se:+.2f} SE)")
    runs = [(name, load_run(out / name)) for name in SCENARIOS if (out / name / "metrics.jsonl").is_file()]
    runs += [(f"{d.parent.name}/{d.name}", load_run(d)) for d in dirs]
    table = []
    for name, run in runs:
        val = [r for r in run.rows if any(names.val_success_env(k) is not None for k in r)]
        success = next((v for k, v in val[-1].items() if names.val_success_env(k) is not None),
                       math.nan) if val and val[-1]["step"] > 0 else math.nan  # a run never validated after training
        # (stopped before its first validation, or still running) has no final success
        entropy = [r[names.ENTROPY] for r in run.rows if names.ENTROPY in r]
        table.append((name, success, final_value(run, MI), final_value(run, ENTROPY),
                      entropy[-1] if entropy else math.nan))
    # a run identical to another (the no-filter twin of a top-p run that kept every group) counts once
    ok = np.array(sorted({t[1:] for t in table if all(math.isfinite(v) for v in t[1:])}))
    lines.append(f"\nSpearman over {len(ok)} runs of the final validation success with (95 % bootstrap interval):")
    for i, what in ((1, "final MI (first turn)"), (2, "final H(Z|X)"), (3, "final policy entropy (actor/entropy)")):
        if len(ok) >= 3:
            lo, hi = spearman_interval(ok[:, 0], ok[:, i], 2000)
            lines.append(f"  {what}: {spearman(ok[:, 0], ok[:, i]):+.2f} [{lo:+.2f}, {hi:+.2f}]")
    if len(ok) >= 3:  # the same resamples for both: the interval of the difference of the two rank correlations
        rng = np.random.default_rng(0)
        for i, what in ((2, "H(Z|X)"), (3, names.ENTROPY)):
            diffs = [abs(spearman(ok[j, 0], ok[j, 1])) - abs(spearman(ok[j, 0], ok[j, i]))
                     for j in rng.integers(0, len(ok), (2000, len(ok)))]
            diffs = np.array([d for d in diffs if math.isfinite(d)])
            point = abs(spearman(ok[:, 0], ok[:, 1])) - abs(spearman(ok[:, 0], ok[:, i]))
            lines.append(f"  |rho MI| - |rho {what}|: {point:+.2f} [{np.percentile(diffs, 2.5):+.2f}, "
                         f"{np.percentile(diffs, 97.5):+.2f}] (paired bootstrap over runs)")
    lines.append("\n| run | final validation % | final MI | final H(Z\\|X) | final actor/entropy |")
    lines.append("|---|---:|---:|---:|---:|")
    lines += [f"| {n} | {_pct(v)} | {mi:.3f} | {h:.3f} | {e:.3f} |" for n, v, mi, h, e in table]
    return "\n".join(lines)


def figures(out: Path, to: Path) -> None:
    from rldynamics.plots.data import load_run
    from rldynamics.plots.timeline import write_timeline

    for name in SCENARIOS:
        if (out / name / "metrics.jsonl").is_file():
            for path in write_timeline(load_run(out / name), to / name, dpi=60):
                print(path.rename(to / f"{name}.png"))
                path.parent.rmdir()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("command", choices=("run", "table", "claims", "figures"))
    p.add_argument("names", nargs="*", help=f"scenarios to run (default all): {', '.join(SCENARIOS)}")
    p.add_argument("--out", type=Path, default=Path("runs/atlas"))
    p.add_argument("--to", type=Path, default=Path("docs/figures/atlas"))
    p.add_argument("--sweep", type=Path, action="append", default=[],
                   help="claims: a `rldyn sweep top_p --values 0.9,nofilter` output directory (repeatable)")
    a = p.parse_args(argv)
    unknown = [n for n in a.names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario {', '.join(unknown)}; the scenarios: {', '.join(SCENARIOS)}")
    if a.command == "run":
        run(a.names or list(SCENARIOS), a.out)
    elif a.command == "table":
        print(table(a.out) + "\n\n" + margins(a.out))
    elif a.command == "claims":
        print(claims(a.out, a.sweep))
    else:
        figures(a.out, a.to)
    return 0


if __name__ == "__main__":
    sys.exit(main())
