"""The sweep's summary files: tables (from `summary.py`), two figures and one HTML page in the style of
`rldyn report`, all rebuilt from the run directories.

- `summary_curves.png`: validation success vs step, one line per point (mean over the seeds that validated
  at that step), the seeds' min–max as a band; a cross marks where a seed stopped early.
- `summary_value.png`: final success per point (categorical axis in sweep order, so `nofilter` and grids
  fit): mean ± std over seeds, every seed as a dot; early-stopped seeds as red crosses (failed regimes).
- `summary.html`: the tables, both figures embedded, links to each run's `report.html` and `train.log`,
  and the log tail of every failed run.

Nothing written holds an absolute path or a clock time, and PNGs carry no software metadata, so
`rldyn sweep --summarize` on a copy of the sweep directory reproduces every file byte for byte. Every file
is made in memory first, then written to a temporary name renamed over the old one: a write that fails
(a full disk) leaves the previous file whole.
This module imports no torch.
"""

from __future__ import annotations

import html
from pathlib import Path
from urllib.parse import quote

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from rldynamics.plots.figure import new_figure, note, png_bytes
from rldynamics.plots.report import CSS, figure_html
from rldynamics.sweep.summary import (
    TEXT_COLUMNS,
    SweepSummary,
    collect,
    csv_text,
    failed_runs,
    failure_line,
    intro,
    markdown,
    point_rows,
    run_rows,
)

FILES = ("summary.csv", "summary.md", "summary_curves.png", "summary_value.png", "summary.html")
STOP_STYLE = {"marker": "x", "color": "#d00", "ms": 9, "mew": 2.2, "ls": "none"}


