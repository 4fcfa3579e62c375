"""Markdown tables of a gradient analysis: per bucket, RV, task and regulariser norms with 95 % intervals, reg_share.

    python scripts/gradient_tables.py RUN_DIR [RUN_DIR ...] [--prefix grad_norm] [--by-step]

One table per run directory and analysis step, followed by the least-squares log-log slope of the per-group task
and regulariser norms against the group reward std (groups with RV > 0 and a non-zero norm; needs
`analysis.per_group=true`). With `--by-step` (docs/gradient-analysis.md's "RAGEN-2's gradient finding" tables): one table per
analysis round (the k-th analysis step of every run, whatever its step number) with the runs stacked, then one
table of the slopes.
"""

from __future__ import annotations

import argparse

import numpy as np

from rldynamics.plots.analysis import fit_slope, fmt
from rldynamics.plots.data import analysis_steps, bucket_label, bucket_names, load_run, read_group_norms


def cell(row: dict, key: str) -> str:
    """`value [low, high]` of a metric, or `value` when no interval was logged."""
    value = row.get(key)
    if value is None:
        return "–"
    low, high = row.get(f"{key}/ci_low"), row.get(f"{key}/ci_high")
    if low is None or high is None or not np.isfinite(low):
        return fmt(value)
    return f"{fmt(value)} [{fmt(low)}, {fmt(high)}]"


HEADER = "| bucket | groups | RV mean | task norm [95 % CI] | regulariser norm [95 % CI] | reg_share [95 % CI] |"


def bucket_rows(run, step: int, prefix: str, first: str = "") -> list[str]:
    """Markdown rows of the buckets of `step` (and `all`), each starting with `first` cells if given."""
    row, lines = run.row(step), []
    for b in [*bucket_names(row, prefix), "all"]:
        head = f"{prefix}/{b}"
        label = bucket_label(b, run.bucket_mode, run.zero_bucket)
        groups, rv = fmt(row.get(f"{head}/group_rv_count")), fmt(row.get(f"{head}/reward_std_mean"))
        lines.append(f"| {first}{label} | {groups} | {rv} | {cell(row, f'{head}/task')} "
                     f"| {cell(row, f'{head}/regularizer')} | {cell(row, f'{head}/reg_share')} |")
    return lines


def slopes(run, step: int, prefix: str) -> dict[str, tuple[float, float, int]]:
    """Per-group log-log slopes against the group reward std: metric -> (slope, SE, groups); {} without groups.csv
    norms."""
    groups = read_group_norms(run.path, step, prefix)
    return {m: fit_slope(groups["reward_std"], groups[m]) for m in ("task", "regularizer") if m in groups}


def table(run, step: int, prefix: str) -> str:
    """One markdown table of the buckets of `step`, with the per-group slopes below it."""
    lines = [HEADER, "|---|---:|---:|---:|---:|---:|", *bucket_rows(run, step, prefix)]
    fits = slopes(run, step, prefix)
    if fits:
        lines.append("")
        lines.append("per-group log-log slope vs reward std: " + "; ".join(
            f"{m} {fmt(s)} ± {fmt(se)} ({n} groups)" for m, (s, se, n) in fits.items()))
    return "\n".join(lines)


def by_step(runs, prefix: str) -> str:
    """One table per analysis round with the runs stacked, then the slope table."""
    steps = [analysis_steps(run, prefix) for run in runs]
    out = []
    for k in range(max(map(len, steps), default=0)):
        lines = ["| run (step) " + HEADER, "|---|---|---:|---:|---:|---:|---:|"]
        for run, st in zip(runs, steps, strict=True):
            if k < len(st):
                lines += bucket_rows(run, st[k], prefix, first=f"{run.name} ({st[k]}) | ")
        out.append(f"### analysis {k + 1}\n\n" + "\n".join(lines))
    lines = ["| run | step | task slope ± SE (groups) | regulariser slope ± SE (groups) |", "|---|---:|---:|---:|"]
    for run, st in zip(runs, steps, strict=True):
        for step in st:
            fits = slopes(run, step, prefix)
            lines.append(f"| {run.name} | {step} | " + " | ".join(
                f"{fmt(fits[m][0])} ± {fmt(fits[m][1])} ({fits[m][2]})" if m in fits else "–"
                for m in ("task", "regularizer")) + " |")
    out.append("### per-group log-log slopes against the group reward std\n\n" + "\n".join(lines))
    return "\n\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--prefix", default="grad_norm", help="metric prefix (grad_norm_prefilter: unfiltered)")
    parser.add_argument("--by-step", action="store_true", help="one table per analysis round, runs stacked")
    args = parser.parse_args()
    if args.by_step:
        print(by_step([load_run(path) for path in args.runs], args.prefix))
        return
    for path in args.runs:
        run = load_run(path)
        for step in analysis_steps(run, args.prefix):
            print(f"### {run.name}, step {step} ({args.prefix})\n\n{table(run, step, args.prefix)}\n")


if __name__ == "__main__":
    main()
