"""Per-step gradient-analysis figures (RAGEN's `plot_gradient_analysis.py` panels) and the multi-step paper grid.

Differences from RAGEN (``reference/ragen_behaviour.md`` §9, §11.18), on purpose:
- Axes never clip data: no fixed y-limits; a value axis switches to log (all positive) or symlog (zeros or
  negatives present) only when the values span more than ~1.5 decades, so zero-RV buckets stay visible.
- A metric that was not logged is drawn as "missing", never as a zero bar.
- The summary's left panel is a box plot of the per-group reward stds read from ``analysis/step_<N>/groups.csv``.
- The unweighted regulariser norms (``raw/entropy``, ``raw/kl``) get their own row when logged, so a
  coefficient of 0 does not hide the regulariser's gradient.
Figures are built with the object-oriented API on an Agg canvas (no pyplot state, no backend switching).
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.text import Text

from rldynamics.plots.data import (
    COMPONENTS,
    RunData,
    analysis_steps,
    bucket_label,
    bucket_names,
    bucket_values,
    read_groups,
    regularizer_values,
)

DPI = 150
COLORS = {"task": "#1f77b4", "entropy": "#2ca02c", "kl": "#d62728", "regularizer": "#9467bd", "rv": "#7f7f7f"}


# ---------------------------------------------------------------- figure helpers (shared with curves.py)


def new_figure(width: float, height: float, **kwargs: Any) -> Figure:
    """A Figure on an Agg canvas with constrained layout."""
    fig = Figure(figsize=(width, height), layout="constrained", **kwargs)
    FigureCanvasAgg(fig)
    return fig


PNG_METADATA = {"Software": None}  # no matplotlib version in the file: the same figure gives the same bytes


def save_png(fig: Figure, path: str | Path, dpi: int = DPI) -> Path:
    """Write `fig` as PNG and return the path."""
    literal_text(fig)
    fig.savefig(path, dpi=dpi, format="png", facecolor="white", metadata=PNG_METADATA)
    return Path(path)


def png_bytes(fig: Figure, dpi: int = DPI) -> bytes:
    """`fig` encoded as PNG bytes."""
    literal_text(fig)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png", facecolor="white", metadata=PNG_METADATA)
    return buf.getvalue()


def literal_text(fig: Figure) -> None:
    """Draw every title, label, legend entry and note literally: a `$` in a run or env name never starts
    mathtext (which fails on text such as `$x^$`). Tick labels keep mathtext (log axes format `10^{k}` with it)."""
    ticks = {t for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)
             for t in (*axis.get_ticklabels(which="both"), axis.get_offset_text())}
    for text in fig.findobj(Text):
        if text not in ticks:
            text.set_parse_math(False)


def fmt(value: float) -> str:
    """Short label for a metric value: 3 significant digits, `n/a` for missing, `±inf`."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.3g}"


def auto_scale(ax, values, axis: str = "y", prefer_log: bool = False, decades: float = 1.5) -> str:
    """Pick linear / log / symlog for `axis` so no finite value is dropped; returns the scale name.

    Linear unless the non-zero magnitudes span more than `decades` decades (or `prefer_log`); then log
    when every value is positive, else symlog with the linear region up to the smallest non-zero magnitude.
    """
    v = np.asarray(values, dtype=float).ravel()
    v = v[np.isfinite(v)]
    nonzero = np.abs(v[v != 0])
    if nonzero.size == 0 or not (prefer_log or nonzero.max() / nonzero.min() > 10**decades):
        return "linear"
    setter = ax.set_yscale if axis == "y" else ax.set_xscale
    if (v > 0).all():
        setter("log")
        return "log"
    linthresh = float(nonzero.min())
    setter("symlog", linthresh=linthresh)
    if (v >= 0).all():  # symlog margins would open an empty negative range below the zeros
        get, put = (ax.get_ylim, ax.set_ylim) if axis == "y" else (ax.get_xlim, ax.set_xlim)
        lo, hi = get()
        put(max(lo, -0.3 * linthresh), hi)
    return "symlog"


def whisker(length: np.ndarray) -> np.ndarray:
    """Error-bar lengths with the non-finite ones left out (0)."""
    return np.where(np.isfinite(length), length, 0.0)


