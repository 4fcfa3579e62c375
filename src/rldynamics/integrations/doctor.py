"""`rldyn doctor PATH`: the health monitor's rules over a finished run's logs, with its events and
report.

PATH is one of:
- an rldynamics run directory (its metrics.jsonl and config.yaml): the rules run with the run's
  settings, so they give the alarms its own monitor wrote (exactly where each step made one
  optimizer step);
- TRL's `trainer_state.json` (its `log_history`), or a TRL output directory holding one (or
  checkpoints);
- a W&B or TensorBoard export: a CSV or JSONL file of scalars (W&B's history export: a `_step`
  column), or TensorBoard event files (a file, or a directory with one run's event files; read with
  tensorboard's EventAccumulator). Exports of rldynamics' own mirrors (`log.tensorboard=true`,
  `log.wandb=true`) carry rldynamics' names; exports of transformers' W&B / TensorBoard callbacks
  TRL's under `train/`.

Each source's names map to the monitor's signals by one table (`integrations/signals.py`); the rules
whose signals a source lacks cannot fire, and one line names them. Outputs go to `--out` (default
`PATH/doctor/`, or `doctor/` beside a file): `events.jsonl` (the monitor's rows) and
`health_report.html` (the report's Health section: verdict, timeline, events, glossary). On logs of
a run the monitor did not watch, an action other than record or warn is written as warn, with what
it would have done: the run is over.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rldynamics.analysis.health_events import Monitor
from rldynamics.analysis.health_rules import RULES
from rldynamics.config import HEALTH_ACTIONS, Config, HealthConfig, load_config, make_config
from rldynamics.integrations.signals import (
    HF_PREFIX,
    RLDYNAMICS,
    STEP_KEYS,
    TRL,
    Table,
    cannot_run_line,
    number,
    prefixed,
    signals_of,
    timeline_row,
    values_of,
)
from rldynamics.metric_names import parse_env_metric
from rldynamics.plots.data import RunData, load_events, load_run
from rldynamics.plots.report import HEALTH_REPORT, health_page
from rldynamics.plots.timeline import verdict
from rldynamics.tracking.files import write_file
from rldynamics.tracking.run_dir import EVENTS_FILE

OUT = "doctor"  # the default output directory, in PATH or beside it
TRAINER_STATE = "trainer_state.json"  # transformers' Trainer state, with TRL's logged metrics
TB_EVENTS = "events.out.tfevents."  # TensorBoard event files start so
# where in a directory they are looked for (transformers' callback writes runs/<name>/)
TB_DEPTHS = ("", "*/", "*/*/")
KINDS = ("an rldynamics run directory, TRL's trainer_state.json, a CSV / JSONL export or "
         "TensorBoard event files")
TABLES = {"rldynamics": RLDYNAMICS, "TRL": TRL,
          "TRL (transformers' callbacks)": prefixed(TRL, HF_PREFIX)}
POST_HOC = "the run is over"  # why doctor cannot act on a run its monitor did not watch


@dataclass
class Logs:
    """A finished run's logs: one row of metrics per logged step, in the source's names, and what
    the rules need to know of the run."""

    kind: str  # what was read, in words
    path: Path  # the file or directory read
    rows: list[dict[str, Any]]  # sorted by step, each with its "step"
    table: Table
    total_steps: int  # the run's steps (progress = step / total_steps)
    health: HealthConfig
    watched: bool = False  # the run's own monitor acted on its rules (its actions stand)
    env: str = ""
    val_count: int = 0  # trajectories of a validation
    train_count: int = 0  # trajectories of a step's rollout
    sampler_is_trainer: bool = True
    run_dir: Path | None = None  # an rldynamics run directory (its samples go with the events)


@dataclass
class Diagnosis:
    """What the rules said over the logs."""

    events: list[dict] = field(default_factory=list)  # events.jsonl rows
    # the rows in rldynamics' names, with each rule's health/<rule> flag
    rows: list[dict[str, Any]] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)  # quantities logged at least once
    cannot: str = ""  # the line naming the rules that cannot run


def health_only(overrides: list[str]) -> None:
    """Refuse a setting other than `health.*` (ValueError naming it)."""
    other = [o for o in overrides if not o.startswith("health.")]
    if other:
        raise ValueError(f"{other[0]}: doctor takes health.* settings only "
                         "(e.g. health.entropy_collapse_ratio=0.2)")


def health_settings(base: Config | None, overrides: list[str]) -> Config:
    """The settings of the rules: `base` (a run's) or the defaults, with `health.*` overrides."""
    health_only(overrides)
    return make_config(None, overrides=overrides, base=base)


def read_logs(path: Path, overrides: list[str] = ()) -> Logs:
    """The logs at `path` (see the module's docstring); ValueError or FileNotFoundError in one line
    when it is none of them."""
    overrides, suffix = list(overrides), path.suffix.lower()
    health_only(overrides)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.is_dir():
        return _read_dir(path, overrides)
    if path.name == TRAINER_STATE or (suffix == ".json" and "log_history" in _json(path)):
        return read_trainer_state(path, overrides)
    if path.name.startswith(TB_EVENTS):
        return _export(path, _tensorboard_rows(path), "TensorBoard event file", overrides)
    if path.name == "metrics.jsonl" and (path.parent / "config.yaml").is_file():
        return read_run_dir(path.parent, overrides)
    if suffix == ".csv":
        return _export(path, _csv_rows(path), "CSV export", overrides)
    if suffix == ".jsonl":
        return _export(path, _jsonl_rows(path), "JSONL export", overrides)
    raise ValueError(f"{path}: not a file doctor reads ({KINDS})")


def _read_dir(path: Path, overrides: list[str]) -> Logs:
    if (path / "metrics.jsonl").is_file():
        return read_run_dir(path, overrides)
    states = [path / TRAINER_STATE] if (path / TRAINER_STATE).is_file() else sorted(
        path.glob(f"checkpoint-*/{TRAINER_STATE}"), key=lambda p: _checkpoint_number(p.parent))
    if states:
        return read_trainer_state(states[-1], overrides)
    runs = sorted({f.parent for depth in TB_DEPTHS for f in path.glob(depth + TB_EVENTS + "*")})
    if len(runs) > 1:
        listed = ", ".join(str(r.relative_to(path)) for r in runs[:5])
        raise ValueError(f"{path} holds TensorBoard runs in {len(runs)} directories ({listed}); "
                         "name one")
    if runs:
        return _export(runs[0], _tensorboard_rows(runs[0]), "TensorBoard log directory", overrides)
    raise ValueError(f"{path} is none of: {KINDS} (no metrics.jsonl, {TRAINER_STATE} or "
                     f"{TB_EVENTS}* in it)")


def _checkpoint_number(directory: Path) -> int:
    tail = directory.name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def read_run_dir(path: Path, overrides: list[str]) -> Logs:
    """An rldynamics run directory: its rows and its settings (config.yaml)."""
    run = load_run(path)
    cfg = health_settings(load_config(path / "config.yaml"), overrides)
    return _rldynamics_logs(path, "rldynamics run directory", run.rows, cfg, run_dir=path)


def _rldynamics_logs(path: Path, kind: str, rows: list[dict], cfg: Config,
                     run_dir: Path | None = None) -> Logs:
    """Logs in rldynamics' names, read with the run's settings."""
    return Logs(kind=kind, path=path, rows=rows, table=RLDYNAMICS, total_steps=cfg.train.steps,
                health=cfg.health, watched=cfg.health.enabled, env=cfg.env.name,
                val_count=cfg.val.env_groups * cfg.val.group_size,
                train_count=cfg.train.env_groups * cfg.train.group_size,
                sampler_is_trainer=cfg.rollout.engine == "hf", run_dir=run_dir)


def read_trainer_state(path: Path, overrides: list[str]) -> Logs:
    """TRL's trainer_state.json: `log_history` (a row per logged step) and `max_steps`."""
    state = _json(path)
    history = state.get("log_history")
    if not isinstance(history, list):
        raise ValueError(f"{path}: no log_history list: not a transformers trainer_state.json")
    rows = _by_step([r for r in history if isinstance(r, dict)], ("step",))
    steps = state.get("max_steps") if isinstance(state.get("max_steps"), int) else None
    cfg = health_settings(None, overrides)
    return Logs(kind="TRL trainer_state.json", path=path, rows=rows, table=TRL,
                total_steps=steps or _last_step(rows), health=cfg.health)


def _export(path: Path, rows: list[dict], kind: str, overrides: list[str]) -> Logs:
    """An export: the table whose names it holds most; the settings of the rldynamics run it sits
    in, if any."""
    if not rows:
        raise ValueError(f"{path}: no rows with a step ({', '.join(STEP_KEYS)}) in this {kind}")
    table_name, table = _best_table(path, rows)
    run = _run_around(path)
    if table is RLDYNAMICS and run is not None:
        cfg = health_settings(load_config(run / "config.yaml"), overrides)
        return _rldynamics_logs(path, f"{kind} of the rldynamics run {run}", rows, cfg, run_dir=run)
    cfg = health_settings(None, overrides)
    return Logs(kind=f"{kind} ({table_name} names)", path=path, rows=rows, table=table,
                total_steps=_last_step(rows), health=cfg.health, env=_env_of(rows))


def _best_table(path: Path, rows: list[dict]) -> tuple[str, Table]:
    """The table of `TABLES` with the most of its quantities among the export's names."""
    every = {k: 0.0 for r in rows for k in r}  # a row holding every name of the export
    hits = {name: len(values_of(every, table, _env_of(rows))) for name, table in TABLES.items()}
    best = max(hits, key=hits.get)
    if hits[best] == 0:
        raise ValueError(f"{path}: none of the metric names the health rules read "
                         "(rldynamics' or TRL's) "
                         "are in it")
    return best, TABLES[best]


def _run_around(path: Path) -> Path | None:
    """The rldynamics run directory `path` lies in (our TensorBoard mirror writes RUN/tensorboard/),
    if any."""
    for directory in [path, *path.parents][:3]:
        if (directory / "config.yaml").is_file() and (directory / "metrics.jsonl").is_file():
            return directory
    return None


def _env_of(rows: list[dict]) -> str:
    """The environment of rldynamics' `val-env/<env>/...` names in an export without its run's
    settings."""
    for row in rows:
        for key in row:
            parsed = parse_env_metric(key)
            if parsed is not None and parsed[0]:
                return parsed[1]
    return ""


def _last_step(rows: list[dict]) -> int:
    return max(int(r["step"]) for r in rows)


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e.__class__.__name__})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data


