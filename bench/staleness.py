"""How stale may a rollout be? Staleness 0-3 x the policy loss on the tiny model, against the on-policy control
(docs/staleness.md).

    python bench/staleness.py run [--preset math-tiny] [--lags lag0,lag1,lag2,lag3]
        [--arms pg,tis,mis,ppo_sampler,cispo,is] [--seeds 0-4] [--parallel 2] [--out runs/staleness] [key=value ...]
    python bench/staleness.py table [--out runs/staleness]

Each (lag, loss, seed) is one `rldyn train` process of `--preset` (default math-tiny; `math-smollm2` for the real
model, with e.g. `train.steps=20 val.every=10`) (`false_alarms.run_one`: one torch thread, a
finished run skipped, an interrupted one resumed) into OUT/<lag>-<loss>/<preset>/seed<s>, early stopping off and
the health rules at their defaults (they warn, never act). A lag of N is `rollout.staleness=N`, sampled with keyed
streams and taking turns with the update (`rollout.overlap` gives the same runs bit for bit, on two threads). At
lag 0 every loss is the same update up to float rounding (every ratio is 1), so `lag0` runs `pg` alone.

Losses (`ARMS`): `pg` the preset's PPO with π_old the trainer's (verl's decoupled way; one optimizer step a batch
makes every ratio 1, so nothing corrects the lag); `tis` the same with truncated importance sampling (cap 2);
`mis` with sequence masking; `ppo_sampler` PPO's clip with π_old the sampler's (tinker's `ppo`); `cispo` CISPO's
clipped weight with π_old the sampler's; `is` unclipped importance sampling against the sampler (tinker's
`importance_sampling`).

`table` reads the run directories. Per lag and loss: runs, held-out success at the end (mean over seeds ± their
standard error) and its difference from the lag-0 control in standard errors of the difference; the runs whose
held-out success fell (a validation 2 standard errors of the difference below the run's start) and the median step
of that validation;
the first health rule above `record` (the most common one, and the median step) and the median lead (the step
success fell minus the rule's step: positive = it warned before); the mean sampler/trainer KL (`rollout/corr/k3_kl`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import Counter
from pathlib import Path

from false_alarms import ABOVE_RECORD, run_grid, run_one, validation
from rldynamics import metric_names as names
from rldynamics.tracking.run_dir import read_events, read_metrics

PRESETS = ("math-tiny", "math-smollm2")  # the math env: `atlas.fall` reads its success
SETTINGS = ["train.steps=100", "analysis.enabled=false",  # the preset's validation: 512 problems every 25 steps
            "early_stop.enabled=false", "log.progress=false", "train.row_seeded_sampling=true"]
SAMPLER = ["algo.old_logprobs=sampler"]
ARMS = {  # loss -> overrides
    "pg": [],
    "tis": ["algo.tis_cap=2"],
    "mis": ["algo.mis=true"],
    "ppo_sampler": SAMPLER,
    "cispo": [*SAMPLER, "algo.policy_loss=cispo"],
    "is": [*SAMPLER, "algo.policy_loss=is"],
}
CONTROL = "lag0-pg"
SE_FACTOR = 2.0  # standard errors that make a fall


def lag_of(name: str) -> int:
    """`lag3` -> 3."""
    return int(name.removeprefix("lag"))


def run(preset: str, lag: str, arm: str, seed: int, out: Path, extra: list[str]) -> Path | None:
    if lag_of(lag) == 0 and arm != "pg":
        return None  # the same update as pg at lag 0
    return run_one(preset, seed, out / f"{lag}-{arm}", None,
                   [*SETTINGS, f"rollout.staleness={lag_of(lag)}", *ARMS[arm], *extra])


def fell_at(val: list[tuple[int, float, float]]) -> int | None:
    """The first validation step whose success is `SE_FACTOR` standard errors of the difference below the start's
    (the standard errors clustered by problem); None: none was."""
    _, start, start_se = val[0]
    return next((step for step, x, se in val[1:] if x < start - SE_FACTOR * math.hypot(start_se, se)), None)


def summarize(run_dir: Path) -> dict:
    """One run: its final held-out success, the step training success fell, its first rule above record."""
    rows = read_metrics(run_dir)
    val = validation(run_dir)
    fell = fell_at(val)
    events = [e for e in read_events(run_dir) if e.get("action") in ABOVE_RECORD]
    first = min(events, key=lambda e: e["step"]) if events else None
    kl = [r[names.rollout_corr("k3_kl")] for r in rows if names.rollout_corr("k3_kl") in r]
    return {"end": val[-1][1], "fell": fell, "rule": first["rule"] if first else None,
            "rule_step": first["step"] if first else None, "kl": statistics.fmean(kl) if kl else math.nan}


def _runs(out: Path, cell: str) -> list[Path]:
    return sorted(p.parent for p in (out / cell).glob("*/seed*/metrics.jsonl") if len(validation(p.parent)) >= 2)


def _mean_se(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.nan)


def table(out: Path) -> str:
    control = [summarize(r)["end"] for r in _runs(out, CONTROL)]
    base = _mean_se(control) if control else (math.nan, math.nan)
    lines = ["| lag | loss | runs | held-out success at the end % | vs lag 0 / SE | fell (median step) | "
             "first rule above record (median step) | median lead | sampler/trainer KL |",
             "|---:|---|---:|---|---:|---|---|---:|---:|"]
    cells = sorted({p.name for p in out.glob("lag*-*") if p.is_dir()}, key=lambda c: (lag_of(c.split("-")[0]), c))
    for cell in cells:
        rows = [summarize(r) for r in _runs(out, cell)]
        if not rows:
            continue
        lag, loss = cell.split("-", 1)
        mean, se = _mean_se([r["end"] for r in rows])
        diff = (mean - base[0]) / math.hypot(se, base[1]) if cell != CONTROL else math.nan
        fell = [r["fell"] for r in rows if r["fell"] is not None]
        rules = [r for r in rows if r["rule"] is not None]
        common = Counter(r["rule"] for r in rules).most_common(1)
        leads = [r["fell"] - r["rule_step"] for r in rules if r["fell"] is not None]
        fell_words = f"{len(fell)} of {len(rows)}" + (f" ({statistics.median(fell):g})" if fell else "")
        rule = (f"{common[0][0]} on {len(rules)} ({statistics.median(r['rule_step'] for r in rules):g})" if rules
                else "none")
        lead = f"{statistics.median(leads):+g}" if leads else "-"
        diff_words = "-" if math.isnan(diff) else f"{diff:+.1f}"
        kl = statistics.fmean(r["kl"] for r in rows)
        lines.append(f"| {lag_of(lag)} | {loss} | {len(rows)} | {100 * mean:.1f} ± {100 * se:.1f} | {diff_words} | "
                     f"{fell_words} | {rule} | {lead} | {kl:.2g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("run", "table"))
    parser.add_argument("--preset", default=PRESETS[0], choices=PRESETS)
    parser.add_argument("--lags", default="lag0,lag1,lag2,lag3")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--seeds", default="0-4")
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/staleness"))
    parser.add_argument("extra", nargs="*", help="key=value for every run")
    args = parser.parse_intermixed_args(argv)
    if args.what == "run":
        run_grid(args.out, args.lags, args.arms, args.seeds, args.parallel,
                 lambda lag, arm, seed: run(args.preset, lag, arm, seed, args.out, args.extra))
    print(table(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