def note(ax, text: str) -> None:
    """Centered grey message inside an axes (e.g. a metric that was not logged)."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4", fontsize=9, wrap=True)


def zero_only(ax, values) -> bool:
    """If every finite value is exactly 0, say so and give the axis a readable range; returns True then."""
    v = np.asarray(values, dtype=float)
    fin = v[np.isfinite(v)]
    if fin.size == 0 or (fin != 0).any():
        return False
    ax.set_ylim(-1.0, 1.0)
    ax.set_yticks([0.0])
    ax.text(0.5, 0.75, "all logged values are exactly 0", ha="center", va="center", transform=ax.transAxes,
            color="0.4", fontsize=9)
    return True


def bars(ax, labels: list[str], values: np.ndarray, color: str, *, ylabel: str = "", title: str = "",
         value_labels: bool = True, nan_text: str = "missing") -> None:
    """Bar chart with value labels; nan values are marked `nan_text` (not logged, unless told otherwise),
    infinite ones 'inf'."""
    x = np.arange(len(labels))
    finite = np.isfinite(values)
    ax.set_title(title, fontsize=10)
    ax.set_xticks(x, labels)
    ax.set_xlim(-0.6, len(labels) - 0.4)
    ax.set_ylabel(ylabel)
    if not finite.any():
        all_nan = "not logged in this run" if nan_text == "missing" else f"{nan_text} in every bucket"
        note(ax, all_nan if np.isnan(values).all() else "non-finite values only")
        ax.set_yticks([])
    else:
        heights = np.where(finite, values, 0.0)
        container = ax.bar(x, heights, color=color, alpha=0.85)
        ax.axhline(0.0, color="0.3", lw=0.6)
        if not zero_only(ax, values):
            if value_labels:
                ax.bar_label(container, labels=[fmt(v) if f else "" for v, f in zip(values, finite, strict=True)],
                             fontsize=7)
            auto_scale(ax, values[finite])
            ax.margins(y=0.15)
    for xi, v, f in zip(x, values, finite, strict=True):
        if not f and finite.any():
            ax.text(xi, 0.02, nan_text if np.isnan(v) else fmt(v), rotation=90, ha="center", va="bottom",
                    fontsize=7, color="#b00", transform=ax.get_xaxis_transform())


# ---------------------------------------------------------------- one analysis step


@dataclass
class StepData:
    """Everything the per-step figures need: the metrics row, its buckets and the per-group RVs."""

    run_name: str
    step: int
    row: dict[str, Any]
    buckets: list[str]
    groups: dict[str, list[float]]
    mode: str = "quantile"

    @property
    def labels(self) -> list[str]:
        """Axis labels of the buckets: `Q<k>` for quantile buckets, the interval for fixed_rv buckets."""
        return [bucket_label(b, self.mode) for b in self.buckets]

    def values(self, metric: str) -> np.ndarray:
        return bucket_values(self.row, self.buckets, metric)

    def has(self, metric: str) -> bool:
        return bool(np.isfinite(self.values(metric)).any() or np.isinf(self.values(metric)).any())


def step_data(run: RunData, step: int) -> StepData:
    """Collect the data of one analysis step of `run`."""
    row = run.row(step)
    return StepData(run_name=run.name, step=step, row=row, buckets=bucket_names(row),
                    groups=read_groups(run.path, step), mode=run.bucket_mode)


def fig_grad_norms(sd: StepData) -> Figure:
    """1×3 bars of the coefficient-weighted KL, entropy and task gradient norms per bucket (+ raw row if logged),
    with a text block of each bucket's RV mean/min/max and sizes."""
    raw = [c for c in ("kl", "entropy") if sd.has(f"raw/{c}")]
    rows = 3 if raw or sd.has("reg_share") else 2
    fig = new_figure(15, 4.2 * (rows - 1) + 1.6, )
    gs = fig.add_gridspec(rows, 3, height_ratios=[4] * (rows - 1) + [0.3 + 0.22 * len(sd.buckets)])
    for j, comp in enumerate(("kl", "entropy", "task")):
        bars(fig.add_subplot(gs[0, j]), sd.labels, sd.values(comp), COLORS[comp], ylabel="Grad Norm Magnitude",
             title=f"{comp} gradient norm" + (" (× coefficient)" if comp != "task" else ""))
    if rows == 3:
        for j, comp in enumerate(("kl", "entropy")):
            bars(fig.add_subplot(gs[1, j]), sd.labels, sd.values(f"raw/{comp}"), COLORS[comp],
                 ylabel="Grad Norm Magnitude", title=f"raw {comp} gradient norm (unweighted)")
        bars(fig.add_subplot(gs[1, 2]), sd.labels, sd.values("reg_share"), COLORS["regularizer"],
             ylabel="share", title="regulariser share  reg / (task + reg)",
             nan_text="undef. (0/0)" if any(f"grad_norm/{b}/reg_share" in sd.row for b in sd.buckets) else "missing")
    for ax in fig.axes:
        ax.set_xlabel("Reward Variance Bucket")
    text_ax = fig.add_subplot(gs[rows - 1, :])
    text_ax.axis("off")
    text_ax.text(0.0, 1.0, _rv_block(sd), family="monospace", fontsize=8, va="top", transform=text_ax.transAxes)
    fig.suptitle(f"{sd.run_name} — step {sd.step}: gradient norms per reward-variance bucket")
    return fig


