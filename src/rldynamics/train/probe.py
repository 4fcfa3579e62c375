"""`rldyn probe`: one gradient-analysis pass on a saved checkpoint, written to its own run directory.

The probe loads the checkpoint's run (same config, same weights and critic) and composes the stages of a training
step itself: rollout on the fixed probe seeds -> filter -> prepare -> gradient analysis -> one metrics row.
Nothing is updated, nothing stops it early (the probe of the last checkpoint of a run that stopped early
still analyses) and no checkpoint is written. As in RAGEN's probe, the metrics are logged at the
checkpoint's step N, and the analysed batch is drawn from a fixed seed stream: the env seeds and sampling
seed of step 1 (`train.seed_base + g` for group g; a separate analysis batch: `train.seed_base + 500000 + g`),
whatever N is. Probes of the checkpoints of one run therefore compare policies on the same puzzles, and a
probe of weights equal to the initial ones reproduces the run's step-1 analysis. Defaults follow RAGEN's
probe script: KL (k3, 0.001) and entropy (0.001) enabled so that both regularisers are measured; any key
can be overridden except those the run's model is made of (`RUN_MODEL_KEYS`).

The analysed model is the checkpoint's own: its actor, and as the KL reference the base model of its run, built from
the run's config.yaml (`setup.run_base_path`). A checkpoint without its run's config.yaml, or an override of what
the base model is made of, would pair the actor with another reference (a KL gradient of another model pair); both
are refused in one line before any work.
"""

from __future__ import annotations

from pathlib import Path

from rldynamics import metric_names as names
from rldynamics.config import Config, ConfigError, apply_overrides, config_diff
from rldynamics.rollout.sampling import NonFiniteLogits
from rldynamics.tracking.console import StepConsole
from rldynamics.train import stages
from rldynamics.train.checkpoint import read_trainer_state
from rldynamics.train.diagnostics import job_settings
from rldynamics.train.diagnostics.base import END, PROBE
from rldynamics.train.early_stop import EarlyStopper
from rldynamics.train.lifecycle import opened
from rldynamics.train.session import Session
from rldynamics.train.setup import run_config
from rldynamics.train.step_record import StepRecord

PROBE_DEFAULTS = ["algo.kl_coef=0.001", "algo.kl_type=k3", "algo.entropy_coef=0.001"]
RUN_MODEL_KEYS = ("model.path", "tiny.", "model.warm_start_")  # the run's base model: never a probe's to change
PROBE_SEED_STEP = 1  # a probe draws the env and sampling seeds of step 1 (RAGEN's probe restarts its seed counter)


def probe_config(checkpoint: Path, overrides: list[str], validate: bool = False) -> Config:
    """The probe's config: the run's saved config, RAGEN's probe defaults, probe mode, then `overrides`.

    A checkpoint that is missing or has no usable trainer state is a CheckpointError naming the file (the training
    start verifies every file of it before any work); a run without config.yaml, or overrides of `RUN_MODEL_KEYS`,
    a ConfigError."""
    step = read_trainer_state(checkpoint)["step"]
    base = run_config(checkpoint)
    mode = [f"checkpoint.resume={checkpoint}", f"train.steps={step}", f"val.before_train={str(validate).lower()}",
            *job_settings(PROBE)]  # the probe's diagnostics (the gradient analysis at this step) say what they need
    cfg = apply_overrides(base, PROBE_DEFAULTS + mode + overrides)
    changed = [f"{key}={new} (the run's: {old})" for key, old, new in config_diff(base, cfg)
               if key.startswith(RUN_MODEL_KEYS)]
    if changed:
        raise ConfigError(f"{'; '.join(changed)}: a probe analyses the checkpoint's own model (its actor, and the base "
                          "model of its run as the KL reference); drop this override")
    return cfg


def probe_checkpoint(checkpoint: str | Path, overrides: list[str], validate: bool = False) -> Path:
    """Run the probe and return its run directory (`<log.run_dir>/probe_<run>_step<N>` unless log.name is set)."""
    checkpoint = Path(checkpoint).resolve()
    cfg = probe_config(checkpoint, overrides, validate)
    name = cfg.log.name if any(o.startswith("log.name=") for o in overrides) else (
        f"probe_{checkpoint.parent.parent.name}_{checkpoint.name}")
    with opened(cfg, Path(cfg.log.run_dir) / name, job=PROBE) as (s, start, stopper):
        probe_steps(s, start.step, stopper)
    return s.run_dir


def probe_steps(s: Session, step: int, stopper: EarlyStopper) -> None:
    """Validation (with `val.before_train`, what `--validate` sets), then the analysis of the checkpoint, both
    logged at the checkpoint's `step`."""
    cfg = s.cfg
    before = stages.validate(s).metrics if cfg.val.before_train else {}
    if before:
        s.log(step, before)
    with StepConsole(cfg.train.steps, cfg.env.name, enabled=cfg.log.progress and s.main, probe=True,
                     first=step) as console:
        s.console = console
        console.advance(step - 1, before)  # with --validate: `probe of step N | val ...`
        try:
            metrics = analyse_checkpoint(s, step, stopper)
        except NonFiniteLogits:
            metrics = {**stages.non_finite_logits(), names.early_stopped(stages.NON_FINITE_LOGITS): 1.0}
            console.print(f"[yellow]early stop at step {step}: {stages.NON_FINITE_LOGITS}")
        else:
            console.print(f"probe of step {step} done: gradient analysis written")
        s.log(step, metrics)


def analyse_checkpoint(s: Session, step: int, stopper: EarlyStopper) -> dict[str, float]:
    """The probe's row: rollout of the probe seeds, filter, prepare (no update), the diagnostics of every point.

    The stopper only counts (`rollout/consecutive_empty_after_filter_steps` continues the checkpoint's count);
    its stop reasons, and the diagnostics', are ignored."""
    due = stages.due_diagnostics(s, step)
    record = StepRecord(step=step, seed_step=PROBE_SEED_STEP)
    stages.begin(s, due, record, stopper)  # its stop reason is not the probe's
    if len(record.filtered.batch) > 0:
        record.prepared = stages.prepare(s, record.filtered)
        record.add(record.prepared.metrics)
    stages.before_update(s, due, record, updates=False)
    stages.run_point(s, due, END, record)
    return record.metrics()
