"""What a sweep's run directory says about its run: layout, outcome, status record, log tail.

A sweep directory holds one run directory per (point, seed), written by the normal trainer:

    OUT/.lock                        held by the sweep running in OUT (one sweep at a time)
    OUT/plan.json                    every (point, seed) a sweep into OUT has planned, so none goes unnoticed
    OUT/<label>/seed<s>/             config.yaml, metrics.jsonl, checkpoints/, report.html (the trainer's)
    OUT/<label>/seed<s>/train.log    stdout and stderr of every attempt (`rldyn train ...`)
    OUT/<label>/seed<s>/sweep.json   the point (label, value, overrides, order) and the launcher's record
                                     of the last attempt (state, exit code, error line, slot, wall seconds); no timestamps
    OUT/<label>/seed<s>.restarted-<k>/  an attempt stopped before its first checkpoint (or damaged), kept aside

Outcomes are decided from these files alone, metrics first: a run is `damaged` when its directory cannot be
trusted (metrics.jsonl not a file, rows without config.yaml, a step logged twice or out of order or skipped, or
an exit code 0 with metrics that stop short), `early_stopped` when a row carries `early_stopped/<reason>`,
`completed` when its last metrics row reached `train.steps` (with the detail `never updated: <why>` when no step
updated the actor, e.g. the filter kept no group at any step); otherwise the launcher's record says `failed`
(non-zero exit), `interrupted` (stopped by the sweep) or the run is `unfinished`. A run in plan.json without a
run directory is `missing`. This module imports no torch.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rldynamics import metric_names as names
from rldynamics.plots.data import RunData, as_float, early_stops, load_run
from rldynamics.sweep.plan_types import SweepPlan
from rldynamics.tracking.run_dir import read_config, row_step

STATUS_FILE = "sweep.json"
PLAN_FILE = "plan.json"
LOG_FILE = "train.log"
FINISHED = ("completed", "early_stopped")
_SEED_DIR = re.compile(r"seed(\d+)")


def run_dir(out: Path, label: str, seed: int) -> Path:
    """`OUT/<label>/seed<seed>`."""
    return out / label / f"seed{seed}"


def find_runs(out: str | Path) -> list[Path]:
    """Every `OUT/<label>/seed<s>` directory that holds a run (config.yaml, metrics or a sweep record)."""
    out = Path(out)
    found = []
    for point in sorted(p for p in out.iterdir() if p.is_dir()) if out.is_dir() else []:
        for d in sorted(point.iterdir()):
            if d.is_dir() and _SEED_DIR.fullmatch(d.name) and any(
                    (d / f).exists() for f in ("config.yaml", "metrics.jsonl", STATUS_FILE)):
                found.append(d)
    return found


def seed_of(path: Path) -> int:
    """The seed of a `seed<s>` run directory."""
    return int(_SEED_DIR.fullmatch(path.name).group(1))


def read_status(path: Path) -> dict[str, Any]:
    """The run's `sweep.json` (empty when absent or unreadable)."""
    try:
        data = json.loads((path / STATUS_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def write_status(path: Path, **fields: Any) -> dict[str, Any]:
    """Merge `fields` into the run's `sweep.json` (written atomically) and return the record."""
    status = {**read_status(path), **fields}
    path.mkdir(parents=True, exist_ok=True)
    _write_json(path / STATUS_FILE, status)
    return status


def _write_json(file: Path, data: Any) -> None:
    """`data` as JSON through a temporary file renamed over `file` (a kill keeps the old file or the new one)."""
    tmp = file.with_name(f".{file.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(file)


def planned_runs(out: str | Path) -> list[dict[str, Any]]:
    """The runs of `OUT/plan.json` (`point`, `value`, `index`, `seed`; none when absent or unreadable)."""
    try:
        data = json.loads((Path(out) / PLAN_FILE).read_text())
    except (OSError, ValueError):
        return []
    entries = data.get("runs") if isinstance(data, dict) else None
    return [e for e in entries if isinstance(e, dict) and isinstance(e.get("point"), str)
            and isinstance(e.get("seed"), int)] if isinstance(entries, list) else []


def record_runs(plan: SweepPlan) -> None:
    """Add the plan's runs to `OUT/plan.json`, so a summary names a planned run whose directory is gone."""
    entries = {(e["point"], e["seed"]): e for e in planned_runs(plan.out)}
    for r in plan.runs:
        entries[r.point.label, r.seed] = {"point": r.point.label, "value": r.point.value, "index": r.index,
                                          "seed": r.seed}
    plan.out.mkdir(parents=True, exist_ok=True)
    _write_json(plan.out / PLAN_FILE, {"runs": list(entries.values())})


def log_tail(path: Path, lines: int = 20) -> list[str]:
    """The last non-empty lines of the run's `train.log`."""
    try:
        text = (path / LOG_FILE).read_text(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]


def has_checkpoint(path: Path) -> bool:
    """True when the run has a completed checkpoint to resume from."""
    return any((path / "checkpoints").glob("step_*"))


def val_key(run: RunData) -> str:
    """`val-env/<env.name>/success` of the run."""
    env = run.config.get("env") if isinstance(run.config.get("env"), dict) else {}
    return names.val_success(env.get("name", "sokoban"))


@dataclass
class Outcome:
    """A run's outcome from its directory: state, detail (early-stop reason or error line), last step."""

    state: str
    detail: str = ""
    step: int | None = None
    steps: int | None = None
    val_success: float = float("nan")


def load(path: Path) -> RunData:
    """The run's metrics and config (no rows when it has not logged yet, or metrics.jsonl is no file)."""
    if (path / "metrics.jsonl").is_file():
        return load_run(path)
    run = RunData(path=path, rows=[])
    try:
        loaded = read_config(path)
    except (OSError, yaml.YAMLError):  # not written yet, or half-written by a run being set up
        loaded = None
    run.config = loaded if isinstance(loaded, dict) else {}
    return run


def damage(path: Path, run: RunData) -> str:
    """Why the run directory cannot be trusted, in words ("" when it can): metrics.jsonl that is not a file, rows
    without a readable config.yaml, or rows that are not every step once and in order (two writers of one run,
    rows lost). A cut last line (a kill during a write) is no damage: readers and resumes ignore it."""
    metrics = path / "metrics.jsonl"
    if not metrics.exists():
        return ""
    if not metrics.is_file():
        return "metrics.jsonl is not a file"
    lines = [line for line in metrics.read_bytes().splitlines() if line.strip()]
    steps = [row_step(line) for line in lines]
    if None in steps[:-1]:
        return f"metrics.jsonl line {steps.index(None) + 1} is not a JSON row with a step"
    steps = [n for n in steps if n is not None]
    if steps and not run.config:
        return "config.yaml is missing" if not (path / "config.yaml").is_file() else "config.yaml cannot be read"
    for before, n in zip(steps, steps[1:]):  # the rows before are steps[0] .. before, each once
        if steps[0] <= n <= before:
            return f"metrics.jsonl logs step {n} twice"
        if n != before + 1:
            return f"metrics.jsonl logs step {n} after step {before}"
    return ""


def outcome(path: Path, run: RunData | None = None) -> Outcome:
    """The outcome of the run in `path` (see the module docstring for the rules)."""
    run = run if run is not None else load(path)
    status = read_status(path)
    train = run.config.get("train") if isinstance(run.config.get("train"), dict) else {}
    steps = train.get("steps")
    last = run.rows[-1]["step"] if run.rows else None
    vals = [as_float(r[val_key(run)]) for r in run.rows if val_key(run) in r]
    found = Outcome("unfinished", step=last, steps=steps, val_success=vals[-1] if vals else float("nan"))
    stops = early_stops(run)
    broken = damage(path, run)
    if broken:
        found.state, found.detail = "damaged", broken
    elif stops:
        found.state, found.detail = "early_stopped", stops[0][1]
    elif (last is not None and steps is not None and last >= steps) or (
            run.rows and run.rows[-1].get(names.EXITED_AFTER_ANALYSIS)):
        found.state, found.detail = "completed", never_updated(run.rows)
    elif status.get("returncode") == 0:
        found.state = "damaged"
        found.detail = (f"metrics.jsonl ends at step {last} of {steps}" if run.rows else "no metrics were logged"
                        ) + ", though the trainer exited 0"
    elif status.get("state") in ("failed", "interrupted"):
        found.state, found.detail = status["state"], str(status.get("error", ""))
    elif not run.rows and not status:
        found.state = "pending"
    return found


def never_updated(rows: list[dict[str, Any]]) -> str:
    """Why a run's actor was never updated, in words ("" when some step updated it): the filter kept no group at any
    step, the critic's warm-up covered every step, or no step reached the actor update."""
    steps = [r for r in rows if r.get("step", 0) >= 1]
    if not steps or any(names.PG_LOSS in r for r in steps):  # logged by every actor update
        return ""
    if all(as_float(r.get(names.EMPTY_AFTER_FILTER, 0)) == 1 for r in steps):
        return "never updated: the filter kept no group at any step"
    if all(as_float(r.get(names.CRITIC_WARMUP, 0)) == 1 for r in steps):
        return "never updated: the critic warm-up (critic.warmup_steps) covered every step"
    return "never updated: no step reached the actor update"
