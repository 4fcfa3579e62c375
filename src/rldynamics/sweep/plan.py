"""A sweep's plan: every (point, seed) run with the exact `rldyn train` overrides it gets, validated, and what
to do with it given what its run directory already holds (start, resume, restart, or skip as finished).

Nothing is written here: a bad key or value, a clash with the sweep's own settings, a run directory that
holds a run with other settings or one that a live process writes fails before any run starts. This module
imports no torch.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from rldynamics.config import ConfigError, make_config, parse_overrides, to_dict
from rldynamics.sweep import runs
from rldynamics.sweep.plan_types import RunPlan, SweepPlan
from rldynamics.sweep.protocols import Protocol, SweepError
from rldynamics.tracking.run_dir import RunInUse, RunLock, read_config

MANAGED = {"seed": "--seeds", "log.run_dir": "--out", "log.name": "--out", "checkpoint.resume": "re-running the sweep"}
IGNORED_WHEN_COMPARING = ("log.run_dir", "log.name", "checkpoint.resume")


def _keys(overrides: list[str]) -> list[str]:
    """Dotted keys of `key=value` overrides."""
    return list(_flat(parse_overrides(overrides)))


def _check_user_overrides(protocol: Protocol, overrides: list[str]) -> None:
    for key in protocol.keys:
        if key in MANAGED:
            raise SweepError(f"{key} cannot be swept: the sweep sets it for every run; use {MANAGED[key]} instead")
    for key in _keys(overrides):
        if key in protocol.keys:
            raise SweepError(f"{key} is swept by `{protocol.name}`; give its values with --values instead of {key}=...")
        if key in MANAGED:
            raise SweepError(f"{key} is set by the sweep for every run; use {MANAGED[key]} instead")


def _checkpoint_overrides(cfg, user_keys: list[str]) -> list[str]:
    """Checkpoint every validation (so an interrupted run resumes near where it stopped), keeping only the
    newest, unless the preset or the user chose checkpoint settings."""
    out = []
    if "checkpoint.every" not in user_keys and cfg.checkpoint.every == 0:
        every = cfg.val.every if 0 < cfg.val.every < cfg.train.steps else max(1, cfg.train.steps // 10)
        out.append(f"checkpoint.every={every}")
    if "checkpoint.keep_last" not in user_keys and cfg.checkpoint.keep_last == 0:
        out.append("checkpoint.keep_last=1")
    return out


def _config(preset: str, config_file: str | None, overrides: list[str], where: str):
    try:
        return make_config(preset, config_file, overrides)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _check_same_settings(path: Path, cfg) -> None:
    """Refuse to resume or skip a run directory whose saved config differs from the planned one."""
    if not (path / "config.yaml").exists():
        return
    try:
        saved = _flat(read_config(path) or {})
    except (OSError, yaml.YAMLError) as e:
        raise SweepError(f"{path}/config.yaml cannot be read ({e.__class__.__name__}); move the directory away") from e
    planned = _flat(to_dict(cfg))
    diff = [k for k in sorted(set(saved) | set(planned)) if k not in IGNORED_WHEN_COMPARING
            and saved.get(k) != planned.get(k)]
    if diff:
        shown = ", ".join(f"{k}: {saved.get(k)!r} there, {planned.get(k)!r} now" for k in diff[:3])
        raise SweepError(f"{path} holds a run with other settings ({shown}); use another --out or move it away")


def _action(path: Path) -> str:
    """skip a finished run; resume one with a checkpoint; restart (keeping the old attempt aside) one without, or a
    damaged one (a resume would keep its rows, or fail on its missing config.yaml); start where nothing ran."""
    state = runs.outcome(path).state
    if state in runs.FINISHED:
        return "skip"
    if state != "damaged" and runs.has_checkpoint(path):
        return "resume"
    return "restart" if (path / "metrics.jsonl").exists() else "start"


def _check_out(out: Path) -> None:
    """Refuse an --out that is a file, or lies under one."""
    found = next(p for p in (out, *out.parents) if p.exists())
    if not found.is_dir():
        where = "" if found == out else f" lies under {found}, which"
        raise SweepError(f"--out {out}{where} is a file; give a directory (it is created when missing)")


def _check_run_path(path: Path) -> None:
    for p in (path.parent, path):
        if p.exists() and not p.is_dir():
            raise SweepError(f"{p} is a file where the sweep keeps a run directory; move it away or use another --out")


def check_free(plan: SweepPlan) -> None:
    """Refuse a run whose lock a live process holds (its trainer outlived a killed sweep, or it was started by hand):
    moving it aside or resuming it would give the run two writers."""
    for r in plan.runs:
        if r.action == "skip":
            continue
        try:
            RunLock(r.path).check()
        except RunInUse as e:
            raise SweepError(f"{r.path} is in use by {e.holder}; wait for that process to end (or stop it), "
                             "then run the sweep again") from None


def build_plan(protocol: Protocol, seeds: list[int], out: str | Path, preset: str = "sokoban-tiny",
               config_file: str | None = None, overrides: list[str] | None = None) -> SweepPlan:
    """Validate every run's config and decide each run's action; raises ConfigError / SweepError on bad input."""
    overrides = list(overrides or [])
    if not seeds:
        raise SweepError("--seeds is empty; give at least one seed, e.g. --seeds 0,1,2")
    if len(set(seeds)) != len(seeds):
        raise SweepError(f"--seeds has a seed twice: {seeds}")
    _check_user_overrides(protocol, overrides)
    out = Path(out).resolve()
    _check_out(out)
    user_keys = _keys(overrides)
    plans, point_overrides, added = [], {}, []
    for index, point in enumerate(protocol.points):
        base = [*point.overrides, *overrides]
        cfg = _config(preset, config_file, base, f"point {point.label}")
        added = _checkpoint_overrides(cfg, user_keys)
        base += added
        point_overrides[point.label] = base
        for seed in seeds:
            path = runs.run_dir(out, point.label, seed)
            _check_run_path(path)
            plan = RunPlan(point, index, seed, path, base, "start")
            cfg = _config(preset, config_file, plan.train_overrides(), f"point {point.label} seed {seed}")
            _check_same_settings(path, cfg)
            plan.action = _action(path)
            plans.append(plan)
    return SweepPlan(protocol, seeds, out, preset, config_file, point_overrides, plans, added)
