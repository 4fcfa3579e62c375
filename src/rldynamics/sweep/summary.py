"""The numbers and tables of a sweep summary, read from the run directories alone.

`sweep/report.py` writes them out (`summary.csv`: one row per point, per-seed values `;`-separated;
`summary.md`: point and run tables, failed runs) with the figures and the HTML page.

Per run: final and best validation success (`val-env/<env.name>/success`, last and highest validation),
steps run, outcome (completed, early_stopped: <reason>, failed, damaged, missing, interrupted, unfinished: see
`sweep/runs.py`; every run of `OUT/plan.json` is listed, a missing one too), mean pre-filter
reward std (`rollout/in_group_reward_std`) and kept ratio (`rollout/filter_kept_ratio`) over the training
steps, wall time (sum of `timing_s/step` plus the step-0 validation) and, when the runs logged the collapse
diagnostics (`collapse.enabled`), the final MI estimate, conditional entropy and retrieval above chance
(`plots/collapse.py`), with the rank correlation over runs of final success with final MI and with final entropy
and their bootstrap intervals (RAGEN-2's finding: MI tracks success, entropy does not). Per point: mean and sample std
(n - 1) over the seeds that validated. An early-stopped run is a failed regime, as in RAGEN's protocol:
its numbers are those at the stop, and the point's outcome names it. This module imports no torch.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rldynamics import metric_names as names
from rldynamics.plots.collapse import ENTROPY, MI, RETRIEVAL, final_value, spearman, spearman_interval
from rldynamics.plots.data import RunData, as_float, series
from rldynamics.sweep import runs

NEEDS_LOOK = ("failed", "damaged", "missing")  # outcomes listed with their reason under "Failed runs"


@dataclass
class RunResult:
    """What one run directory says, reduced to the summary's numbers."""

    label: str
    seed: int
    state: str
    detail: str
    steps_run: int | None
    final: float
    best: float
    val_steps: np.ndarray
    val_values: np.ndarray
    reward_std: float
    kept_ratio: float
    wall_s: float
    step_s: float
    report: str | None
    log: str | None
    metric: str
    tail: list[str] = field(default_factory=list)
    mi: float = math.nan  # final collapse MI estimate (nats per token), nan without the diagnostics
    entropy: float = math.nan  # final conditional entropy estimate H(Z|X)
    retrieval: float = math.nan  # final retrieval accuracy above chance
    policy_entropy: float = math.nan  # final `actor/entropy` (token entropy of the update's batch)

    @property
    def outcome(self) -> str:
        """`completed`, `completed: never updated: <why>`, `early_stopped: <reason>`, `failed`, ..."""
        return f"{self.state}: {self.detail}" if self.state in runs.FINISHED and self.detail else self.state

    @property
    def rel(self) -> str:
        """`<label>/seed<s>`, the run directory relative to OUT."""
        return f"{self.label}/seed{self.seed}"


@dataclass
class PointResult:
    """One point and its runs (sorted by seed)."""

    label: str
    value: str
    index: float
    runs: list[RunResult]

    def stat(self, name: str) -> tuple[float, float]:
        """(mean, sample std) of a run attribute over the runs where it is finite (std nan for < 2)."""
        x = np.array([getattr(r, name) for r in self.runs], dtype=float)
        x = x[np.isfinite(x)]
        if len(x) == 0:
            return math.nan, math.nan
        return float(x.mean()), float(x.std(ddof=1)) if len(x) > 1 else math.nan

    @property
    def outcome(self) -> str:
        """`completed` when every seed completed, else each other outcome with its count, e.g.
        `early_stopped: reward_variance_collapse (1/3)`."""
        others = [r.outcome for r in self.runs if r.outcome != "completed"]
        if not others:
            return "completed"
        n = len(self.runs)
        return "; ".join(f"{o} ({others.count(o)}/{n})" for o in dict.fromkeys(others))


@dataclass
class SweepSummary:
    name: str
    keys: list[str]
    metric: str
    points: list[PointResult]