def _by_step(records: list[dict], step_keys: tuple[str, ...] = STEP_KEYS) -> list[dict]:
    """One row per whole step, sorted: the records of a step merged, a later value winning (a
    missing one, None or an empty cell, is no value)."""
    rows: dict[int, dict] = {}
    for record in records:
        found = [number(record.get(k)) for k in step_keys]
        step = next((s for s in found if s is not None), None)
        if step is None or step != int(step):
            continue
        logged = {k: v for k, v in record.items() if v is not None}
        rows.setdefault(int(step), {}).update(logged, step=int(step))
    return [rows[s] for s in sorted(rows)]


def _csv_rows(path: Path) -> list[dict]:
    """The rows of a CSV export; an empty cell is a metric not logged in that row."""
    with open(path, newline="", encoding="utf-8") as f:
        records = [{k: _cell(v) for k, v in r.items() if k is not None} for r in csv.DictReader(f)]
    return _by_step(records)


def _cell(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "") else None
    except ValueError:
        return None


def _jsonl_rows(path: Path) -> list[dict]:
    records = []
    for number_, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError:
                raise ValueError(f"{path}: line {number_} is not JSON") from None
    return _by_step([r for r in records if isinstance(r, dict)])


def _tensorboard_rows(path: Path) -> list[dict]:
    """The scalars of one TensorBoard run (an event file or a directory of them), a row a step."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise ImportError("reading TensorBoard event files needs the tensorboard package: "
                          "pip install tensorboard") from None
    events = EventAccumulator(str(path), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    records = [{"step": e.step, tag: e.value} for tag in tags for e in events.Scalars(tag)]
    return _by_step(records)


def actions(cfg: HealthConfig, can: tuple[str, ...],
            why: dict[str, str]) -> dict[str, tuple[str, str]]:
    """rule -> (the action written, a note): the configured action where it can be carried out, else
    warn with the configured action and `why[action]` it cannot be."""
    out = {}
    for rule in RULES:
        action = getattr(cfg, rule)
        out[rule] = (action, "") if action in can else (
            "warn", f"health.{rule}={action} cannot act here ({why[action]}); warned instead")
    return out


def diagnose(logs: Logs) -> Diagnosis:
    """The rules over the logs, step by step, as the trainer's monitor runs them."""
    can = HEALTH_ACTIONS if logs.watched else ("record", "warn")
    why = dict.fromkeys(HEALTH_ACTIONS, POST_HOC)
    monitor = Monitor(logs.health, actions(logs.health, can, why))
    out = Diagnosis()
    for row in logs.rows:
        step = int(row["step"])
        v = values_of(row, logs.table, logs.env)
        out.seen |= set(v)
        x = signals_of(step, v, step / logs.total_steps, logs.val_count, logs.sampler_is_trainer,
                       logs.train_count)
        if step == 0:  # the validation before training
            if x.val_success is not None:
                monitor.before_training(x)
            out.rows.append(timeline_row(step, v, {}, logs.env))
            continue
        said = monitor.step(x)
        out.events += said.rows
        out.rows.append(timeline_row(step, v, said.flags, logs.env))
    out.cannot = cannot_run_line(out.seen)
    return out


