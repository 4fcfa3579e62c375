"""The run's health at a glance: `health_timeline.png` and a one-line verdict, from the health monitor's
`events.jsonl` (`RunData.events`, read by `plots.data.load_events`).

- `fig_health_timeline`: the main curves (validation success, training reward, entropy, pre-clip gradient norm;
  those that were logged) on shared step axes, every alarm a vertical line at its step in the colour of its action
  (record grey, warn orange, skip blue, rollback purple, stop red), labelled with its rule at the top; a rollback is
  a shaded span from the checkpoint it went back to to the step it left, and the alarms of the steps it undid
  (`rolled_back/attempt_<k>/`) are dotted lines. A run without events gets its curves and the note "no alarms".
- `verdict`: one sentence, worst first: stopped by a rule, rollbacks (with the rule that asked for
  each), skipped optimizer steps, warnings (with the step a warning cleared at, when its rule
  stopped firing: the `clear` rows of events.jsonl); else "no alarms above record". A clear is no
  alarm: the timeline draws no line for it.

`timeline_or_none` draws the figure and turns any failure on odd input into one warning line on stderr, so the
figure never fails `rldyn plot` or `rldyn report`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from rldynamics import metric_names as names
from rldynamics.analysis.health_rules import CLEAR
from rldynamics.plots.curves import logged_panels, plot_series
from rldynamics.plots.data import HealthEvent, RunData, as_float, env_names, series
from rldynamics.plots.figure import DPI, auto_scale, new_figure, note, save_png

TIMELINE_FILE = "health_timeline.png"
ACTION_COLORS = {"record": "#9e9e9e", "warn": "#ef6c00", "skip": "#1565c0", "rollback": "#7b1fa2",
                 "stop": "#c62828", CLEAR: "#2e7d32"}  # a clear: no line; its colour is the table's
UNKNOWN_COLOR = "#000000"  # an action this version does not know
CURVE_COLORS = ["#263238", "#00897b", "#8d6e63", "#546e7a"]  # curves in colours no action uses
SEVERITY = ("stop", "rollback", "skip", "warn", "record")  # worst first


def action_color(action: str) -> str:
    return ACTION_COLORS.get(action, UNKNOWN_COLOR)


def _rank(action: str) -> int:
    return SEVERITY.index(action) if action in SEVERITY else len(SEVERITY)


def timeline_panels(run: RunData) -> list[tuple[str, list[tuple[str, str]]]]:
    """(panel title, [(metric key, legend label)]) of the main curves that were logged, top to bottom."""
    envs = env_names(run)
    candidates = [
        ("validation success", [(names.val_success(e), e) for e in envs]),
        (f"training reward ({names.SCORE_MEAN})", [(names.SCORE_MEAN, "mean score")]),
        (f"entropy ({names.ENTROPY})", [(names.ENTROPY, "entropy")]),
        (f"pre-clip gradient norm ({names.ACTOR_GRAD_NORM})", [(names.ACTOR_GRAD_NORM, "grad norm")]),
    ]
    return logged_panels(run, candidates)


def alarms(run: RunData) -> list[HealthEvent]:
    """The events that are neither rollbacks nor clears (a warning's rule stopped firing)."""
    return [e for e in run.events if not e.is_rollback and e.action != CLEAR]


def cleared_at(run: RunData, rule: str) -> int | None:
    """The step `rule`'s last warning cleared at: its rule stopped firing after its last alarm (else
    None)."""
    own = [e for e in run.events if e.rule == rule and e.undone is None]
    last = max((e.step for e in own if e.action != CLEAR), default=None)
    clears = [e.step for e in own if e.action == CLEAR and (last is None or e.step > last)]
    return max(clears) if clears else None


def rollbacks(run: RunData) -> list[HealthEvent]:
    return [e for e in run.events if e.is_rollback and e.undone is None]


def rollback_cause(run: RunData, rollback: HealthEvent) -> HealthEvent | None:
    """The alarm that asked for `rollback`: among the alarms of the steps it undid (its archive), the one with the
    action rollback at the step it left (else the last such alarm there)."""
    asked = [e for e in run.events if e.undone is not None and e.undone == rollback.archive
             and e.action == "rollback" and not e.is_rollback]
    at_step = [e for e in asked if e.step == rollback.from_step]
    return (at_step or asked or [None])[-1]


def _mark(axes, run: RunData) -> list[tuple[str, str]]:
    """Draw the rollback spans and the alarm lines on every panel, their labels on the top one; returns the legend
    entries (kind, colour) drawn."""
    drawn: dict[str, str] = {}
    for r in rollbacks(run):
        for ax in axes:
            ax.axvspan(r.step, r.from_step, color=action_color("rollback"), alpha=0.13, lw=0)
        axes[-1].text(r.step, 0.04, f" back to step {r.step}", transform=axes[-1].get_xaxis_transform(), ha="left",
                      va="bottom", fontsize=7, color=action_color("rollback"))
        drawn["rollback (steps undone)"] = "span"
    by_step: dict[tuple[int, bool], list[HealthEvent]] = {}
    for e in alarms(run):
        by_step.setdefault((e.step, e.undone is not None), []).append(e)
    top = axes[0]
    for (step, undone), events in sorted(by_step.items(), key=lambda kv: (kv[0][0], not kv[0][1])):  # kept on top
        worst = min(events, key=lambda e: _rank(e.action))
        color = action_color(worst.action)
        for ax in axes:
            ax.axvline(step, color=color, lw=1.3, ls=":" if undone else "-", alpha=0.9, zorder=1)
        top.plot([step], [1.0], marker="v", ms=7, color=color, mfc="white" if undone else color,
                 transform=top.get_xaxis_transform(), clip_on=False)
        rules = "\n".join(dict.fromkeys(e.rule for e in events)) + ("\n(undone)" if undone else "")
        # the kept run's labels left of the line, those of the steps a rollback undid right of it
        top.text(step, 0.96, rules, transform=top.get_xaxis_transform(), rotation=90, ha="left" if undone else "right",
                 va="top", fontsize=7, color=color, linespacing=1.0,
                 bbox={"facecolor": "white", "alpha": 0.7, "lw": 0, "pad": 1})
        for e in events:
            drawn.setdefault(e.action, "line")
    return list(drawn.items())


def fig_health_timeline(run: RunData) -> Figure | None:
    """The main curves with the run's health events on them (None for a run with no metrics rows and no events)."""
    if not run.rows and not run.events:
        return None
    panels = timeline_panels(run)
    fig = new_figure(11, 1.9 * max(1, len(panels)) + 1.4)
    axes = list(fig.subplots(max(1, len(panels)), 1, sharex=True, squeeze=False)[:, 0])
    for ax, (title, keys) in zip(axes, panels, strict=False):
        ax.set_prop_cycle(color=CURVE_COLORS)
        values = []
        for key, label in keys:
            x, y = series(run.rows, key)
            plot_series(ax, x, y, label)
            values.append(y)
        if any(k == names.ACTOR_GRAD_NORM for k, _ in keys):
            auto_scale(ax, np.concatenate(values), decades=2.0)
        ax.set_title(title, fontsize=9, loc="left")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7, loc="lower left")
    if not panels:
        note(axes[0], "no validation success, reward, entropy or gradient norm was logged")
        axes[0].set_yticks([])
    legend = _mark(axes, run)
    if not run.events:
        axes[0].set_title("no alarms", loc="right", fontsize=10, color="#2e7d32", fontweight="bold")  # above the data
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    if legend:
        handles = [Patch(color=action_color("rollback"), alpha=0.25) if kind == "span" else
                   Line2D([], [], color=action_color(name), lw=2) for name, kind in legend]
        fig.legend(handles, [name for name, _ in legend], loc="outside lower center", ncols=min(len(handles), 6),
                   fontsize=8, title_fontsize=8, title="health events by action" + (
                       " (dotted: in steps a rollback undid)" if any(e.undone for e in run.events) else ""))
    fig.suptitle(f"{run.name}: health timeline")
    return fig