def _rv_block(sd: StepData) -> str:
    lines = []
    mean, lo, hi = sd.values("reward_std_mean"), sd.values("reward_std_min"), sd.values("reward_std_max")
    count, groups = sd.values("sample_count"), sd.values("group_rv_count")
    for i, label in enumerate(sd.labels):
        lines.append(f"{label:>4}: RV mean {fmt(mean[i]):>8}  min {fmt(lo[i]):>8}  max {fmt(hi[i]):>8}   "
                     f"groups {fmt(groups[i]):>5}  samples {fmt(count[i]):>6}")
    return "\n".join(lines) if lines else "no buckets logged"


def fig_losses(sd: StepData) -> Figure:
    """2×2 bars of the (coefficient-weighted) loss values per bucket: policy, entropy, kl, total."""
    fig = new_figure(11, 7.5)
    panels = [("policy", COLORS["task"]), ("entropy", COLORS["entropy"]), ("kl", COLORS["kl"]), ("total", "#444444")]
    for ax, (name, color) in zip(fig.subplots(2, 2).ravel(), panels, strict=True):
        bars(ax, sd.labels, sd.values(f"loss/{name}"), color, ylabel="Loss", title=f"loss/{name}")
        ax.set_xlabel("Reward Variance Bucket")
    fig.suptitle(f"{sd.run_name} — step {sd.step}: losses per bucket")
    return fig


def fig_reward_std(sd: StepData) -> Figure:
    """Bucket RV mean with min–max bars and the number of groups per bucket."""
    fig = new_figure(8, 4.5)
    ax = fig.add_subplot()
    mean, lo, hi = sd.values("reward_std_mean"), sd.values("reward_std_min"), sd.values("reward_std_max")
    bars(ax, sd.labels, mean, COLORS["rv"], ylabel="reward std (RV)", title="bucket reward-std mean (bars: min–max)",
         value_labels=False)
    ok = np.isfinite(mean) & np.isfinite(lo) & np.isfinite(hi)
    if ok.any():
        x = np.arange(len(mean))[ok]
        ax.errorbar(x, mean[ok], yerr=[mean[ok] - lo[ok], hi[ok] - mean[ok]], fmt="none", ecolor="k", capsize=4)
    spread = np.concatenate([mean, lo, hi])
    if np.isfinite(spread).any() and (spread[np.isfinite(spread)] != 0).any():  # scale from the whiskers too
        ax.set_yscale("linear")
        auto_scale(ax, spread)
    for i in np.flatnonzero(np.isfinite(mean)):
        top = max(mean[i], hi[i]) if np.isfinite(hi[i]) else mean[i]
        ax.annotate(f"mean {fmt(mean[i])}", (i, top), textcoords="offset points", xytext=(0, 3), ha="center",
                    fontsize=7)
    ax.margins(y=0.12)
    ax.set_xlabel("Reward Variance Bucket")
    fig.suptitle(f"{sd.run_name} — step {sd.step}: reward variance per bucket")
    return fig


