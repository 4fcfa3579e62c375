"""Per-step gradient-analysis figures (RAGEN's `plot_gradient_analysis.py` panels) and the multi-step paper grid.

Differences from RAGEN (``docs/reference/ragen_behaviour.md`` §9, §11.18), on purpose:
- Axes never clip data: no fixed y-limits; a value axis switches to log (all positive) or symlog (zeros or
  negatives present) only when the values span more than ~1.5 decades, so zero-RV buckets stay visible.
- A metric that was not logged is drawn as "missing", never as a zero bar.
- The summary's left panel is a box plot of the per-group reward stds read from ``analysis/step_<N>/groups.csv``.
- The unweighted regulariser norms (``raw/entropy``, ``raw/kl``) get their own row when logged, so a
  coefficient of 0 does not hide the regulariser's gradient.
- Norm-vs-RV panels: bucket points are markers with 95 % bootstrap error bars (``.../ci_low``, ``.../ci_high``,
  when logged), never joined by lines (buckets are not a series); RV is on a log axis and zero-RV buckets are
  drawn apart, left of a dotted divider (a log axis has no 0); the task and regulariser panels both start at 0.
- ``reg_share`` is drawn as points on a log axis (shares of 0.001 and 1.0 both readable, ties visible).
- ``groups`` (with ``analysis.per_group``): per-group norms against the group's RV on log-log axes with the fitted
  slope, the direct test of RAGEN-2's √RV bound (slope ≤ 0.5 expected for the task norm, 0 for the regulariser).
- The paper grid overlays several runs: one colour per run, one row per step, every run that has the step drawn.
Figures are built with the object-oriented API on an Agg canvas (no pyplot state, no backend switching).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from rldynamics import metric_names as naming
from rldynamics.plots.data import (
    COMPONENTS,
    RunData,
    analysis_steps,
    bucket_intervals,
    bucket_label,
    bucket_names,
    bucket_sort_key,
    bucket_values,
    is_zero_rv,
    off_terms,
    read_group_norms,
    read_groups,
    regularizer_values,
)
from rldynamics.plots.figure import (
    DPI,
    RUN_COLORS,
    RUN_MARKERS,
    auto_scale,
    fmt,
    new_figure,
    note,
    readable_log_ticks,
    save_png,
)
from rldynamics.tracking.files import replacing, write_file

COLORS = {"task": "#1f77b4", "entropy": "#2ca02c", "kl": "#d62728", "regularizer": "#9467bd", "rv": "#7f7f7f"}


# ---------------------------------------------------------------- bar and point panels (figure helpers: figure.py)


def whisker(length: np.ndarray) -> np.ndarray:
    """Error-bar lengths with the non-finite ones left out (0)."""
    return np.where(np.isfinite(length), length, 0.0)


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
         value_labels: bool = True, nan_text: str = "missing",
         ci: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """Bar chart with value labels and, given `ci` (low, high), 95 % error bars; nan values are marked `nan_text`
    (not logged, unless told otherwise), infinite ones 'inf'."""
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
        _error_bars(ax, x, values, ci)
        if not zero_only(ax, values):
            if value_labels:
                ax.bar_label(container, labels=[fmt(v) if f else "" for v, f in zip(values, finite, strict=True)],
                             fontsize=7, padding=2)
            auto_scale(ax, values[finite])  # from the bars alone: a whisker reaching 0 must not turn bars log
            ax.margins(y=0.15)
    for xi, v, f in zip(x, values, finite, strict=True):
        if not f and finite.any():
            ax.text(xi, 0.02, nan_text if np.isnan(v) else fmt(v), rotation=90, ha="center", va="bottom",
                    fontsize=7, color="#b00", transform=ax.get_xaxis_transform())


def _error_bars(ax, x: np.ndarray, values: np.ndarray, ci: tuple[np.ndarray, np.ndarray] | None,
                color: str = "k") -> np.ndarray:
    """Draw 95 % interval whiskers where `ci` is finite; returns the whisker ends (for axis scaling)."""
    if ci is None:
        return np.zeros(0)
    low, high = ci
    ok = np.isfinite(values) & np.isfinite(low) & np.isfinite(high)
    if ok.any():
        err = np.vstack([values[ok] - low[ok], high[ok] - values[ok]])  # [2, n]
        ax.errorbar(x[ok], values[ok], yerr=err, fmt="none", ecolor=color,
                    elinewidth=1.0, capsize=3, zorder=4)
    return np.concatenate([low[ok], high[ok]])


def share_points(ax, labels: list[str], values: np.ndarray, ci: tuple[np.ndarray, np.ndarray] | None,
                 color: str) -> None:
    """`reg_share` per bucket as points on a log axis (0.001 and 1.0 both readable); 0 and 0/0 marked in text."""
    x = np.arange(len(labels))
    ax.set_xticks(x, labels)
    ax.set_xlim(-0.6, len(labels) - 0.4)
    pos = np.isfinite(values) & (values > 0)
    if not pos.any():
        note(ax, "no positive shares logged")
        return
    ax.set_yscale("log")
    ax.plot(x[pos], values[pos], "o", color=color, ms=6, zorder=3)
    if ci is not None:
        low = np.where(ci[0] > 0, ci[0], values * 0.5)  # a whisker to 0 cannot be drawn on a log axis
        _error_bars(ax, x[pos], values[pos], (low[pos], ci[1][pos]), color)
    for xi, v in zip(x[pos], values[pos], strict=True):
        ax.annotate(fmt(v), (xi, v), textcoords="offset points", xytext=(6, 0), fontsize=7, va="center")
    ax.set_ylim(min(values[pos].min(), np.nanmin(ci[0][pos]) if ci is not None else 1.0, 1.0) / 3, 1.6)
    readable_log_ticks(ax.yaxis)
    ax.axhline(1.0, color="0.6", lw=0.6, ls=":")
    for xi, v in zip(x, values, strict=True):
        if not (np.isfinite(v) and v > 0):
            ax.text(xi, 0.03, "0" if v == 0 else "undef. (0/0)" if np.isnan(v) else fmt(v), ha="center",
                    va="bottom", fontsize=7, color="#b00", transform=ax.get_xaxis_transform())


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
    zero_bucket: bool = False
    path: Path | None = None
    off: dict[str, str] = field(default_factory=dict)  # loss terms the run switched off (`data.off_terms`)

    @property
    def labels(self) -> list[str]:
        """Axis labels of the buckets: `RV=0`, `Q<k>` for quantile buckets, the interval for fixed_rv buckets."""
        return [bucket_label(b, self.mode, self.zero_bucket) for b in self.buckets]

    @property
    def zero_rv(self) -> np.ndarray:
        """`[B]` bool: buckets of zero-variance groups only."""
        return is_zero_rv(self.row, self.buckets)

    def values(self, metric: str) -> np.ndarray:
        return bucket_values(self.row, self.buckets, metric)

    def ci(self, metric: str) -> tuple[np.ndarray, np.ndarray] | None:
        """The 95 % bootstrap interval arrays of `metric` (None when not logged)."""
        return bucket_intervals(self.row, self.buckets, metric)

    def has(self, metric: str) -> bool:
        return bool(np.isfinite(self.values(metric)).any() or np.isinf(self.values(metric)).any())


def step_data(run: RunData, step: int) -> StepData:
    """Collect the data of one analysis step of `run`."""
    row = run.row(step)
    return StepData(run_name=run.name, step=step, row=row, buckets=bucket_names(row),
                    groups=read_groups(run.path, step), mode=run.bucket_mode, zero_bucket=run.zero_bucket,
                    path=run.path, off=off_terms(run.config))


def term_off(ax, term: str, setting: str, more: str = "") -> None:
    """A panel of a switched-off term: says so instead of drawing bars that are 0 by construction."""
    ax.set_title(f"{term}: off", fontsize=10)
    ax.set_xticks([])
    ax.set_yticks([])
    note(ax, f"{term} is off ({setting}): not in the loss{more}")


def fig_grad_norms(sd: StepData) -> Figure:
    """1×3 bars of the coefficient-weighted KL, entropy and task gradient norms per bucket (+ raw row if logged),
    with a text block of each bucket's RV mean/min/max and sizes."""
    raw = [c for c in ("kl", "entropy") if sd.has(f"raw/{c}")]
    rows = 3 if raw or sd.has("reg_share") else 2
    fig = new_figure(15, 4.2 * (rows - 1) + 1.6, )
    gs = fig.add_gridspec(rows, 3, height_ratios=[4] * (rows - 1) + [0.3 + 0.22 * len(sd.buckets)])
    for j, comp in enumerate(("kl", "entropy", "task")):
        if comp in sd.off:
            term_off(fig.add_subplot(gs[0, j]), comp, sd.off[comp],
                     "; its unweighted gradient is drawn below" if comp in raw else "")
            continue
        bars(fig.add_subplot(gs[0, j]), sd.labels, sd.values(comp), COLORS[comp], ylabel="Grad Norm Magnitude",
             title=f"{comp} gradient norm" + (" (× coefficient)" if comp != "task" else ""), ci=sd.ci(comp))
    if rows == 3:
        for j, comp in enumerate(("kl", "entropy")):
            bars(fig.add_subplot(gs[1, j]), sd.labels, sd.values(f"raw/{comp}"), COLORS[comp],
                 ylabel="Grad Norm Magnitude", title=f"raw {comp} gradient norm (unweighted)", ci=sd.ci(f"raw/{comp}"))
        ax = fig.add_subplot(gs[1, 2])
        ax.set_title("regulariser share  reg / (task + reg)  (log scale)", fontsize=10)
        ax.set_ylabel("share")
        share_points(ax, sd.labels, sd.values("reg_share"), sd.ci("reg_share"), COLORS["regularizer"])
    for ax in fig.axes:
        if ax.get_xticks().size:
            ax.set_xlabel("Reward Variance Bucket")
    if sd.ci("task") is not None:
        fig.text(0.99, 0.005, "whiskers: 95 % bootstrap intervals over groups", ha="right", fontsize=7, color="0.3")
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
        if name in sd.off:
            term_off(ax, name, sd.off[name])
            continue
        bars(ax, sd.labels, sd.values(naming.loss(name)), color, ylabel="Loss", title=naming.loss(name))
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
        err = np.vstack([mean[ok] - lo[ok], hi[ok] - mean[ok]])  # [2, n]
        ax.errorbar(x, mean[ok], yerr=err, fmt="none", ecolor="k", capsize=4)
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
        if comp in sd.off:
            term_off(ax, comp, sd.off[comp])
            continue
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
    ax_task.set_title("task gradient norm vs bucket RV", fontsize=10)
    _vs_rv(ax_task, sd, {"task": "task"}, "task gradient norm")
    reg = {"entropy + KL": "regularizer"}
    reg.update({comp: comp for comp in ("entropy", "kl") if sd.has(comp) and comp not in sd.off})
    if {"entropy", "kl"} <= sd.off.keys():
        term_off(ax_reg, "the regulariser", f"{sd.off['entropy']}, {sd.off['kl']}")
    else:
        ax_reg.set_title("regulariser (entropy + KL) gradient norm vs bucket RV", fontsize=10)
        _vs_rv(ax_reg, sd, reg, "gradient norm (× coefficient)")
    fig.suptitle(f"{sd.run_name} — step {sd.step}: summary" +
                 ("  (whiskers: 95 % bootstrap intervals over groups)" if sd.ci("task") is not None else ""))
    return fig


