"""Training curves and the across-step analysis views of a run directory.

- `training_curves.png`: one panel per metric family that was logged (reward, success, entropy, KL, grad norm,
  clip fraction, pg loss, filter kept ratio, in-group reward std, response length); non-finite values are
  marked on the axis instead of vanishing, early stops are drawn as a vertical line.
- `analysis_cosines.png` / `analysis_reg_share.png`: per-bucket component cosines and regulariser share
  over the analysis steps (no share figure when entropy and KL are both off: it is 0 by construction).
- `analysis_sketch_cosines_step_<N>.png`: bucket × bucket cosine of the task-gradient count-sketches.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from rldynamics import metric_names as names
from rldynamics.plots.data import (
    PREFIX,
    RunData,
    analysis_steps,
    as_float,
    bucket_label,
    bucket_names,
    bucket_sort_key,
    early_stops,
    env_names,
    has_key,
    norm_is_zero,
    off_terms,
    read_sketches,
    series,
)
from rldynamics.plots.figure import DPI, auto_scale, new_figure, note, readable_log_ticks, save_png

COSINES = ("task_entropy", "task_kl", "entropy_kl")


def curve_panels(run: RunData) -> list[tuple[str, list[tuple[str, str]]]]:
    """(panel title, [(metric key, legend label)]) for every panel whose metrics were logged."""
    envs = env_names(run)
    candidates: list[tuple[str, list[tuple[str, str]]]] = [
        (f"reward ({names.SCORE_MEAN})", [(names.SCORE_MEAN, "mean score")]),
        ("success rate", [(names.env_metric(e, names.SUCCESS, validation), f"{'val' if validation else 'train'} {e}")
                          for e in envs for validation in (False, True)]),
        (f"rollout-policy entropy ({names.ENTROPY})", [(names.ENTROPY, "entropy")]),
        (f"KL loss ({names.KL_LOSS})", [(names.KL_LOSS, "kl_loss")]),
        (f"grad norm ({names.ACTOR_GRAD_NORM}, pre-clip)", [(names.ACTOR_GRAD_NORM, "grad norm")]),
        (f"clip fraction ({names.PG_CLIPFRAC}; rule of thumb 10–40 %)", [(names.PG_CLIPFRAC, "pg_clipfrac")]),
        (f"policy loss ({names.PG_LOSS})", [(names.PG_LOSS, "pg_loss")]),
        ("filter kept ratio", [(names.FILTER_KEPT_RATIO, "kept ratio")]),
        ("in-group reward std", [(names.IN_GROUP_REWARD_STD, "mean group std")]),
        ("sampler/trainer mismatch (rollout/corr/k3_kl, kl)",
         [(names.rollout_corr("k3_kl"), "k3"), (names.rollout_corr("kl"), "k1")]),
        ("outside the mismatch band (rollout/corr/*_fraction_outside)",
         [(names.rollout_corr("token_fraction_outside"), "tokens"),
          (names.rollout_corr("seq_geo_fraction_outside"), "sequences (geometric mean)")]),
        ("response length", [(names.RESPONSE_LENGTH_MEAN, "tokens / response")]
         if has_key(run, names.RESPONSE_LENGTH_MEAN) else [(names.env_metric(e, "response_length"), e) for e in envs]),
    ]
    if "kl" in off_terms(run.config):  # a KL loss that is off is 0 by construction: no flat panel
        candidates = [c for c in candidates if not c[0].startswith("KL loss")]
    return logged_panels(run, candidates)


def logged_panels(run: RunData, candidates: list[tuple[str, list[tuple[str, str]]]]):
    """The candidate panels (title, [(metric key, legend label)]) with the keys the run logged; panels without any
    left out."""
    out = []
    for title, keys in candidates:
        present = [(k, label) for k, label in keys if has_key(run, k)]
        if present:
            out.append((title, present))
    return out


SMOOTH_FROM = 40  # series with at least this many points also get a trailing mean


def trailing_mean(y: np.ndarray, window: int) -> np.ndarray:
    """Mean of the last `window` values at each point (fewer at the start). [n] -> [n]"""
    csum = np.concatenate([[0.0], np.cumsum(y, dtype=float)])  # [n+1]
    ends = np.arange(1, len(y) + 1)  # [n]
    starts = np.maximum(ends - window, 0)  # [n]
    return (csum[ends] - csum[starts]) / (ends - starts)


def plot_series(ax, x: np.ndarray, y: np.ndarray, label: str) -> bool:
    """Line with markers of the finite values; non-finite ones as red ticks at the bottom.

    Long series are drawn faint with their trailing mean over a tenth of the points on top, so a trend
    shows through step-to-step noise. Returns whether the series was smoothed.
    """
    fin = np.isfinite(y)
    if fin.sum() >= SMOOTH_FROM:
        window = int(fin.sum()) // 10
        (raw,) = ax.plot(x[fin], y[fin], "-", lw=0.8, alpha=0.35)
        ax.plot(x[fin], trailing_mean(y[fin], window), "-", lw=1.8, color=raw.get_color(),
                label=f"{label} (mean of last {window})")
    elif fin.any():
        ax.plot(x[fin], y[fin], "-o", ms=3, lw=1.2, label=label)
    if (~fin).any():
        ax.plot(x[~fin], np.zeros((~fin).sum()), "x", color="#d00", ms=8, mew=2, transform=ax.get_xaxis_transform(),
                label=f"{label}: non-finite", clip_on=False)
    return bool(fin.sum() >= SMOOTH_FROM)


def fig_training_curves(run: RunData) -> Figure | None:
    """Grid of training curves (None when no known metric was logged)."""
    panels = curve_panels(run)
    if not panels:
        return None
    ncols = 3 if len(panels) > 4 else max(1, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = new_figure(5 * ncols, 3.3 * nrows + 0.5)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False).ravel())
    stops = early_stops(run)
    smoothed = False
    for n, (ax, (title, keys)) in enumerate(zip(axes, panels, strict=False)):
        values = []
        for key, label in keys:
            x, y = series(run.rows, key)
            smoothed |= plot_series(ax, x, y, label)
            values.append(y)
        ylim = ax.get_ylim()
        if title.startswith("clip fraction") and ylim[0] < 0.4 and ylim[1] > 0.1:  # band only where it meets the data
            ax.axhspan(0.1, 0.4, color="#2ca02c", alpha=0.12, label="10–40 % (rule of thumb)")
            ax.set_ylim(ylim)
        if title.startswith("grad norm"):
            auto_scale(ax, np.concatenate(values), decades=2.0)
        for step, reason in stops:  # labelled in the first panel only
            ax.axvline(step, color="#d00", ls="--", lw=1, label=f"early stop: {reason}" if n == 0 else None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(ax.get_legend_handles_labels()[0]) > 1 or (n == 0 and stops):
            ax.legend(fontsize=7)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    hint = "  (bold: trailing mean over a tenth of the steps)" if smoothed else ""
    fig.suptitle(f"{run.name}: training curves{hint}")
    return fig


def _lines_per_bucket(ax, run: RunData, steps: list[int], metric: str) -> bool:
    """One line per bucket (and `all`, dashed) of `grad_norm/<bucket>/<metric>` over `steps`.

    A cosine (`cos/a_b`) is left out where the norm of `a` or `b` is 0: the probe logs 0 there, but it is undefined.
    """
    comps = metric.split("/", 1)[1].split("_") if metric.startswith("cos/") else []
    buckets = _buckets_of(run, steps)
    drawn = False
    for b in [*buckets, "all"]:
        key = f"{PREFIX}/{b}/{metric}"
        pts = [(s, run.row(s).get(key)) for s in steps if key in run.row(s)
               and not any(norm_is_zero(run.row(s), b, c) for c in comps)]
        if not pts:
            continue
        x = np.array([p[0] for p in pts], dtype=float)
        y = np.array([as_float(p[1]) for p in pts], dtype=float)
        # a bucket at two steps holds other groups: only `all` (the whole batch) is joined across steps
        style = {"color": "k", "ls": "--"} if b == "all" else {"color": f"C{(bucket_sort_key(b)[1] - 1) % 10}",
                                                               "ls": "none"}
        fin = np.isfinite(y)
        ax.plot(x[fin], y[fin], marker="o", ms=4, label=bucket_label(b, run.bucket_mode, run.zero_bucket), **style)
        drawn = drawn or bool(fin.any())
    return drawn


def fig_cosines(run: RunData, steps: list[int] | None = None) -> Figure | None:
    """Per-bucket cosines between the task, entropy and KL gradients over the analysis steps (None if not logged)."""
    steps = analysis_steps(run) if steps is None else steps
    present = [c for c in COSINES if any(f"/cos/{c}" in k for s in steps for k in run.row(s))]
    if not present:
        return None
    fig = new_figure(5.2 * len(present), 4.2)
    # every panel compares the same analysis steps: one x range, also for a cosine first logged later
    axes = np.atleast_1d(fig.subplots(1, len(present), squeeze=False, sharex=True).ravel())
    pad = 0.5 * (float(np.min(np.diff(steps))) if len(steps) > 1 else 1.0)
    axes[0].set_xlim(min(steps) - pad, max(steps) + pad)
    for ax, c in zip(axes, present, strict=True):
        a, b = c.split("_")
        if not _lines_per_bucket(ax, run, steps, f"cos/{c}"):
            note(ax, "undefined: a gradient norm is 0 at every step" if any(f"/cos/{c}" in k for k in run.row(steps[0]))
                 else "no finite values")
        ax.axhline(0.0, color="0.5", lw=0.8)
        ax.set_title(f"cos(∇{a}, ∇{b})", fontsize=10)
        _step_axis(ax, "analysis step")
        ax.set_ylabel("cosine")
    _shared_legend(fig, axes, _label_order(run, steps))
    fig.suptitle(f"{run.name}: gradient-component cosines per bucket (left out where a norm is 0)")
    return fig


def _step_axis(ax, label: str) -> None:
    ax.set_xlabel(label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def _buckets_of(run: RunData, steps: list[int]) -> list[str]:
    """Every `bucket_k` logged at any of `steps`, in bucket order."""
    return sorted({b for s in steps for b in bucket_names(run.row(s))}, key=bucket_sort_key)


def _label_order(run: RunData, steps: list[int]) -> list[str]:
    """Legend labels of the buckets of `steps` in bucket order, then `all`."""
    return [bucket_label(b, run.bucket_mode, run.zero_bucket) for b in _buckets_of(run, steps)] + ["all"]


def _shared_legend(fig: Figure, axes, order: list[str]) -> None:
    """One legend below the panels, with every bucket that appears in any panel, in the given label order."""
    seen: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, handle)
    seen = dict(sorted(seen.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
    if seen:
        fig.legend(list(seen.values()), list(seen), loc="outside lower center", ncols=min(len(seen), 8), fontsize=8)


def fig_reg_share(run: RunData, steps: list[int] | None = None) -> Figure | None:
    """Per-bucket regulariser share reg/(task+reg) over the analysis steps on a log axis (None if not logged).

    Buckets sit side by side around each step (so equal shares, e.g. several at 1.0, stay visible), with 95 %
    whiskers where logged; a share of exactly 0 is marked on the bottom edge.
    """
    steps = analysis_steps(run) if steps is None else steps
    if reg_share_off(run) or not any(k.endswith("/reg_share") for s in steps for k in run.row(s)):
        return None
    fig = new_figure(7.5, 4.5)
    ax = fig.add_subplot()
    buckets = [*_buckets_of(run, steps), "all"]
    gap = float(np.min(np.diff(steps))) if len(steps) > 1 else 1.0
    drawn, zeros = [], []
    for k, b in enumerate(buckets):
        x, y, low, high = _bucket_series(run, steps, b, "reg_share")
        x = x + (k - (len(buckets) - 1) / 2) * 0.6 * gap / len(buckets)
        style = {"color": "k", "marker": "D"} if b == "all" else {"color": f"C{(bucket_sort_key(b)[1] - 1) % 10}",
                                                                  "marker": "o"}
        pos = np.isfinite(y) & (y > 0)
        zeros += [(xi, style["color"]) for xi in x[np.isfinite(y) & (y == 0)]]
        if not pos.any():
            continue
        # a bucket at two steps holds other groups: buckets are not joined across steps, `all` (the batch) is
        ax.plot(x[pos], y[pos], ls="--" if b == "all" else "none", lw=0.8, ms=5,
                label=bucket_label(b, run.bucket_mode, run.zero_bucket), **style)
        ok = pos & np.isfinite(low) & np.isfinite(high)
        if ok.any():
            lo = np.where(low[ok] > 0, low[ok], y[ok] / 2)  # a whisker to 0 cannot be drawn on a log axis
            err = np.vstack([y[ok] - lo, high[ok] - y[ok]])  # [2, n]
            ax.errorbar(x[ok], y[ok], yerr=err, fmt="none", ecolor=style["color"],
                        capsize=2, lw=0.8)
        drawn.append(y[pos])
    if not drawn:
        note(ax, "no positive shares logged")
    else:
        ax.set_yscale("log")
        ax.set_ylim(float(np.min(np.concatenate(drawn))) / 3, 1.6)
        readable_log_ticks(ax.yaxis)
        ax.axhline(1.0, color="0.6", lw=0.6, ls=":")
        for xi, color in zeros:
            ax.plot([xi], [0.02], marker="v", color=color, transform=ax.get_xaxis_transform(), clip_on=False)
    ax.set_title("regulariser share of the gradient  ‖reg‖ / (‖task‖ + ‖reg‖)  (log scale; ▼ = 0)", fontsize=10)
    _step_axis(ax, "analysis step (buckets side by side, lowest RV left)")
    ax.set_xticks(steps)  # ticks only where an analysis ran: the side-by-side offsets are not steps
    ax.set_ylabel("reg_share")
    _shared_legend(fig, [ax], _label_order(run, steps))
    fig.suptitle(f"{run.name}: regulariser share per bucket")
    return fig


def reg_share_off(run: RunData) -> str | None:
    """Why the run has no regulariser share to draw (entropy and KL both off: it is 0 by construction), or None."""
    off = off_terms(run.config)
    if not {"entropy", "kl"} <= off.keys():
        return None
    return f"No regulariser share: both coefficients are 0 ({off['entropy']}, {off['kl']}), so it is 0 at every step."


def _bucket_series(run: RunData, steps: list[int], bucket: str, metric: str) -> tuple[np.ndarray, ...]:
    """(steps, values, ci_low, ci_high) of `grad_norm/<bucket>/<metric>` at the `steps` that logged it; nan fills."""
    key = f"{PREFIX}/{bucket}/{metric}"
    rows = [run.row(s) for s in steps if key in run.row(s)]
    get = [np.array([as_float(r.get(k)) for r in rows], dtype=float) for k in (key, f"{key}/ci_low", f"{key}/ci_high")]
    return (np.array([r["step"] for r in rows], dtype=float), *get)


def sketch_cosine_matrix(sketches: dict[str, np.ndarray], component: str = "task",
                         prefix: str = PREFIX) -> tuple[list[str], np.ndarray]:
    """(bucket names, [B, B] cosine matrix) of the `<prefix>/bucket_k/<component>` sketches; nan for zero sketches."""
    parsed = {k: names.parse_bucket_metric(k, prefix) for k in sketches}
    keys = sorted((k for k, p in parsed.items() if p and p[0] != names.ALL and p[1] == component),
                  key=lambda k: bucket_sort_key(parsed[k][0]))
    if not keys:
        return [], np.zeros((0, 0))
    m = np.stack([sketches[k] for k in keys])  # [B, dim]
    norms = np.linalg.norm(m, axis=1)  # [B]
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = (m @ m.T) / np.outer(norms, norms)  # [B, B]
    cos[~np.isfinite(cos)] = np.nan
    return [parsed[k][0] for k in keys], cos


def fig_sketch_cosines(run: RunData, step: int, component: str = "task") -> Figure | None:
    """Annotated heatmap of bucket × bucket cosines of the task-gradient sketches (None without sketches)."""
    buckets, cos = sketch_cosine_matrix(read_sketches(run.path, step), component)
    if not buckets:
        return None
    n = len(buckets)
    fig = new_figure(2.2 + 0.7 * n, 1.2 + 0.7 * n)
    ax = fig.add_subplot()
    im = ax.imshow(np.ma.masked_invalid(cos), cmap="RdBu_r", vmin=-1, vmax=1)
    labels = [bucket_label(b, run.bucket_mode, run.zero_bucket) for b in buckets]
    ax.set_xticks(range(n), labels)
    ax.set_yticks(range(n), labels)
    for i in range(n):
        for j in range(n):
            v = cos[i, j]
            ax.text(j, i, "n/a" if np.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=8,
                    color="w" if np.isfinite(v) and abs(v) > 0.6 else "k")
    fig.colorbar(im, ax=ax, shrink=0.8, label="cosine (sketch estimate)")
    ax.set_title(f"{run.name} — step {step}\n{component}-gradient cosine between buckets", fontsize=10)
    return fig


def write_curves(run: RunData, out: str | Path, steps: list[int] | None = None, dpi: int = DPI) -> list[Path]:
    """Write the training curves, the across-step analysis views and the sketch heatmaps; returns the paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    named = [("training_curves.png", fig_training_curves(run)), ("analysis_cosines.png", fig_cosines(run)),
             ("analysis_reg_share.png", fig_reg_share(run))]
    all_steps = analysis_steps(run)
    for s in all_steps if steps is None else [s for s in all_steps if s in steps]:
        named.append((f"analysis_sketch_cosines_step_{s}.png", fig_sketch_cosines(run, s)))
    for name, fig in named:
        if fig is not None:
            paths.append(save_png(fig, out / name, dpi))
    return paths