def timeline_or_none(run: RunData) -> Figure | None:
    """`fig_health_timeline`, or None with one warning line on stderr when odd input keeps it from drawing."""
    try:
        return fig_health_timeline(run)
    except Exception as e:  # noqa: BLE001 (a figure must never fail the report; the line names what went wrong)
        first = str(e).splitlines()[0] if str(e) else ""
        print(f"warning: {run.path}: the health timeline could not be drawn ({e.__class__.__name__}: {first})",
              file=sys.stderr)
        return None


def write_timeline(run: RunData, out: str | Path, dpi: int = DPI) -> list[Path]:
    """Write `health_timeline.png` into `out` (nothing for a run with no rows and no events); returns the paths."""
    fig = timeline_or_none(run)
    if fig is None:
        return []
    Path(out).mkdir(parents=True, exist_ok=True)
    return [save_png(fig, Path(out) / TIMELINE_FILE, dpi)]


@dataclass(frozen=True)
class Verdict:
    """The run's health in one sentence; `level`: error (stopped, rolled back), warning (skips, warnings) or ok."""

    level: str
    text: str


def undone_steps(rollback: HealthEvent) -> str:
    """`steps 7–9` (or `step 7`) that a rollback undid."""
    first, last = rollback.step + 1, rollback.from_step
    return f"step {last}" if first == last else f"steps {first}–{last}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _rules(events: list[HealthEvent]) -> str:
    return ", ".join(dict.fromkeys(e.rule for e in events))