def _rv_panel(ax, sd: StepData) -> None:
    """Box plot of the per-group RVs of each bucket (a bucket of one group: an open point, named in the legend;
    falls back to mean with min–max bars where no groups)."""
    ax.set_title("per-group reward std per bucket", fontsize=10)
    x = np.arange(len(sd.buckets))
    ax.set_xticks(x, sd.labels)
    ax.set_xlabel("Reward Variance Bucket")
    ax.set_ylabel("group reward std (RV)")
    data = [np.asarray([v for v in sd.groups.get(b, []) if np.isfinite(v)]) for b in sd.buckets]
    have = [i for i, d in enumerate(data) if d.size]
    spread = [i for i in have if data[i].size > 1]  # one group has no spread: a point, not a box
    if spread:
        ax.boxplot([data[i] for i in spread], positions=x[spread], widths=0.5, showmeans=True,
                   meanprops={"marker": "D", "markerfacecolor": "w", "markeredgecolor": "k", "markersize": 4})
    single = [i for i in have if data[i].size == 1]
    if single:
        ax.plot(x[single], [data[i][0] for i in single], "o", ls="none", mfc="none", mec="k", ms=6,
                label="a single group (no spread)")
        ax.legend(fontsize=7)
    for i in spread:
        ax.scatter(np.full(data[i].size, x[i]) + np.linspace(-0.12, 0.12, data[i].size), data[i], s=6,
                   color=COLORS["rv"], alpha=0.6, zorder=3)
    mean, lo, hi = sd.values("reward_std_mean"), sd.values("reward_std_min"), sd.values("reward_std_max")
    rest = [i for i in range(len(sd.buckets)) if i not in have and np.isfinite(mean[i])]
    if rest:
        err = np.vstack([whisker(mean[rest] - lo[rest]), whisker(hi[rest] - mean[rest])])  # [2, n]
        ax.errorbar(x[rest], mean[rest], yerr=err, fmt="o", color="k", capsize=4,
                    label="mean (min–max); no groups.csv rows")
        ax.legend(fontsize=7)
    ax.set_xticks(x, sd.labels)
    allv = np.concatenate([*(data[i] for i in have), mean[rest], lo[rest], hi[rest]]) if have or rest else np.zeros(0)
    if allv.size == 0:
        note(ax, "no per-group or per-bucket reward stds logged")
        return
    auto_scale(ax, allv)