def _curve(runs) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(steps, mean, min, max) over the runs' validation curves; a step's statistics use the seeds that have it."""
    by_step: dict[float, list[float]] = {}
    for r in runs:
        for s, v in zip(r.val_steps, r.val_values, strict=True):
            if np.isfinite(v):
                by_step.setdefault(float(s), []).append(100 * float(v))
    steps = np.array(sorted(by_step))
    vals = [np.array(by_step[s]) for s in steps]
    return (steps, np.array([v.mean() for v in vals]), np.array([v.min() for v in vals]),
            np.array([v.max() for v in vals]))


def fig_curves(summary: SweepSummary) -> Figure:
    """Validation success vs step, one line per point, seeds as a min–max band."""
    fig = new_figure(8.5, 5.0)
    ax = fig.add_subplot()
    stopped = False
    for i, p in enumerate(summary.points):
        steps, mean, lo, hi = _curve(p.runs)
        if not len(steps):
            continue
        color = f"C{i % 10}"
        ax.plot(steps, mean, "-o", ms=3, lw=1.6, color=color, label=f"{p.label} (n={len(p.runs)})")
        if len(p.runs) > 1:
            ax.fill_between(steps, lo, hi, color=color, alpha=0.18, lw=0)
        for r in p.runs:
            fin = np.isfinite(r.val_values)
            if r.state == "early_stopped" and fin.any():
                ax.plot(r.val_steps[fin][-1], 100 * r.val_values[fin][-1], **STOP_STYLE)
                stopped = True
    handles, labels = ax.get_legend_handles_labels()
    if stopped:
        handles.append(Line2D([], [], **STOP_STYLE))
        labels.append("early stop (failed regime)")
    if handles:
        ax.legend(handles, labels, fontsize=8, ncols=2 if len(handles) > 8 else 1)
    else:
        note(ax, "no validation was logged")
    ax.set_xlabel("step")
    ax.set_ylabel(f"{summary.metric} (%)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.set_title(f"sweep {summary.name}: validation success (line: mean over seeds, band: min–max)", fontsize=10)
    return fig


def fig_value(summary: SweepSummary) -> Figure:
    """Final validation success per point: mean ± std, every seed, early stops marked as failed regimes."""
    n = len(summary.points)
    fig = new_figure(max(5.5, 1.0 + 0.9 * n), 4.8)
    ax = fig.add_subplot()
    seen = set()

    def dot(x, y, kind, **style):
        ax.plot(x, y, label=None if kind in seen else kind, **style)
        seen.add(kind)

    for i, p in enumerate(summary.points):
        mean, std = p.stat("final")
        if np.isfinite(mean):
            ax.errorbar(i, 100 * mean, yerr=100 * std if np.isfinite(std) else None, fmt="s", color="k", ms=6,
                        capsize=5, lw=1.5, zorder=3, label=None if "mean" in seen else "mean ± std over seeds")
            seen.add("mean")
        offsets = 0.12 + np.linspace(0.0, 0.2, len(p.runs))  # seeds in order, right of the mean
        for off, r in zip(offsets, p.runs, strict=True):
            if not np.isfinite(r.final):
                continue
            if r.state == "completed":
                dot(i + off, 100 * r.final, "seed (completed)", marker="o", color="C0", ms=5, ls="none", alpha=0.8)
            elif r.state == "early_stopped":
                dot(i + off, 100 * r.final, "seed (early stop: failed regime)", **STOP_STYLE)
            else:
                dot(i + off, 100 * r.final, "seed (not finished)", marker="^", mfc="none", color="0.4", ms=6,
                    ls="none")
    ax.set_xticks(range(n), [p.label for p in summary.points], rotation=30 if n > 6 else 0)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_xlabel(", ".join(summary.keys) or "point")
    ax.set_ylabel(f"final {summary.metric} (%)")
    ax.grid(alpha=0.3, axis="y")
    if seen:
        ax.legend(fontsize=8)
    else:
        note(ax, "no validation was logged")
    ax.set_title(f"sweep {summary.name}: final validation success per point", fontsize=10)
    return fig


def _html_table(rows: list[list[str]], cells=None) -> str:
    """Rows (header first) as an HTML table; `cells(i, text, row)` may return a custom `<td>` for a cell."""
    head, *body = rows
    left = [' class="name"' if h in TEXT_COLUMNS else "" for h in head]
    out = ["<tr>" + "".join(f"<th{c}>{html.escape(h)}</th>" for c, h in zip(left, head, strict=True)) + "</tr>"]
    for row in body:
        tds = [cells(i, c, row) if cells else None for i, c in enumerate(row)]
        out.append("<tr>" + "".join(td or f"<td{cls}>{html.escape(c)}</td>"
                                    for cls, c, td in zip(left, row, tds, strict=True)) + "</tr>")
    return "<table>" + "".join(out) + "</table>"


def _link(path: str, text: str) -> str:
    return f'<a href="{html.escape(quote(path))}">{html.escape(text)}</a>'


def summary_html(summary: SweepSummary, curves: Figure, value: Figure) -> str:
    """`summary.html`: tables, figures, links to the runs' reports and logs, failed runs' log tails."""
    logs = {f"{r.label}/{r.seed}": r.log for p in summary.points for r in p.runs}

    def run_cell(i: int, cell: str, row: list[str]) -> str | None:
        if i != len(row) - 1:
            return None
        log = logs.get(f"{row[0]}/{row[1]}")
        links = [_link(cell, "report")] if cell else []
        links += [_link(log, "log")] if log else []
        return f"<td>{' · '.join(links) or '–'}</td>"

    failed = "".join(
        f'<div class="flag error"><span class="badge">{r.state}</span><b>{html.escape(r.rel)}</b><br>'
        f"{html.escape(failure_line(r))} ({_link(r.log, 'full log') if r.log else 'no log'})"
        f"<pre>{html.escape(chr(10).join(r.tail))}</pre></div>" for r in failed_runs(summary))
    parts = [
        f"<h1>Sweep {html.escape(summary.name)}</h1>",
        f'<p class="meta">{html.escape(intro(summary))}</p>',
        '<nav><a href="#points">Points</a><a href="#figures">Figures</a><a href="#runs">Runs</a>'
        + ('<a href="#failed">Failed runs</a>' if failed else "") + "</nav>",
        '<h2 id="points">Points</h2>', _html_table(point_rows(summary)),
        '<h2 id="figures">Figures</h2>',
        figure_html(curves, "Validation success vs step (line: mean over seeds, band: min–max; x: early stop)"),
        figure_html(value, "Final validation success per point (mean ± std; red x: early-stopped seed)"),
        '<h2 id="runs">Runs</h2>', _html_table(run_rows(summary), run_cell),
        f'<h2 id="failed">Failed runs</h2>{failed}' if failed else "",
    ]
    title = html.escape(f"rldynamics sweep — {summary.name}")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f"<style>{CSS}</style></head><body>{''.join(parts)}</body></html>\n")


def write_summary(out: str | Path, summary: SweepSummary | None = None) -> list[Path]:
    """Rebuild every summary file in OUT from its run directories (or the already collected `summary`);
    returns the written paths."""
    out = Path(out)
    summary = summary or collect(out)
    curves, value = fig_curves(summary), fig_value(summary)
    made = [csv_text(summary).encode(), markdown(summary).encode(), png_bytes(curves), png_bytes(value),
            summary_html(summary, curves, value).encode()]  # in the order of FILES
    for name, data in zip(FILES, made, strict=True):
        _replace(out / name, data)
    return [out / f for f in FILES]


def _replace(file: Path, data: bytes) -> None:
    """Write `file` through a temporary file renamed over it (removed when the write fails)."""
    tmp = file.with_name(f".{file.name}.tmp")
    try:
        tmp.write_bytes(data)
        tmp.replace(file)
    finally:
        tmp.unlink(missing_ok=True)