def run_result(path: Path) -> RunResult:
    """Read one run directory into a RunResult."""
    run = runs.load(path)
    found = runs.outcome(path, run)
    steps, values = series(run.rows, runs.val_key(run))
    fin = np.isfinite(values)
    wall, step_s = _times(run)
    report = f"{path.parent.name}/{path.name}/report.html" if (path / "report.html").exists() else None
    log = f"{path.parent.name}/{path.name}/{runs.LOG_FILE}" if (path / runs.LOG_FILE).exists() else None
    return RunResult(label=path.parent.name, seed=runs.seed_of(path), state=found.state, detail=found.detail,
                     steps_run=found.step, final=float(values[fin][-1]) if fin.any() else math.nan,
                     best=float(values[fin].max()) if fin.any() else math.nan, val_steps=steps, val_values=values,
                     reward_std=_mean(run, names.IN_GROUP_REWARD_STD),
                     kept_ratio=_mean(run, names.FILTER_KEPT_RATIO),
                     wall_s=wall, step_s=step_s, report=report, log=log, metric=runs.val_key(run),
                     tail=runs.log_tail(path, 12) if found.state in NEEDS_LOOK else [],
                     mi=final_value(run, MI), entropy=final_value(run, ENTROPY), retrieval=final_value(run, RETRIEVAL),
                     policy_entropy=_last(run, names.ENTROPY))


def _last(run: RunData, key: str) -> float:
    _, y = series(run.rows, key)
    y = y[np.isfinite(y)]
    return float(y[-1]) if len(y) else math.nan


def _mean(run: RunData, key: str) -> float:
    _, y = series(run.rows, key)
    y = y[np.isfinite(y)]
    return float(y.mean()) if len(y) else math.nan


def _times(run: RunData) -> tuple[float, float]:
    """(wall seconds of the logged steps plus the step-0 validation, mean seconds per step)."""
    _, per_step = series(run.rows, names.STEP_TIME)
    if not run.rows or not len(per_step):
        return math.nan, math.nan
    first = as_float(run.rows[0].get(names.VAL_TIME)) if run.rows[0]["step"] == 0 else math.nan
    return float(per_step.sum() + (first if math.isfinite(first) else 0.0)), float(per_step.mean())


def missing_result(label: str, seed: int) -> RunResult:
    """A planned run (`OUT/plan.json`) without a run directory."""
    nothing = np.array([])
    return RunResult(label=label, seed=seed, state="missing", detail="its run directory is gone or empty (never "
                     "started, or deleted); run the sweep again to train it", steps_run=None, final=math.nan,
                     best=math.nan, val_steps=nothing, val_values=nothing, reward_std=math.nan, kept_ratio=math.nan,
                     wall_s=math.nan, step_s=math.nan, report=None, log=None, metric="")


def collect(out: str | Path) -> SweepSummary:
    """Every run under OUT and every planned one, grouped into points in sweep order (the order recorded by the
    launcher)."""
    out = Path(out)
    paths = runs.find_runs(out)
    planned = runs.planned_runs(out)
    if not paths and not planned:
        raise FileNotFoundError(f"{out} holds no sweep runs (expected <point>/seed<s>/ run directories)")
    points: dict[str, PointResult] = {}
    name, keys, metric = "", [], ""

    def add(result: RunResult, value: object, index: object) -> None:
        point = points.setdefault(result.label, PointResult(result.label, str(value), float(index) if isinstance(
            index, (int, float)) else math.inf, []))
        point.runs.append(result)

    for path in paths:
        status = runs.read_status(path)
        name, keys = name or str(status.get("sweep", "")), keys or list(status.get("keys", []))
        result = run_result(path)
        metric = metric or result.metric
        add(result, status.get("value", result.label), status.get("index"))
    found = {(p.parent.name, runs.seed_of(p)) for p in paths}
    for e in planned:
        if (e["point"], e["seed"]) not in found:
            add(missing_result(e["point"], e["seed"]), e.get("value", e["point"]), e.get("index"))
    ordered = sorted(points.values(), key=lambda p: (p.index, p.label))
    for p in ordered:
        p.runs.sort(key=lambda r: r.seed)
    return SweepSummary(name or out.name, keys, metric, ordered)


# ---------------------------------------------------------------------- number formatting


def num(x: float, digits: int = 6) -> str:
    """`x` with `digits` significant digits, empty when not finite."""
    return f"{x:.{digits}g}" if math.isfinite(x) else ""


def pct(x: float) -> str:
    """A success rate in % with one decimal, `–` when missing."""
    return f"{100 * x:.1f}" if math.isfinite(x) else "–"


