"""Argument-parser-free entry points of `rldyn plot` and `rldyn report`: each returns an exit code.

Exit codes: 0 success, 2 bad input (missing run directory, unknown step, no analysis steps for --paper).
Errors go to stderr as one line naming what was wrong; results are listed on stdout.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from rldynamics import metric_names as names
from rldynamics.plots.analysis import write_paper_grid, write_step
from rldynamics.plots.collapse import fig_runs_mi_success, mode_of, write_collapse_figures
from rldynamics.plots.curves import write_curves
from rldynamics.plots.data import RunData, analysis_steps, load_run
from rldynamics.plots.figure import save_png
from rldynamics.plots.report import result_lines, write_report
from rldynamics.plots.reward_components import write_reward_component_figures
from rldynamics.plots.timeline import write_timeline

NO_STEPS = "No gradient-analysis steps found."


def _err(cmd: str, message: str) -> int:
    print(f"rldyn {cmd}: {message}", file=sys.stderr)
    return 2


def _load(cmd: str, run_dir: str | Path) -> RunData:
    run = load_run(run_dir)
    for w in run.warnings:
        print(f"rldyn {cmd}: warning: {run_dir}: {w}", file=sys.stderr)
    return run


def plot_command(run_dir: str | Path | Sequence[str | Path], steps: Sequence[int] | None = None,
                 list_steps: bool = False, out: str | Path | None = None, paper: bool = False,
                 paper_steps: Sequence[int] | None = None, list_files: bool = True) -> int:
    """`rldyn plot`: the health timeline, per-step gradient-analysis figures + training curves, or (`paper`) the
    multi-step grid.

    Args:
        run_dir: one run directory, or several with `paper`.
        steps: analysis steps to plot (default: all); with `paper`, used when `paper_steps` is not given.
        list_steps: print the analysis steps (one line) and exit.
        out: output directory (default `<first run dir>/plots`).
        paper: write `paper_grid.png` (rows = steps; every run that analysed a step is overlaid in its row).
        paper_steps: the grid's steps (default: every analysis step of the given runs).
        list_files: name every file written (else only their number and folder).
    """
    dirs = [run_dir] if isinstance(run_dir, (str, Path)) else list(run_dir)
    if not dirs:
        return _err("plot", "no run directory given")
    if len(dirs) > 1 and not paper:
        return _err("plot", f"{len(dirs)} run directories given; several are only accepted with --paper")
    try:
        runs = [_load("plot", d) for d in dirs]
    except (OSError, ValueError) as e:
        return _err("plot", str(e))
    out_dir = Path(out) if out is not None else Path(dirs[0]) / "plots"
    if list_steps:
        for run in runs:
            found = analysis_steps(run)
            prefix = f"{run.path}: " if len(runs) > 1 else ""
            print(prefix + (" ".join(map(str, found)) if found else NO_STEPS))
        return 0
    if paper:
        return _paper(runs, list(paper_steps or steps or []), out_dir)
    return _per_step(runs[0], list(steps) if steps else None, out_dir, list_files)


def _per_step(run: RunData, steps: list[int] | None, out_dir: Path, list_files: bool = True) -> int:
    available = analysis_steps(run)
    if steps is not None:
        unknown = [s for s in steps if s not in available]
        if unknown:
            avail = ", ".join(map(str, available)) if available else "none"
            return _err("plot", f"step(s) {', '.join(map(str, unknown))} are not gradient-analysis steps of "
                                f"{run.path} (available: {avail})")
    chosen = available if steps is None else [s for s in available if s in steps]
    try:
        written = write_timeline(run, out_dir)
        written += write_curves(run, out_dir, steps=chosen)
        for s in chosen:
            written += write_step(run, s, out_dir)
        written += write_reward_component_figures(run, out_dir, save_png, chosen if steps is not None else None)
        written += write_collapse_figures(run, out_dir)
    except OSError as e:
        return _err("plot", f"could not write to {out_dir}: {e}")
    if not available:
        print(f"{NO_STEPS} " + ("Wrote the training curves and the health timeline only." if written
                                 else "No known metrics to plot either."))
    print(f"wrote {len(written)} file(s) to {out_dir}" + (f" for analysis step(s) {', '.join(map(str, chosen))}"
                                                           if chosen else ""))
    for p in written if list_files else []:
        print(f"  {p.name}")
    return 0


def _paper(runs: list[RunData], steps: list[int], out_dir: Path) -> int:
    """`paper_grid.png` of the analysis steps and, when the runs have collapse metrics, `paper_mi_success.png`
    (validation success beside MI over steps, one colour per run)."""
    if not steps:
        steps = sorted({s for run in runs for s in analysis_steps(run)})
    collapse = any(mode_of(r) for r in runs)
    if not steps and not collapse:
        return _err("plot", f"--paper: no gradient-analysis steps or collapse metrics found in "
                            f"{', '.join(str(r.path) for r in runs)}")
    try:
        if steps:
            path = write_paper_grid(runs, steps, out_dir)
            print(f"wrote {path} (steps {', '.join(map(str, steps))})")
        if collapse:
            env = runs[0].config.get("env", {}).get("name", "sokoban") if isinstance(runs[0].config.get("env"),
                                                                                      dict) else "sokoban"
            out_dir.mkdir(parents=True, exist_ok=True)
            path = save_png(fig_runs_mi_success(runs, names.val_success(env)), out_dir / "paper_mi_success.png")
            print(f"wrote {path}")
    except ValueError as e:
        return _err("plot", f"--paper: {e}")
    except OSError as e:
        return _err("plot", f"could not write to {out_dir}: {e}")
    return 0


def report_command(run_dir: str | Path, out: str | Path | None = None, quiet: bool = False) -> int:
    """`rldyn report`: write the one-page HTML report (default `RUN_DIR/report.html`); `quiet`: without the line
    naming it."""
    try:
        path = write_report(_load("report", run_dir), out)
    except (OSError, ValueError) as e:
        return _err("report", str(e))
    if not quiet:
        print(f"wrote {path}")
    return 0


def result_command(run_dir: str | Path) -> None:
    """The lines a finished run ends with: validation start -> end, the health verdict, its report (if written)."""
    report = Path(run_dir) / "report.html"
    print("\n".join(result_lines(load_run(run_dir), report if report.is_file() else None)))
