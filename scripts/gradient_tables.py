"""Markdown tables of a gradient analysis: per bucket, RV, task and regulariser norms with 95 % intervals, reg_share.

    python scripts/gradient_tables.py RUN_DIR [RUN_DIR ...] [--prefix grad_norm]

One table per run directory and analysis step (the README's "RAGEN-2's gradient finding" tables), followed by
the least-squares log-log slope of the per-group task and regulariser norms against the group RV (groups with
RV > 0 and a non-zero norm; needs `analysis.per_group=true`).
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


def table(run, step: int, prefix: str) -> str:
    """One markdown table of the buckets of `step`."""
    row = run.row(step)
    lines = ["| bucket | groups | RV mean | task norm [95 % CI] | regulariser norm [95 % CI] | reg_share [95 % CI] |",
             "|---|---:|---:|---:|---:|---:|"]
    for b in [*bucket_names(row, prefix), "all"]:
        head = f"{prefix}/{b}"
        label = bucket_label(b, run.bucket_mode, run.zero_bucket)
        groups, rv = fmt(row.get(f"{head}/group_rv_count")), fmt(row.get(f"{head}/reward_std_mean"))
        lines.append(f"| {label} | {groups} | {rv} | {cell(row, f'{head}/task')} | {cell(row, f'{head}/regularizer')} "
                     f"| {cell(row, f'{head}/reg_share')} |")
    groups = read_group_norms(run.path, step, prefix)
    if groups:
        fits = {m: fit_slope(groups["reward_std"], groups[m]) for m in ("task", "regularizer") if m in groups}
        lines.append("")
        lines.append("per-group log-log slope vs RV: " + "; ".join(
            f"{m} {fmt(s)} ± {fmt(se)} ({n} groups)" for m, (s, se, n) in fits.items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--prefix", default="grad_norm", help="metric prefix (grad_norm_prefilter: unfiltered)")
    args = parser.parse_args()
    for path in args.runs:
        run = load_run(path)
        for step in analysis_steps(run, args.prefix):
            print(f"### {run.name}, step {step} ({args.prefix})\n\n{table(run, step, args.prefix)}\n")


if __name__ == "__main__":
    main()