def _vs_rv(ax, sd: StepData, series: dict[str, str], ylabel: str, *, x_values: np.ndarray | None = None,
           color: str | None = None, marker: str | None = None, label_points: bool = True,
           legend: bool = True, dodge: float = 0.0) -> bool:
    """Each metric of `series` (legend name -> bucket metric) against the bucket RV mean, as points with 95 %
    whiskers where logged; returns whether anything was drawn.

    Buckets are not a series, so points are never joined. RV is on a log axis (`x_values`, default the step's RVs,
    sets its range, so rows of a grid line up) and zero-RV buckets sit apart, left of a dotted divider. The norm
    axis is linear from 0 in every panel, so a ratio between two points reads as that ratio. Several series (and
    runs overlaid with `dodge`, a fraction of the axis width) sit slightly apart on x, so their whiskers do not
    cover each other.
    """
    ax.set_xlabel("bucket RV mean (log scale" + ("; RV=0 apart)" if sd.zero_rv.any() else ")"))
    ax.set_ylabel(ylabel)
    rv, zero = sd.values("reward_std_mean"), sd.zero_rv
    x_base, x_zero = _rv_positions(ax, rv, zero, rv if x_values is None else x_values)
    span = float(np.log10(ax.get_xlim()[1] / ax.get_xlim()[0]))  # offsets are fractions of the axis width
    markers = ["o", "s", "^", "v"]
    drawn = []
    for k, ((name, metric), default_marker) in enumerate(zip(series.items(), markers, strict=False)):
        x = x_base * 10 ** ((dodge + 0.02 * (k - (len(series) - 1) / 2)) * span)
        y = regularizer_values(sd.row, sd.buckets) if metric == "regularizer" else sd.values(metric)
        ok = np.isfinite(x) & np.isfinite(y)
        if not ok.any():
            continue
        c = color or (COLORS["regularizer"] if metric == "regularizer" else COLORS.get(name, COLORS.get(metric)))
        ax.plot(x[ok], y[ok], marker or default_marker, ls="none", color=c, label=name,
                ms=7 if metric == "regularizer" else 5, alpha=0.85, zorder=3)
        whiskers = _error_bars(ax, x[ok], y[ok], _subset(sd.ci(metric), ok), c)
        drawn.append(np.concatenate([y[ok], whiskers]))
        if label_points and len(drawn) == 1:
            for rank, i in enumerate(np.flatnonzero(ok)):
                ax.annotate(sd.labels[i], (x[i], y[i]), textcoords="offset points",
                            xytext=(4, 5 if rank % 2 == 0 else -11), fontsize=7)
    if not drawn:
        note(ax, "not logged")
        return False
    top = max(float(np.max(np.concatenate(drawn))) * 1.15, ax.get_ylim()[1] if ax.get_ylim()[0] == 0.0 else 0.0)
    ax.set_ylim(0.0, max(top, 1e-12))
    if x_zero is not None:
        ax.axvline(x_zero * 2.0, color="0.5", lw=0.8, ls=":")
        ax.text(x_zero, 0.99, "RV=0", transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=7,
                color="0.3")
    missing = [lab for lab, r, z in zip(sd.labels, rv, zero, strict=True) if not (np.isfinite(r) or z)]
    if missing:
        ax.text(0.01, 0.01, "not plotted (no RV): " + ", ".join(missing), transform=ax.transAxes, fontsize=7,
                color="#b00")
    if legend and len(series) > 1:
        ax.legend(fontsize=7)
    return True