def write_health(out: Path, name: str, rows: list[dict], events: list[dict], notes: list[str],
                 run_dir: Path | None = None) -> RunData:
    """Write `events.jsonl` and `health_report.html` into `out`; returns the run as the report read
    it."""
    out.mkdir(parents=True, exist_ok=True)
    write_file(out / EVENTS_FILE, "".join(json.dumps(e) + "\n" for e in events))
    warnings: list[str] = []
    run = RunData(path=run_dir or out, rows=rows, config={"log": {"name": name}},
                  events=load_events(out, warnings), warnings=warnings)
    write_file(out / HEALTH_REPORT, health_page(run, notes))
    return run


def default_out(path: Path) -> Path:
    return path / OUT if path.is_dir() else path.parent / OUT


def doctor(path: str | Path, out: str | Path | None = None, overrides: list[str] = ()) -> list[str]:
    """Read the logs at `path`, run the rules, write events.jsonl and the health report into `out`;
    returns the console lines (what was read, the verdict, what cannot run, where the files are)."""
    path = Path(path)
    logs = read_logs(path, list(overrides))
    found = diagnose(logs)
    target = Path(out) if out is not None else default_out(path)
    read = f"read {logs.kind} {logs.path} ({len(logs.rows)} logged steps)"
    name = (logs.run_dir or (path if path.is_dir() else path.parent)).resolve().name
    run = write_health(target, name, found.rows, found.events, [read, found.cannot], logs.run_dir)
    return [read, f"health: {verdict(run).text}", found.cannot, f"events: {target / EVENTS_FILE}",
            f"report: {target / HEALTH_REPORT}"]
