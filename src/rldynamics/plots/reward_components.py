"""Figures, health checks and the report section of the reward-component study (no torch).

Reads only the run directory: `reward/<name>/*` and `reward_grad/<bucket>/*` metrics and the
`analysis/step_<N>/reward_grad.json` matrices. Undefined cosines (a zero component gradient) are NaN in the
metrics and null in the JSON; they are drawn as hatched "n/a" cells or gaps, never as 0.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from rldynamics import metric_names as naming
from rldynamics.plots.data import RunData, analysis_dirs, as_float, series
from rldynamics.plots.figure import fmt, new_figure
from rldynamics.plots.health import Flag
from rldynamics.tracking.run_dir import read_rewards

RG = "reward_grad"


def component_names(run: RunData) -> list[str]:
    """Reward component names logged by the run (`reward/<name>/mean`), in first-seen order."""
    found: list[str] = []
    for row in run.rows:
        for key in row:
            parsed = naming.parse_reward_component(key)
            if parsed and parsed[1] == "mean" and parsed[0] not in found:
                found.append(parsed[0])
    return found


def read_reward_grad(run: RunData) -> dict[int, dict[str, Any]]:
    """step -> the `grad_norm` pass's bucket matrices from `reward_grad.json` (unreadable files are skipped)."""
    out = {}
    for step, directory in analysis_dirs(run.path).items():
        file = directory / "reward_grad.json"
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("grad_norm"), dict):
            out[step] = data["grad_norm"]
    return dict(sorted(out.items()))


def _matrix(values: list[list[Any]]) -> np.ndarray:
    return np.array([[as_float(v) for v in row] for row in values], dtype=float)  # odd values: nan / inf