def _subset(ci: tuple[np.ndarray, np.ndarray] | None, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    return None if ci is None else (ci[0][ok], ci[1][ok])


def _rv_positions(ax, rv: np.ndarray, zero: np.ndarray, scale_from: np.ndarray) -> tuple[np.ndarray, float | None]:
    """x positions of the buckets on a log RV axis: positive RVs at their value, zero-RV buckets spread in a slot
    4× left of the smallest positive RV of `scale_from`; returns (positions, slot centre or None)."""
    scale = np.asarray(scale_from, dtype=float)
    positive = scale[np.isfinite(scale) & (scale > 0)]
    low, high = (float(positive.min()), float(positive.max())) if positive.size else (1.0, 1.0)
    x = np.where(zero | ~(rv > 0), np.nan, rv)
    ax.set_xscale("log")
    has_zero = bool(zero.any()) or bool(((scale == 0)).any())
    slot = low / 4.0 if has_zero else None
    if zero.any():
        x[zero] = slot * np.geomspace(0.8, 1.25, int(zero.sum())) if zero.sum() > 1 else slot
    ax.set_xlim((slot or low) / 2.0, high * 2.0)
    readable_log_ticks(ax.xaxis, slot)
    return x, slot


def fig_groups(sd: StepData) -> Figure | None:
    """Per-group task and regulariser norms vs the group's RV (log-log) with fitted slopes; None without
    per-group norms (`analysis.per_group`).

    The x axis is the group reward std σ (RAGEN's "RV"). RAGEN-2's Cauchy–Schwarz bound is ‖g‖ ≤ c·√Var = c·σ
    for advantages that scale with the rewards (Dr.GRPO, GAE): a slope of at most 1 against σ (0.5 against the
    variance); GRPO's std normalisation removes the scale (slope 0 expected)."""
    g = read_group_norms(sd.path, sd.step) if sd.path is not None else {}
    if not g:
        return None
    fig = new_figure(13, 5.2)
    label = {b: bucket_label(b, sd.mode, sd.zero_bucket) for b in dict.fromkeys(g["bucket"].tolist())}
    axes = fig.subplots(1, 2)
    for ax, (metric, name) in zip(axes, (("task", "task"), ("regularizer", "entropy + KL")), strict=True):
        if metric == "regularizer" and {"entropy", "kl"} <= sd.off.keys():
            term_off(ax, "the regulariser", f"{sd.off['entropy']}, {sd.off['kl']}")
            continue
        _group_scatter(ax, g, metric, name, label)
    handles: dict[str, object] = {}
    for ax in axes:
        for handle, text in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(text, handle)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncols=len(handles), fontsize=8)
    fig.suptitle(f"{sd.run_name} — step {sd.step}: per-group gradient norm vs group reward std σ\n"
                 "RAGEN-2: task ≤ c·σ (= c·√variance) for unnormalised advantages, slope ≤ 1 on this axis "
                 "(≤ 0.5 against the variance); regulariser independent of σ, slope 0", fontsize=10)
    return fig