def _warned(run: RunData, warns: list[HealthEvent]) -> str:
    """The rules that warned, each cleared one with its step: `no_learning, cleared at step 80;
    truncation`."""
    said = []
    for rule in dict.fromkeys(e.rule for e in warns):
        step = cleared_at(run, rule)
        said.append(rule if step is None else f"{rule}, cleared at step {step}")
    return ("; " if any(", cleared" in s for s in said) else ", ").join(said)


def skipped_steps(run: RunData) -> list[int]:
    """Steps whose optimizer steps a rule refused: the steps of its skip events, and every step where a rule with
    a skip event logged `health/<rule>` = 1 (an event marks only the first step of a streak)."""
    skips = [e for e in alarms(run) if e.action == "skip" and e.undone is None]
    rules = {e.rule for e in skips}
    steps = {e.step for e in skips}
    steps |= {r["step"] for r in run.rows for rule in rules if as_float(r.get(names.health(rule))) == 1.0}
    return sorted(steps)


def verdict(run: RunData) -> Verdict:
    """One sentence on the run's health from its events (worst first). The alarms of steps a rollback undid count
    only as the rollback's cause."""
    found = [e for e in alarms(run) if e.undone is None]
    parts, level = [], "ok"
    stops = [e for e in found if e.action == "stop"]
    if stops:
        parts.append(f"Stopped by {stops[0].rule} at step {stops[0].step}")
        level = "error"
    backs = rollbacks(run)
    if backs:
        level = "error"
        said = []
        for r in backs:
            cause = rollback_cause(run, r)
            why = f" after {cause.rule}" if cause is not None else ""
            said.append(f"{undone_steps(r)} undone{why}, back to the checkpoint of step {r.step}")
        parts.append(f"{_plural(len(backs), 'rollback')} ({'; '.join(said)})")
    skips = [e for e in found if e.action == "skip"]
    if skips:
        steps = skipped_steps(run)
        parts.append(f"optimizer steps refused at {_plural(len(steps), 'step')} ({_rules(skips)})")
        level = "warning" if level == "ok" else level
    warns = [e for e in found if e.action == "warn"]
    if warns:
        parts.append(f"{_plural(len(warns), 'warning')} ({_warned(run, warns)})")
        level = "warning" if level == "ok" else level
    records = [e for e in found if e.action == "record"]
    recorded = f"{_plural(len(records), 'alarm')} recorded ({_rules(records)})" if records else ""
    if parts:
        return Verdict(level, "; ".join(parts + ([recorded] if recorded else [])) + ".")
    if recorded:
        return Verdict("ok", f"No alarms above record: {recorded}.")
    monitored = any(k.startswith(f"{names.HEALTH}/") for r in run.rows for k in r)
    return Verdict("ok", "No alarms: no health rule fired." if monitored or not run.rows else
                   "No alarms: this run logged no health/* metrics (the monitor was off, health.enabled=false, or "
                   "the run predates it).")