def fig_normed_grads(sd: StepData) -> Figure:
    """1×3 grouped bars per component: per-sample vs per-token gradient norm."""
    fig = new_figure(15, 4.5)
    x = np.arange(len(sd.buckets))
    for ax, comp in zip(fig.subplots(1, 3), COMPONENTS, strict=True):
        ps, pt = sd.values(f"per_sample/{comp}"), sd.values(f"per_token/{comp}")
        ax.set_title(f"{comp}: per-sample vs per-token norm", fontsize=10)
        ax.set_xticks(x, sd.labels)
        ax.set_xlim(-0.6, len(x) - 0.4)
        ax.set_xlabel("Reward Variance Bucket")
        if not (np.isfinite(ps).any() or np.isfinite(pt).any()):
            note(ax, "not logged in this run")
            ax.set_yticks([])
            continue
        both = np.concatenate([ps, pt])
        zeros = zero_only(ax, both)
        for off, vals, alpha in ((-0.2, ps, 0.9), (0.2, pt, 0.5)):
            fin = np.isfinite(vals)
            c = ax.bar(x + off, np.where(fin, vals, 0.0), 0.4, color=COLORS[comp], alpha=alpha,
                       hatch="" if off < 0 else "//")
            if not zeros:
                ax.bar_label(c, labels=[fmt(v) if f else "n/a" for v, f in zip(vals, fin, strict=True)], fontsize=6,
                             rotation=90, padding=2)
        if not zeros:
            auto_scale(ax, both)
            ax.margins(y=0.3)
    fig.axes[0].set_ylabel("Grad Norm Magnitude")
    fig.legend([Patch(facecolor="0.35"), Patch(facecolor="0.75", hatch="//")],
               ["per sample (norm / samples)", "per token (norm / response tokens)"], loc="outside lower center",
               ncols=2, fontsize=8)
    fig.suptitle(f"{sd.run_name} — step {sd.step}: normalised gradient norms")
    return fig


def fig_summary(sd: StepData) -> Figure:
    """1×3: per-group RV box plot per bucket; task grad norm vs bucket RV mean; regulariser norm vs RV mean."""
    fig = new_figure(16, 4.8)
    ax_rv, ax_task, ax_reg = fig.subplots(1, 3)
    _rv_panel(ax_rv, sd)
    rv = sd.values("reward_std_mean")
    ax_task.set_title("task gradient norm vs bucket RV", fontsize=10)
    _vs_rv(ax_task, rv, {"task": sd.values("task")}, sd.labels, "task gradient norm")
    reg = {"entropy + KL": regularizer_values(sd.row, sd.buckets)}
    for comp in ("entropy", "kl"):
        if sd.has(comp):
            reg[comp] = sd.values(comp)
    ax_reg.set_title("regulariser (entropy + KL) gradient norm vs bucket RV", fontsize=10)
    _vs_rv(ax_reg, rv, reg, sd.labels, "gradient norm (× coefficient)")
    fig.suptitle(f"{sd.run_name} — step {sd.step}: summary")
    return fig


def _rv_panel(ax, sd: StepData) -> None:
    """Box plot of the per-group RVs of each bucket (falls back to mean with min–max bars where no groups)."""
    ax.set_title("per-group reward std per bucket", fontsize=10)
    x = np.arange(len(sd.buckets))
    ax.set_xticks(x, sd.labels)
    ax.set_xlabel("Reward Variance Bucket")
    ax.set_ylabel("group reward std (RV)")
    data = [np.asarray([v for v in sd.groups.get(b, []) if np.isfinite(v)]) for b in sd.buckets]
    have = [i for i, d in enumerate(data) if d.size]
    if have:
        ax.boxplot([data[i] for i in have], positions=x[have], widths=0.5, showmeans=True,
                   meanprops={"marker": "D", "markerfacecolor": "w", "markeredgecolor": "k", "markersize": 4})
        for i in have:
            ax.scatter(np.full(data[i].size, x[i]) + np.linspace(-0.12, 0.12, data[i].size), data[i], s=6,
                       color=COLORS["rv"], alpha=0.6, zorder=3)
    mean, lo, hi = sd.values("reward_std_mean"), sd.values("reward_std_min"), sd.values("reward_std_max")
    rest = [i for i in range(len(sd.buckets)) if i not in have and np.isfinite(mean[i])]
    if rest:
        err = [whisker(mean[rest] - lo[rest]), whisker(hi[rest] - mean[rest])]
        ax.errorbar(x[rest], mean[rest], yerr=err, fmt="o", color="k", capsize=4,
                    label="mean (min–max); no groups.csv rows")
        ax.legend(fontsize=7)
    ax.set_xticks(x, sd.labels)
    allv = np.concatenate([*(data[i] for i in have), mean[rest], lo[rest], hi[rest]]) if have or rest else np.zeros(0)
    if allv.size == 0:
        note(ax, "no per-group or per-bucket reward stds logged")
        return
    auto_scale(ax, allv)