def fit_slope(rv: np.ndarray, norm: np.ndarray) -> tuple[float, float, int]:
    """Least-squares slope of log(norm) on log(rv) over groups with both positive: (slope, its SE, groups)."""
    ok = np.isfinite(rv) & np.isfinite(norm) & (rv > 0) & (norm > 0)
    n = int(ok.sum())
    if n < 3 or np.ptp(np.log(rv[ok])) == 0:
        return math.nan, math.nan, n
    x, y = np.log(rv[ok]), np.log(norm[ok])
    coef, cov = np.polyfit(x, y, 1, cov=True)
    return float(coef[0]), float(math.sqrt(cov[0, 0])), n


def _group_scatter(ax, g: dict[str, np.ndarray], metric: str, name: str, label: dict[str, str]) -> None:
    """One per-group panel: positive-RV groups on log-log axes coloured by bucket (`label`: bucket -> legend text),
    the fit, zero-RV groups apart; the fit and the groups not drawn are stated in the panel title."""
    rv, y = g.get("reward_std"), g.get(metric)
    title = f"{name} gradient norm per group"
    if rv is None or y is None or not np.isfinite(y).any():
        ax.set_title(title, fontsize=10)
        note(ax, f"{metric} not logged per group")
        return
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("group reward std σ (log; RV=0 apart)")
    ax.set_ylabel(f"{name} grad norm (log)")
    pos_y = y[np.isfinite(y) & (y > 0)]
    if pos_y.size == 0:
        ax.set_title(title, fontsize=10)
        note(ax, "every group's norm is exactly 0")
        return
    positive_rv = rv[np.isfinite(rv) & (rv > 0)]
    slot = (positive_rv.min() if positive_rv.size else 1.0) / 4.0
    for k, b in enumerate(label):
        sel = (g["bucket"] == b) & np.isfinite(y) & (y > 0)
        x = np.where(rv[sel] > 0, rv[sel], slot)
        ax.scatter(x, y[sel], s=14, alpha=0.75, color=f"C{k % 10}", label=label[b])
    zero_norm = int((np.isfinite(y) & (y == 0)).sum())
    slope, se, n = fit_slope(rv, y)
    text = [f"fit over {n} groups with RV > 0: slope {fmt(slope)} ± {fmt(se)}"]
    if math.isfinite(slope):
        xs = np.geomspace(positive_rv.min(), positive_rv.max(), 20)
        ok = (rv > 0) & (y > 0) & np.isfinite(y)
        intercept = float(np.mean(np.log(y[ok]) - slope * np.log(rv[ok])))
        ax.plot(xs, np.exp(intercept) * xs ** slope, "k--", lw=1.0, label="least-squares fit")
    high = float(positive_rv.max()) if positive_rv.size else 1.0
    if (rv == 0).any():
        ax.axvline(slot * 2.0, color="0.5", lw=0.8, ls=":")
        ax.text(slot, 0.99, "RV=0", transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=7)
    ax.set_xlim(slot / 2.0 if (rv == 0).any() else slot * 2.0, high * 2.0)
    readable_log_ticks(ax.xaxis, slot if (rv == 0).any() else None)
    readable_log_ticks(ax.yaxis)
    if zero_norm:
        text.append(f"{zero_norm} group(s) with norm exactly 0 not drawn (log axis)")
    ax.set_title(title + "\n" + "; ".join(text), fontsize=9)


