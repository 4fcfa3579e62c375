"""Argument-parser-free entry points of `rldyn sweep` and `rldyn sweep --summarize`; each returns an exit code.

Exit codes: 0 every run finished (completed or early-stopped), 1 some run failed, is damaged, missing or did
not finish, or the summary could not be written, 2 bad input or OUT in use (nothing was started), 130
interrupted (re-run the same command to resume).
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rldynamics.config import ConfigError
from rldynamics.sweep import protocols
from rldynamics.sweep.launch import Launcher, cpu_count, make_slots, sweep_lock
from rldynamics.sweep.plan import build_plan, check_free
from rldynamics.sweep.plan_types import SweepPlan
from rldynamics.sweep.protocols import SweepError
from rldynamics.sweep.report import write_summary
from rldynamics.sweep.runs import FINISHED, record_runs
from rldynamics.sweep.summary import TEXT_COLUMNS, RunResult, SweepSummary, collect, point_rows

ACTION_WORDS = {"start": "to start", "resume": "to resume from a checkpoint",
                "restart": "to restart (stopped before a checkpoint, or damaged)", "skip": "finished (skipped)"}


def _console() -> Console:
    """Soft-wrapped lines; tables 160 wide when the output is a file (rich's default there is 80)."""
    console = Console(soft_wrap=True)
    return console if console.is_terminal else Console(soft_wrap=True, width=160)


def default_out(name: str, keys: list[str], preset: str, exclude_zero: bool) -> str:
    """`sweeps/<name>-<preset>` (`custom-<keys>`, `-filter_zero` for --exclude-zero as in RAGEN's scripts)."""
    label = f"custom-{'-'.join(k.rsplit('.', 1)[-1] for k in keys)}" if name == "custom" else name
    return f"sweeps/{label}{'-filter_zero' if exclude_zero else ''}-{preset}"


def parse_seeds(text: str) -> list[int]:
    """`"0,1,2"` -> `[0, 1, 2]`."""
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SweepError(f"--seeds {text!r}: give comma-separated integers, e.g. --seeds 0,1,2") from None


def print_plan(plan: SweepPlan, slots, console: Console) -> None:
    """The runs, the slots and the resolved override set of every point, before anything starts."""
    n_points, n_seeds = len(plan.protocol.points), len(plan.seeds)
    console.print(f"[bold]sweep {plan.protocol.name}[/]: {n_points} point(s) x {n_seeds} seed(s) "
                  f"({', '.join(map(str, plan.seeds))}) = {len(plan.runs)} run(s) -> {plan.out}")
    where = ", ".join(s.name for s in slots)
    threads = slots[0].env.get("OMP_NUM_THREADS", "?")
    console.print(f"preset {plan.preset}{f' + {plan.config_file}' if plan.config_file else ''}; {len(slots)} run(s) "
                  f"at a time ({where}), {threads} CPU thread(s) each ({cpu_count()} core(s) here)")
    for label, overrides in plan.point_overrides.items():
        console.print(f"  [bold]{label}[/]: {' '.join(overrides)}", soft_wrap=True)
    if plan.checkpointing:
        console.print(f"{' '.join(plan.checkpointing)}: added by the sweep so that an interrupted sweep resumes each "
                      "run from its newest checkpoint, keeping only that one; set checkpoint.every / "
                      "checkpoint.keep_last to choose otherwise", soft_wrap=True)
    counts = {a: sum(r.action == a for r in plan.runs) for a in ACTION_WORDS}
    console.print("runs: " + ", ".join(f"{n} {ACTION_WORDS[a]}" for a, n in counts.items() if n))


def points_table(summary: SweepSummary, out: Path) -> Table:
    """The summary's point table for the console."""
    rows = point_rows(summary)
    table = Table(title=f"summary ({out / 'summary.md'})", title_justify="left")
    for h in rows[0]:
        table.add_column(h, justify="left" if h in TEXT_COLUMNS else "right")
    for row in rows[1:]:
        table.add_row(*row)
    return table


def sweep_command(name: str, items: list[str], values: list[str] | None = None, seeds: str = "0",
                  parallel: int | None = None, devices: str | None = None, devices_per_run: int = 1,
                  preset: str = "sokoban-tiny", config_file: str | None = None, out: str | None = None,
                  exclude_zero: bool = False, dry_run: bool = False) -> int:
    """`rldyn sweep NAME [KEY ...] [key=value ...]`: plan (validated), lock OUT, run, summarise."""
    console = _console()
    keys = [x for x in items if "=" not in x]
    overrides = [x for x in items if "=" in x]
    with ExitStack() as held:
        try:
            protocol = protocols.expand(name, [protocols.split_values(v) for v in values or []], keys, exclude_zero)
            slots = make_slots(parallel, devices.split(",") if devices else None, devices_per_run)

            def make_plan() -> SweepPlan:
                return build_plan(protocol, parse_seeds(seeds), out or default_out(name, keys, preset, exclude_zero),
                                  preset, config_file, overrides)

            plan = make_plan()  # bad input fails here, before OUT is created
            if not dry_run:
                held.enter_context(sweep_lock(plan.out))
                plan = make_plan()  # again, from what OUT holds now that no other sweep can change it
                check_free(plan)
                record_runs(plan)
        except ConfigError as e:
            print(f"rldyn sweep: config error: {e}", file=sys.stderr)
            return 2
        except (SweepError, OSError) as e:
            print(f"rldyn sweep: {e}", file=sys.stderr)
            return 2
        print_plan(plan, slots, console)
        if dry_run:
            return 0
        jobs = Launcher(plan, slots, console).run()
        if any(j.state == "interrupted" for j in jobs):
            console.print(f"[magenta]interrupted[/]: re-run the same command to resume; "
                          f"`rldyn sweep --summarize {plan.out}` summarises what is there")
            return 130
        return _summarize(collect(plan.out), plan.out, console)


def _summarize(summary: SweepSummary, out: Path, console: Console) -> int:
    console.print(points_table(summary, out))
    try:
        written = write_summary(out, summary)
    except OSError as e:
        print(f"rldyn sweep: cannot write the summary in {out} ({e.strerror or e}); the run directories and the "
              f"summary files already there are intact: make room, then run `rldyn sweep --summarize {out}`",
              file=sys.stderr)
        return 1
    console.print(f"wrote {', '.join(p.name for p in written)} in {out}")
    unfinished = [r for p in summary.points for r in p.runs if r.state not in FINISHED]
    if unfinished:
        console.print(f"[red]{len(unfinished)} run(s) did not finish[/]: "
                      f"{', '.join(_said(r) for r in unfinished)} (see summary.md)")
        return 1
    return 0


def _said(r: RunResult) -> str:
    """`a/seed1 (failed)`, with the reason where the state alone does not say it: `(damaged: config.yaml is ...)`."""
    return f"{r.rel} ({r.state}: {r.detail})" if r.state in ("damaged", "missing") else f"{r.rel} ({r.state})"


def summarize_command(out: str) -> int:
    """`rldyn sweep --summarize OUT`: rebuild the summary files from the run directories alone."""
    path = Path(out)
    try:
        summary = collect(path)
    except (FileNotFoundError, NotADirectoryError) as e:
        print(f"rldyn sweep: {e}", file=sys.stderr)
        return 2
    return _summarize(summary, path, _console())
