"""Figures, the health rule and the across-run statistics of the template-collapse diagnostics (no torch).

Reads the `collapse_first_turn_sample/*` (else `collapse_trajectory_sample/*`) metrics of a run directory:
- `fig_mi_entropy`: MI (with its bootstrap interval) and the entropy estimates over the diagnosed steps, retrieval
  above chance beside them;
- `fig_regimes`: the entropy-vs-MI plane with RAGEN-2's four regimes (diverse, template collapse, compressed,
  low-entropy collapse) and the run's path through it. The regimes are relative: the dividing lines go through
  the run's first diagnosed point (an absolute "high" MI depends on the task, the reply length and the batch's
  number of prompts, whose log bounds it);
- `check_template_collapse`: the health rule. Template collapse: between the step where MI (or retrieval above
  chance) peaked and a later step, it fell to at most half of the peak (and by at least `min_drop`) while the
  conditional entropy stayed within `steady` of its value at the peak (or rose). The flag names the step range;
- `spearman` / `spearman_interval`: rank correlation over runs and its percentile bootstrap interval (runs
  resampled with replacement), for the sweep summary's finding (final success vs final MI and vs final entropy).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from rldynamics import metric_names as names
from rldynamics.plots.data import RunData, series
from rldynamics.plots.figure import DPI, RUN_COLORS, new_figure, save_png
from rldynamics.plots.health import Flag

MODES = (names.COLLAPSE_FIRST_TURN, names.COLLAPSE_TRAJECTORY)
MI, ENTROPY, MARGINAL_ENTROPY = "mi_estimate", "conditional_entropy_est", "reasoning_entropy_est"
RETRIEVAL = "retrieval_above_chance"


def mode_of(run: RunData) -> str | None:
    """The first collapse mode the run logged (first-turn preferred), or None."""
    for mode in MODES:
        if any(f"{mode}/{MI}" in r for r in run.rows):
            return mode
    return None


def collapse_series(run: RunData, name: str, mode: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of `<mode>/<name>` (mode: `mode_of(run)` when not given)."""
    mode = mode or mode_of(run)
    return series(run.rows, f"{mode}/{name}") if mode else (np.zeros(0), np.zeros(0))


def final_value(run: RunData, name: str) -> float:
    """The last finite `<mode>/<name>` of the run, nan when none."""
    _, y = collapse_series(run, name)
    y = y[np.isfinite(y)]
    return float(y[-1]) if len(y) else math.nan


def fig_mi_entropy(run: RunData) -> Figure | None:
    """MI and entropy over the diagnosed steps (left), retrieval accuracy above chance (right)."""
    mode = mode_of(run)
    if mode is None:
        return None
    fig = new_figure(11, 3.8)
    ax, ax_r = fig.subplots(1, 2)
    steps, mi = collapse_series(run, MI, mode)
    ax.plot(steps, mi, "o-", color="#1f77b4", label="MI estimate I(X;Z) (per token)")
    _, low = collapse_series(run, f"{MI}/ci_low", mode)
    _, high = collapse_series(run, f"{MI}/ci_high", mode)
    if len(low) == len(steps) and len(steps):
        ax.fill_between(steps, low, high, color="#1f77b4", alpha=0.2, label="95 % bootstrap interval")
    ax.set_xlabel("step")
    ax.set_ylabel("MI (nats per token)", color="#1f77b4")
    twin = ax.twinx()
    for name, style, label in ((ENTROPY, "s--", "H(Z|X) conditional entropy"),
                               (MARGINAL_ENTROPY, "^:", "H(Z) marginal entropy")):
        s, y = collapse_series(run, name, mode)
        twin.plot(s, y, style, color="#2ca02c", label=label)
    twin.set_ylabel("entropy (nats per token)", color="#2ca02c")
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="best")
    ax.set_title(f"MI and entropy ({mode.split('_sample')[0].replace('collapse_', '')} pairs)", fontsize=10)
    s, acc = collapse_series(run, RETRIEVAL, mode)
    ax_r.plot(s, acc, "o-", color="#d62728")
    ax_r.axhline(0.0, color="#888", lw=0.8)
    ax_r.set_xlabel("step")
    ax_r.set_ylabel("retrieval accuracy - chance")
    ax_r.set_title("Retrieval of the prompt from the reply, above chance", fontsize=10)
    return fig