STEP_FIGURES = {
    "summary": fig_summary,
    "plots": fig_grad_norms,
    "loss_plots": fig_losses,
    "reward_std": fig_reward_std,
    "normed_grads": fig_normed_grads,
    "groups": fig_groups,
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
        fig = make(sd)
        if fig is not None:  # the per-group figure needs analysis.per_group
            paths.append(save_png(fig, out / f"gradient_analysis_{name}_step_{step}.png", dpi))
    metrics_file = write_file(out / f"gradient_analysis_metrics_step_{step}.json",
                              json.dumps(sd.row, sort_keys=True, indent=2))
    table = out / f"gradient_analysis_bucket_rv_table_step_{step}.csv"
    with replacing(table, "w") as f:
        writer = csv.writer(f)
        writer.writerow(["bucket", "reward_std"])
        writer.writerows(bucket_rv_rows(run, step))
    return [*paths, metrics_file, table]


# ---------------------------------------------------------------- paper grid (several steps, maybe several runs)


def runs_at_step(runs: list[RunData], step: int) -> list[int]:
    """Indices of the runs in which `step` is an analysis step (ValueError listing what is available if none)."""
    found = [i for i, run in enumerate(runs) if step in analysis_steps(run)]
    if not found:
        avail = "; ".join(f"{r.name}: {analysis_steps(r) or 'none'}" for r in runs)
        raise ValueError(f"step {step} is not a gradient-analysis step of the given run(s) (available: {avail})")
    return found


def fig_paper_grid(runs: list[RunData], steps: list[int]) -> Figure:
    """Rows = steps; columns: bucket RV (mean, min–max); task grad norm vs RV; entropy+KL vs RV. Every run that
    analysed a step is drawn in that row in its own colour (overlaid, same axes), with 95 % whiskers if logged."""
    rows = [(step, [(i, step_data(runs[i], step)) for i in runs_at_step(runs, step)]) for step in steps]
    several = len(runs) > 1
    fig = new_figure(14, 3.4 * len(rows) + (1.0 if several else 0.6))
    axes = np.atleast_2d(fig.subplots(len(rows), 3, squeeze=False))
    all_rv = np.concatenate([sd.values("reward_std_mean") for _, data in rows for _, sd in data])
    for r, (step, data) in enumerate(rows):
        a, b, c = axes[r]
        slots = sorted({name for _, sd in data for name in sd.buckets}, key=bucket_sort_key)
        for k, (i, sd) in enumerate(data):
            color = RUN_COLORS[i % len(RUN_COLORS)] if several else None
            marker = RUN_MARKERS[i % len(RUN_MARKERS)] if several else None
            _rv_ranges(a, sd, color or "k", offset=(k - (len(data) - 1) / 2) * 0.15, slots=slots)
            dodge = 0.02 * (k - (len(data) - 1) / 2)
            _vs_rv(b, sd, {"task": "task"}, "task grad norm", x_values=all_rv, color=color, marker=marker,
                   label_points=k == 0, legend=False, dodge=dodge)
            _vs_rv(c, sd, {"entropy + KL": "regularizer"}, "entropy+KL grad norm", x_values=all_rv, color=color,
                   marker=marker, label_points=k == 0, legend=False, dodge=dodge)
        a.set_xticks(np.arange(len(slots)), [bucket_label(b, data[0][1].mode, data[0][1].zero_bucket) for b in slots])
        absent = [runs[i].name for i in range(len(runs)) if i not in {i for i, _ in data}]
        a.set_ylabel(f"step {step}\nbucket RV", fontsize=9)
        if absent:
            a.text(0.01, 0.01, "not analysed at this step: " + ", ".join(absent), transform=a.transAxes, fontsize=7,
                   color="#b00")
    if several:
        handles = [Line2D([], [], marker=RUN_MARKERS[i % len(RUN_MARKERS)], ls="none",
                          color=RUN_COLORS[i % len(RUN_COLORS)]) for i in range(len(runs))]
        fig.legend(handles, [run.name for run in runs], loc="outside lower center", ncols=min(len(runs), 4),
                   fontsize=8)
    axes[-1, 0].set_xlabel(_bucket_axis_caption([sd for _, data in rows for _, sd in data]))
    for r in range(len(rows) - 1):
        for ax in axes[r, 1:]:
            ax.set_xlabel("")
    for col in (1, 2):  # one norm scale per column, so a change over the steps reads as that change
        top = max(ax.get_ylim()[1] for ax in axes[:, col])
        for ax in axes[:, col]:
            ax.set_ylim(0.0, top)
    fig.suptitle(f"{', '.join(run.name for run in runs)}: gradient analysis at steps {', '.join(map(str, steps))}"
                 + ("  (whiskers: 95 % bootstrap intervals over groups)" if any(
                     sd.ci("task") is not None for _, data in rows for _, sd in data) else ""), fontsize=11)
    axes[0, 0].set_title("(a) reward variance per bucket (mean, min–max)", fontsize=10)
    axes[0, 1].set_title("(b) task gradient vs RV", fontsize=10)
    axes[0, 2].set_title("(c) regulariser gradient vs RV", fontsize=10)
    return fig


def _rv_ranges(ax, sd: StepData, color: str, offset: float, slots: list[str]) -> None:
    """Bucket RV means with min–max bars at the x slot of each bucket name in `slots` (runs side by side via
    `offset`)."""
    rv, lo, hi = sd.values("reward_std_mean"), sd.values("reward_std_min"), sd.values("reward_std_max")
    x = np.array([slots.index(b) for b in sd.buckets], dtype=float) + offset
    ok = np.isfinite(rv)
    err = np.vstack([np.nan_to_num(rv[ok] - lo[ok]), np.nan_to_num(hi[ok] - rv[ok])])  # [2, n]
    ax.errorbar(x[ok], rv[ok], yerr=err, fmt="o",
                color=color, capsize=3, ms=4)
    ax.set_ylim(bottom=0.0)


def _bucket_axis_caption(data: list[StepData]) -> str:
    """RAGEN's caption for quantile buckets; fixed_rv buckets are named by their reward-std interval."""
    if data and all(sd.mode == "fixed_rv" for sd in data):
        return "fixed reward-std intervals (empty intervals left out)"
    top = max((sum(not label.startswith("RV=0") for label in sd.labels) for sd in data), default=0)
    return f"RV quantile buckets (Q1 → Q{top}" + (", RV=0 apart)" if any(sd.zero_rv.any() for sd in data) else ")")


def write_paper_grid(runs: list[RunData], steps: list[int], out: str | Path, dpi: int = DPI) -> Path:
    """Write `paper_grid.png` into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return save_png(fig_paper_grid(runs, steps), out / "paper_grid.png", dpi)