def _vs_rv(ax, rv: np.ndarray, series: dict[str, np.ndarray], labels: list[str], ylabel: str, *,
           x_values: np.ndarray | None = None, prefer_log: bool = False) -> None:
    """Each series vs the bucket RV mean; points labelled Q1…; missing points listed in a note.

    The x scale is chosen from `x_values` (default: `rv`), so several rows can share one scale.
    """
    ax.set_xlabel("bucket RV mean")
    ax.set_ylabel(ylabel)
    plotted = []
    styles = ["-o", "--s", ":^", "-.v"]
    for (name, y), style in zip(series.items(), styles, strict=False):
        ok = np.isfinite(rv) & np.isfinite(y)
        if not ok.any():
            continue
        combined = name.startswith("entropy +")
        color = COLORS["regularizer"] if combined else COLORS.get(name)
        ax.plot(rv[ok], y[ok], style, color=color, label=name, ms=7 if combined else 5, lw=3 if combined else 1.3,
                alpha=0.55 if combined and len(series) > 1 else 1.0, zorder=2 if combined else 3)
        plotted.append(y[ok])
        if len(plotted) == 1:  # label the points of the first series; alternate above/below against overlaps
            order = np.argsort(rv[ok], kind="stable")
            for rank, i in enumerate(order):
                ax.annotate(np.asarray(labels)[ok][i], (rv[ok][i], y[ok][i]), textcoords="offset points",
                            xytext=(4, 5 if rank % 2 == 0 else -11), fontsize=7)
    if not plotted:
        note(ax, "not logged")
        return
    auto_scale(ax, rv if x_values is None else x_values, axis="x", prefer_log=prefer_log)
    auto_scale(ax, np.concatenate(plotted))
    ax.margins(0.08)
    first = next(iter(series.values()))
    missing = [f"{lab} ({'RV ' if not np.isfinite(r) else ''}{fmt(r if not np.isfinite(r) else y)})"
               for lab, r, y in zip(labels, rv, first, strict=True) if not (np.isfinite(r) and np.isfinite(y))]
    if missing:
        ax.text(0.01, 0.01, "not plotted: " + ", ".join(missing), transform=ax.transAxes, fontsize=7, color="#b00")
    if len(series) > 1:
        ax.legend(fontsize=7)


STEP_FIGURES = {
    "summary": fig_summary,
    "plots": fig_grad_norms,
    "loss_plots": fig_losses,
    "reward_std": fig_reward_std,
    "normed_grads": fig_normed_grads,
}


def bucket_rv_rows(run: RunData, step: int) -> list[tuple[str, float]]:
    """(bucket, reward_std) per group per bucket of `step` from groups.csv (prefix grad_norm only)."""
    return [(b, v) for b, values in read_groups(run.path, step).items() for v in values]