REGIMES = (("diverse reasoning", 1, 1), ("template collapse", 1, 0), ("compressed reasoning", 0, 1),
           ("low-entropy collapse", 0, 0))  # (name, entropy high, MI high)


def fig_regimes(run: RunData) -> Figure | None:
    """The entropy-vs-MI plane: four regimes around the first diagnosed point, and the run's path."""
    mode = mode_of(run)
    if mode is None:
        return None
    steps, mi = collapse_series(run, MI, mode)
    _, ent = collapse_series(run, ENTROPY, mode)
    ok = np.isfinite(mi) & np.isfinite(ent)
    if not ok.any() or len(ent) != len(mi):
        return None
    steps, mi, ent = steps[ok], mi[ok], ent[ok]
    fig = new_figure(6.4, 5.0)
    ax = fig.subplots()
    x0, y0 = ent[0], mi[0]
    span_x = max(float(np.ptp(ent)), abs(x0) * 0.2, 1e-3)
    span_y = max(float(np.ptp(mi)), abs(y0) * 0.2, 1e-3)
    ax.set_xlim(min(ent.min(), x0) - 0.3 * span_x, max(ent.max(), x0) + 0.3 * span_x)
    ax.set_ylim(min(mi.min(), y0) - 0.3 * span_y, max(mi.max(), y0) + 0.3 * span_y)
    ax.axvline(x0, color="#aaa", lw=0.8)
    ax.axhline(y0, color="#aaa", lw=0.8)
    for name, high_h, high_i in REGIMES:
        ax.text(0.98 if high_h else 0.02, 0.97 if high_i else 0.03, name, transform=ax.transAxes, fontsize=8,
                ha="right" if high_h else "left", va="top" if high_i else "bottom", color="#555",
                style="italic")
    ax.plot(ent, mi, "-", color="#999", lw=1, zorder=1)
    dots = ax.scatter(ent, mi, c=steps, cmap="viridis", zorder=2, s=28)
    ax.annotate(f"step {int(steps[0])}", (ent[0], mi[0]), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.annotate(f"step {int(steps[-1])}", (ent[-1], mi[-1]), fontsize=7, xytext=(4, -10), textcoords="offset points")
    fig.colorbar(dots, ax=ax, label="step")
    ax.set_xlabel("conditional entropy H(Z|X) (nats per token)")
    ax.set_ylabel("MI estimate I(X;Z) (nats per token)")
    ax.set_title("Entropy vs MI: regimes relative to the first diagnosed step", fontsize=10)
    return fig


def check_template_collapse(rows: list[dict[str, Any]], *, fall: float = 0.5, steady: float = 0.1,
                            min_drop: float = 0.02) -> list[Flag]:
    """Entropy steady while MI or retrieval above chance falls: template collapse (module docstring)."""
    run = RunData(Path("."), rows, {}, [])
    mode = mode_of(run)
    if mode is None:
        return []
    flags = []
    steps, ent = collapse_series(run, ENTROPY, mode)
    for name, label in ((MI, "MI estimate"), (RETRIEVAL, "retrieval accuracy above chance")):
        s, y = collapse_series(run, name, mode)
        ok = np.isfinite(y) & np.isfinite(ent) if len(ent) == len(y) else np.zeros(len(y), bool)
        s, y, h = s[ok], y[ok], ent[ok] if len(ent) == len(ok) else ent
        if len(y) < 2:
            continue
        peak = int(np.argmax(y))
        if peak == len(y) - 1 or y[peak] <= 0:
            continue
        end = peak + 1 + int(np.argmin(y[peak + 1:]))
        dropped = y[end] <= fall * y[peak] and y[peak] - y[end] >= min_drop
        held = h[end] >= (1 - steady) * h[peak]
        if dropped and held:
            flags.append(Flag(f"template_collapse_{name}", "warning",
                              f"template collapse: {label} fell from {y[peak]:.3g} to {y[end]:.3g} between steps "
                              f"{int(s[peak])} and {int(s[end])} while the entropy did not fall ({h[peak]:.3g} → "
                              f"{h[end]:.3g})",
                              "The replies stay as diverse as before for a given input (conditional entropy steady) "
                              "but depend less on the input: the policy answers with an input-agnostic template "
                              "(RAGEN-2). Entropy alone would not show it.",
                              {"steps": f"{int(s[peak])}–{int(s[end])}", name: f"{y[peak]:.4g} → {y[end]:.4g}",
                               "conditional entropy": f"{h[peak]:.4g} → {h[end]:.4g}", "mode": mode}))
    return flags


def write_collapse_figures(run: RunData, out: str | Path, dpi: int = DPI) -> list[Path]:
    """`collapse_mi_entropy.png` and `collapse_regimes.png` in `out` (nothing when the run has no collapse metrics)."""
    written = []
    for name, make in (("collapse_mi_entropy.png", fig_mi_entropy), ("collapse_regimes.png", fig_regimes)):
        fig = make(run)
        if fig is not None:
            Path(out).mkdir(parents=True, exist_ok=True)
            written.append(save_png(fig, Path(out) / name, dpi))
    return written


def fig_runs_mi_success(runs: list[RunData], success_key: str) -> Figure | None:
    """Several runs: validation success (left) and MI (right) over steps, one colour per run."""
    if not any(mode_of(r) for r in runs):
        return None
    fig = new_figure(11, 3.8)
    left, right = fig.subplots(1, 2)
    names = [r.name for r in runs]
    unique = len(set(names)) == len(names)  # sweep runs are all named seed<s>: then their point too
    for i, run in enumerate(runs):
        color = RUN_COLORS[i % len(RUN_COLORS)]
        label = run.name if unique else f"{run.path.parent.name}/{run.name}"
        s, y = series(run.rows, success_key)
        left.plot(s, y, "o-", color=color, label=label)
        s, y = collapse_series(run, MI)
        right.plot(s, y, "s-", color=color, label=label)
    left.set_title("validation success", fontsize=10)
    right.set_title("MI estimate I(X;Z) (nats per token)", fontsize=10)
    for ax in (left, right):
        ax.set_xlabel("step")
    left.legend(fontsize=7)
    return fig


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties); nan with fewer than 3 pairs, a constant side or a
    value that is not finite."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 3 or not (np.isfinite(x).all() and np.isfinite(y).all()):
        return math.nan
    rx, ry = _ranks(x), _ranks(y)
    if np.ptp(rx) == 0 or np.ptp(ry) == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


def _ranks(v: np.ndarray) -> np.ndarray:
    order = np.argsort(v, kind="stable")
    ranks = np.empty(len(v))
    ranks[order] = np.arange(len(v), dtype=float)
    for value in np.unique(v):  # ties share their average rank
        tied = v == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def spearman_interval(x: np.ndarray, y: np.ndarray, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile bootstrap interval of `spearman(x, y)`, resampling the pairs with replacement (resamples
    where the correlation is undefined are left out); nan when fewer than 3 pairs."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 3:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    draws = [spearman(x[i], y[i]) for i in rng.integers(0, len(x), (resamples, len(x)))]
    values = np.array([d for d in draws if math.isfinite(d)])
    if len(values) < 2:
        return math.nan, math.nan
    return float(np.quantile(values, 0.025)), float(np.quantile(values, 0.975))