def pct_pm(mean: float, std: float) -> str:
    """`29.1 ± 1.2` (percent), the mean alone without a std."""
    return pct(mean) + (f" ± {100 * std:.1f}" if math.isfinite(std) else "")


def duration(seconds: float) -> str:
    """`42 s`, `6.2 min`, `1.5 h`."""
    if not math.isfinite(seconds):
        return "–"
    if seconds < 120:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


# ---------------------------------------------------------------------- tables

CSV_COLUMNS = ("point", "value", "seeds", "outcome", "final_success_mean", "final_success_std", "best_success_mean",
               "best_success_std", "final_success_per_seed", "best_success_per_seed", "steps_per_seed",
               "outcome_per_seed", "in_group_reward_std_mean", "filter_kept_ratio_mean", "wall_time_s_mean",
               "step_time_s_mean", "final_mi_mean", "final_entropy_mean", "final_mi_per_seed",
               "final_entropy_per_seed")


def csv_text(summary: SweepSummary) -> str:
    """`summary.csv`: one row per point."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for p in summary.points:
        def per_seed(attr: str, p=p) -> str:
            return ";".join(num(getattr(r, attr)) if attr != "steps_run" else str(r.steps_run or "")
                            for r in p.runs)

        writer.writerow([p.label, p.value, ";".join(str(r.seed) for r in p.runs), p.outcome,
                         *(num(v) for v in p.stat("final")), *(num(v) for v in p.stat("best")),
                         per_seed("final"), per_seed("best"), per_seed("steps_run"),
                         ";".join(r.outcome for r in p.runs), num(p.stat("reward_std")[0]),
                         num(p.stat("kept_ratio")[0]), num(p.stat("wall_s")[0]), num(p.stat("step_s")[0]),
                         num(p.stat("mi")[0]), num(p.stat("entropy")[0]), per_seed("mi"), per_seed("entropy")])
    return buf.getvalue()


def point_rows(summary: SweepSummary) -> list[list[str]]:
    """The point table (header first) shared by summary.md and summary.html."""
    rows = [["point", "final success %", "best success %", "seeds", "steps", "outcome", "pre-filter reward std",
             "kept ratio", "wall time / run", "s / step"]]
    for p in summary.points:
        rows.append([p.label, pct_pm(*p.stat("final")), pct_pm(*p.stat("best")), str(len(p.runs)),
                     ", ".join(str(r.steps_run if r.steps_run is not None else "–") for r in p.runs), p.outcome,
                     num(p.stat("reward_std")[0], 3) or "–", num(p.stat("kept_ratio")[0], 3) or "–",
                     duration(p.stat("wall_s")[0]), num(p.stat("step_s")[0], 3) or "–"])
    if has_collapse(summary):
        rows[0] += ["final MI", "final H(Z|X)"]
        for row, p in zip(rows[1:], summary.points, strict=True):
            row += [num(p.stat("mi")[0], 3) or "–", num(p.stat("entropy")[0], 3) or "–"]
    return rows


def has_collapse(summary: SweepSummary) -> bool:
    """Whether any run logged the collapse diagnostics."""
    return any(math.isfinite(r.mi) for p in summary.points for r in p.runs)


def collapse_finding(summary: SweepSummary, resamples: int = 2000) -> dict[str, tuple[float, float, float, int]]:
    """Spearman correlation over runs of final success with final MI, retrieval above chance, conditional entropy
    and policy entropy (`actor/entropy`): name -> (rho, ci_low, ci_high, runs), over the runs with the success, MI,
    retrieval and conditional entropy finite (and, for the policy entropy, logged) (`plots.collapse.spearman`)."""
    done = [r for p in summary.points for r in p.runs
            if all(math.isfinite(v) for v in (r.final, r.mi, r.entropy, r.retrieval))]
    out = {}
    for name in ("mi", "retrieval", "entropy", "policy_entropy"):
        pairs = np.array([(r.final, getattr(r, name)) for r in done if math.isfinite(getattr(r, name))]).reshape(-1, 2)
        out[name] = (spearman(*pairs.T), *spearman_interval(*pairs.T, resamples), len(pairs))
    return out


def collapse_markdown(summary: SweepSummary) -> str:
    """The `summary.md` section of the collapse diagnostics: the finding, then every run's final values."""
    finding = collapse_finding(summary)
    what = {"mi": "final MI estimate", "retrieval": "final retrieval above chance",
            "entropy": "final conditional entropy H(Z|X)", "policy_entropy": f"final policy entropy {names.ENTROPY}"}
    lines = ["\n## Template collapse: success vs MI and entropy\n\n",
             "Spearman rank correlation over runs of the final success with (95 % bootstrap interval over runs):\n\n"]
    lines += [f"- {what[k]}: {num(rho, 3) or 'undefined'} [{num(lo, 3) or '–'}, {num(hi, 3) or '–'}] ({n} runs)\n"
              for k, (rho, lo, hi, n) in finding.items()]
    table = [["point", "seed", "outcome", "final %", "final MI", "final H(Z|X)", "retrieval above chance",
              names.ENTROPY]]
    table += [[p.label, str(r.seed), r.outcome, pct(r.final), num(r.mi, 3) or "–", num(r.entropy, 3) or "–",
               num(r.retrieval, 3) or "–", num(r.policy_entropy, 3) or "–"] for p in summary.points for r in p.runs]
    return "".join(lines) + "\n" + _md_table(table)