def write_step(run: RunData, step: int, out: str | Path, dpi: int = DPI) -> list[Path]:
    """Write the five figures, the metrics JSON and the bucket RV CSV of one analysis step; returns the paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sd = step_data(run, step)
    paths = []
    for name, make in STEP_FIGURES.items():
        paths.append(save_png(make(sd), out / f"gradient_analysis_{name}_step_{step}.png", dpi))
    metrics_file = out / f"gradient_analysis_metrics_step_{step}.json"
    metrics_file.write_text(json.dumps(sd.row, sort_keys=True, indent=2))
    table = out / f"gradient_analysis_bucket_rv_table_step_{step}.csv"
    with open(table, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["bucket", "reward_std"])
        writer.writerows(bucket_rv_rows(run, step))
    return [*paths, metrics_file, table]


# ---------------------------------------------------------------- paper grid (several steps, maybe several runs)


def find_step(runs: list[RunData], step: int) -> RunData:
    """The first run in which `step` is an analysis step (ValueError listing what is available otherwise)."""
    for run in runs:
        if step in analysis_steps(run):
            return run
    avail = "; ".join(f"{r.name}: {analysis_steps(r) or 'none'}" for r in runs)
    raise ValueError(f"step {step} is not a gradient-analysis step of the given run(s) (available: {avail})")


def fig_paper_grid(runs: list[RunData], steps: list[int]) -> Figure:
    """Rows = steps; columns: bucket RV mean (min–max bars); task grad norm vs RV mean; entropy+KL vs RV mean."""
    data = [step_data(find_step(runs, s), s) for s in steps]
    fig = new_figure(14, 3.4 * len(data) + 0.6)
    axes = np.atleast_2d(fig.subplots(len(data), 3, squeeze=False))
    all_rv = np.concatenate([sd.values("reward_std_mean") for sd in data]) if data else np.zeros(0)
    several = len({sd.run_name for sd in data}) > 1
    for r, sd in enumerate(data):
        a, b, c = axes[r]
        rv, lo, hi = sd.values("reward_std_mean"), sd.values("reward_std_min"), sd.values("reward_std_max")
        x = np.arange(len(sd.buckets))
        ok = np.isfinite(rv)
        a.errorbar(x[ok], rv[ok], yerr=[whisker(rv[ok] - lo[ok]), whisker(hi[ok] - rv[ok])], fmt="o",
                   color="k", capsize=3)
        a.set_xticks(x, sd.labels)
        auto_scale(a, np.concatenate([rv, lo, hi]), prefer_log=True)
        a.set_ylabel(f"step {sd.step}" + (f"\n({sd.run_name})" if several else "") + "\nbucket RV", fontsize=9)
        # one x scale per column, chosen from every row's RVs so the rows line up (zeros kept via symlog)
        _vs_rv(b, rv, {"task": sd.values("task")}, sd.labels, "task grad norm", x_values=all_rv, prefer_log=True)
        _vs_rv(c, rv, {"entropy + KL": regularizer_values(sd.row, sd.buckets)}, sd.labels, "entropy+KL grad norm",
               x_values=all_rv, prefer_log=True)
    for col in (1, 2):
        drawn = [ax for ax in axes[:, col] if ax.lines]
        if drawn:
            lo_x = min(ax.get_xlim()[0] for ax in drawn)
            hi_x = max(ax.get_xlim()[1] for ax in drawn)
            for ax in drawn:
                ax.set_xlim(lo_x, hi_x)
    axes[-1, 0].set_xlabel(_bucket_axis_caption(data))
    for ax in axes[-1, 1:]:
        ax.set_xlabel(f"bucket RV mean ({ax.get_xscale()} scale)")
    for r in range(len(data) - 1):
        for ax in axes[r, 1:]:
            ax.set_xlabel("")
    axes[0, 0].set_title("(a) reward variance per bucket", fontsize=10)
    axes[0, 1].set_title("(b) task gradient vs RV", fontsize=10)
    axes[0, 2].set_title("(c) regulariser gradient vs RV", fontsize=10)
    return fig


def _bucket_axis_caption(data: list[StepData]) -> str:
    """RAGEN's caption for quantile buckets; fixed_rv buckets are named by their reward-std interval."""
    if data and all(sd.mode == "fixed_rv" for sd in data):
        return "fixed reward-std intervals (empty intervals left out)"
    return f"RV quantile buckets (Q1 → Q{max((len(sd.buckets) for sd in data), default=0)})"


def write_paper_grid(runs: list[RunData], steps: list[int], out: str | Path, dpi: int = DPI) -> Path:
    """Write `paper_grid.png` into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return save_png(fig_paper_grid(runs, steps), out / "paper_grid.png", dpi)