def fig_cosine_matrix(matrices: dict[str, Any], step: int, bucket: str = "all") -> Figure | None:
    """Heatmap of the component cosine matrix of one step (n/a cells hatched)."""
    m = matrices.get(bucket)
    if not m or not m.get("components"):
        return None
    names, cos = m["components"], _matrix(m["cos"])
    k = len(names)
    fig = new_figure(1.3 * k + 2.4, 1.1 * k + 1.4)
    ax = fig.add_subplot(1, 1, 1)
    image = ax.imshow(np.ma.masked_invalid(cos), cmap="RdBu_r", vmin=-1, vmax=1)
    ax.set_facecolor("#eeeeee")
    for i in range(k):
        for j in range(k):
            text = "n/a" if np.isnan(cos[i, j]) else f"{cos[i, j]:.2f}"
            ax.text(j, i, text, ha="center", va="center", fontsize=9,
                    color="#555" if np.isnan(cos[i, j]) else ("white" if abs(cos[i, j]) > 0.6 else "black"))
    ax.set_xticks(range(k), names, rotation=30, ha="right")
    ax.set_yticks(range(k), names)
    ax.set_title(f"Reward-component gradient cosines, step {step} ({bucket})", fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    return fig


def fig_cosines_over_steps(run: RunData, bucket: str = "all") -> Figure | None:
    """Pairwise component cosines and each component's cosine with the total, per analysis step."""
    pairs, totals = _keys(run, f"{RG}/{bucket}/cos/"), _keys(run, f"{RG}/{bucket}/cos_total/")
    if not pairs and not totals:
        return None
    fig = new_figure(11, 3.8)
    for col, (keys, title) in enumerate(((pairs, "between components"), (totals, "with the total (trained) reward"))):
        ax = fig.add_subplot(1, 2, col + 1)
        for key in keys:
            x, y = series(run.rows, key)
            if len(x):
                ax.plot(x, y, marker="o", ms=3, label=key.rsplit("/", 1)[1].replace("__", " · "))
        ax.axhline(0, color="#999", lw=0.8)
        ax.set_ylim(-1.05, 1.05)
        ax.set_xlabel("step")
        ax.set_ylabel("cosine")
        ax.set_title(f"Gradient cosine {title} ({bucket})", fontsize=10)
        if keys:
            ax.legend(fontsize=7)
    return fig


def fig_layer_profile(matrices: dict[str, Any], step: int, bucket: str = "all") -> Figure | None:
    """Per-layer-group cosine of every component pair and with the total (y from -1 to 1: never clipped)."""
    m = matrices.get(bucket)
    if not m or not m.get("layer_groups"):
        return None
    groups = m["layer_groups"]
    fig = new_figure(max(6.0, 0.7 * len(groups) + 4), 3.8)
    for col, (profiles, title) in enumerate(((m["layer_cos"], "pairs"), (m["layer_cos_total"], "with the total"))):
        ax = fig.add_subplot(1, 2, col + 1)
        for label, values in profiles.items():
            y = np.array([np.nan if v is None else v for v in values], dtype=float)
            ax.plot(range(len(groups)), y, marker="o", ms=3, label=label.replace("__", " · "))
        ax.axhline(0, color="#999", lw=0.8)
        ax.set_ylim(-1.05, 1.05)
        ax.set_xticks(range(len(groups)), groups, rotation=45, ha="right", fontsize=7)
        ax.set_ylabel("cosine")
        ax.set_title(f"Per-layer cosine, {title} (step {step}, {bucket})", fontsize=10)
        ax.legend(fontsize=7)
    return fig


def fig_component_rewards(run: RunData) -> Figure | None:
    """Mean of every reward component per step, and the fraction of groups where it is constant."""
    names = component_names(run)
    if not names:
        return None
    fig = new_figure(11, 3.6)
    for col, (stat, ylabel) in enumerate((("mean", "mean (raw)"), ("zero_std_group_frac", "groups with zero std"))):
        ax = fig.add_subplot(1, 2, col + 1)
        for name in names:
            x, y = series(run.rows, naming.reward_component(name, stat))
            if len(x):
                ax.plot(x, y, lw=1.2, label=name)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(f"Reward components: {ylabel}", fontsize=10)
        ax.legend(fontsize=7)
    return fig


def fig_response_lengths(run: RunData) -> Figure | None:
    """Distribution of response lengths per step (median, 25-75 % and 10-90 % bands) from `rewards.jsonl`."""
    try:
        rows = read_rewards(run.path)
    except (OSError, ValueError):
        return None
    by_step: dict[int, list[tuple[float, float]]] = {}
    for r in rows:
        try:
            lengths = (as_float(r["response_chars"]), as_float(r["response_tokens"]))
            if all(map(math.isfinite, lengths)):  # odd values (text, 1e308, NaN) are left out
                by_step.setdefault(int(r["step"]), []).append(lengths)
        except (KeyError, TypeError, ValueError, OverflowError):  # e.g. "step": Infinity
            continue
    if not by_step:
        return None
    steps = np.array(sorted(by_step))
    fig = new_figure(11, 3.6)
    for col, unit in enumerate(("characters", "tokens")):
        ax = fig.add_subplot(1, 2, col + 1)
        q = np.array([np.percentile([v[col] for v in by_step[s]], [10, 25, 50, 75, 90]) for s in steps])  # [S, 5]
        ax.fill_between(steps, q[:, 0], q[:, 4], alpha=0.15, color="#1f77b4", label="10-90 %")
        ax.fill_between(steps, q[:, 1], q[:, 3], alpha=0.3, color="#1f77b4", label="25-75 %")
        ax.plot(steps, q[:, 2], color="#1f77b4", lw=1.3, label="median")
        ax.set_xlabel("step")
        ax.set_ylabel(f"response length ({unit})")
        ax.set_title(f"Response length per step ({unit})", fontsize=10)
        ax.legend(fontsize=7)
    return fig


def _keys(run: RunData, prefix: str) -> list[str]:
    keys: list[str] = []
    for row in run.rows:
        keys += [k for k in row if k.startswith(prefix) and k not in keys]
    return keys


def check_reward_components(run: RunData, last: int = 10) -> list[Flag]:
    """Flags: a component whose gradient opposes the total's (warning: at most analysis steps; note: at the latest
    one only); a component constant in every group."""
    flags = []
    for key in _keys(run, f"{RG}/all/cos_total/"):
        x, y = series(run.rows, key)
        finite = y[np.isfinite(y)]
        if len(finite) and np.median(finite) < 0:
            name = key.rsplit("/", 1)[1]
            flags.append(Flag("reward_component_conflict", "warning",
                              f"The {name} gradient opposes the total reward's",
                              f"cos(g_{name}, g_total) is negative at {int((finite < 0).sum())} of {len(finite)} "
                              "analysis steps: improving the trained reward works against this component.",
                              {"median cosine": fmt(float(np.median(finite))), "steps": len(finite)}))
        elif len(finite) and finite[-1] < 0:
            name = key.rsplit("/", 1)[1]
            flags.append(Flag("reward_component_conflict_latest", "note",
                              f"The {name} gradient opposed the total reward's at the latest analysis step",
                              f"cos(g_{name}, g_total) = {fmt(float(finite[-1]))} at step {int(x[np.isfinite(y)][-1])} "
                              "(non-negative at most earlier steps): watch whether the conflict persists.",
                              {"latest cosine": fmt(float(finite[-1])),
                               "median cosine": fmt(float(np.median(finite)))}))
    for name in component_names(run):
        x, y = series(run.rows, naming.reward_component(name, "zero_std_group_frac"))
        recent = y[-last:][np.isfinite(y[-last:])]
        if len(recent) and bool(np.all(recent >= 1.0)):
            _, mean = series(run.rows, naming.reward_component(name, "mean"))
            flags.append(Flag("reward_component_constant", "note",
                              f"Reward component {name} is constant within every group",
                              f"In the last {len(recent)} steps every group gave all its trajectories the same {name}: "
                              "it has no group-relative advantage and no gradient (saturated, or never reached).",
                              {"recent mean": fmt(as_float(mean[-1])) if len(mean) else "n/a"}))
    return flags


def write_reward_component_figures(run: RunData, out: str | Path, save, steps: list[int] | None = None) -> list[Path]:
    """Write every reward-component figure of the run into `out` (the per-step ones for `steps` only, default all);
    `save(fig, path)` writes one PNG."""
    out = Path(out)
    figures: list[tuple[str, Figure | None]] = [("reward_components.png", fig_component_rewards(run)),
                                                ("response_lengths.png", fig_response_lengths(run)),
                                                ("reward_grad_cosines.png", fig_cosines_over_steps(run))]
    for step, matrices in read_reward_grad(run).items():
        if steps is not None and step not in steps:
            continue
        figures += [(f"reward_grad_matrix_step_{step}.png", fig_cosine_matrix(matrices, step)),
                    (f"reward_grad_layers_step_{step}.png", fig_layer_profile(matrices, step))]
    written = []
    for name, fig in figures:
        if fig is not None:
            written.append(save(fig, out / name))
    return written