def run_rows(summary: SweepSummary) -> list[list[str]]:
    """The per-run table (header first); the last column is the run's report path (or empty)."""
    rows = [["point", "seed", "outcome", "steps", "final %", "best %", "reward std", "kept ratio", "wall time",
             "report"]]
    for p in summary.points:
        for r in p.runs:
            rows.append([p.label, str(r.seed), r.outcome, str(r.steps_run if r.steps_run is not None else "–"),
                         pct(r.final), pct(r.best), num(r.reward_std, 3) or "–", num(r.kept_ratio, 3) or "–",
                         duration(r.wall_s), r.report or ""])
    return rows


def failed_runs(summary: SweepSummary) -> list[RunResult]:
    """Runs that crashed (non-zero exit), are damaged or missing, in table order."""
    return [r for p in summary.points for r in p.runs if r.state in NEEDS_LOOK]


def failure_line(r: RunResult) -> str:
    """`rldyn train: config error: ...`, `damaged: config.yaml is missing`: what went wrong with a failed run."""
    detail = r.detail or "no error line"
    return detail if r.state == "failed" else f"{r.state}: {detail}"


def intro(summary: SweepSummary) -> str:
    """The explanation above the tables (plain text, shared by summary.md and summary.html)."""
    seeds = sorted({r.seed for p in summary.points for r in p.runs})
    swept = ", ".join(summary.keys) or "(not recorded)"
    return (f"{len(summary.points)} point(s) x seeds {', '.join(map(str, seeds))}; swept: {swept}. Success is "
            f"{summary.metric} in %: final = last validation, best = highest; mean ± sample std over seeds (n - 1). "
            "An early-stopped run is a failed regime (RAGEN's protocol): its numbers are those at the stop and its "
            "point's outcome names it. Reward std and kept ratio are means over training steps; wall time is the "
            "logged step times plus the first validation.")


TEXT_COLUMNS = ("point", "outcome", "report")


def _md_table(rows: list[list[str]]) -> str:
    head, *body = rows
    align = ["---" if h in TEXT_COLUMNS else "---:" for h in head]
    lines = [head, align, *body]
    return "\n".join("| " + " | ".join(c.replace("|", "\\|") for c in line) + " |" for line in lines) + "\n"


def markdown(summary: SweepSummary) -> str:
    """`summary.md`."""
    runs_table = [row[:-1] + [f"[report]({row[-1]})" if row[-1] else "–"] for row in run_rows(summary)]
    runs_table[0][-1] = "report"
    parts = [f"# Sweep `{summary.name}`\n\n{intro(summary)}\n\n", _md_table(point_rows(summary)),
             "\n![validation success vs step](summary_curves.png)\n\n![final success per point](summary_value.png)\n",
             "\n## Runs\n\n", _md_table(runs_table)]
    if has_collapse(summary):
        parts.append(collapse_markdown(summary))
    failed = failed_runs(summary)
    if failed:
        parts.append("\n## Failed runs\n\n")
        parts += [f"- `{r.rel}`: {failure_line(r)}{f' (log: `{r.log}`)' if r.log else ''}\n" for r in failed]
    return "".join(parts)
