"""`rldyn train`: `train(cfg)` opens a run (`train/lifecycle.py`) and runs its steps; `train_step` is one step,
read top to bottom over the stages of `train/stages.py`:

    rollout -> [diagnostics: ROLLOUT] -> filter (whole groups) -> early stopper -> the update phase (old / ref
    log-probs, values, advantages -> critic update -> [diagnostics: BEFORE_UPDATE] -> actor update) -> weight sync
    -> validation when due -> [diagnostics: END]

then, in `run_steps`, the step's metrics row and the checkpoint. The diagnostics (`train/diagnostics/`: reply
lengths, template collapse, the gradient analysis, the sampler/trainer mismatch, the health monitor, the step
records) are read-only: a run with them on ends with the parameters of the run with them off, except where the
health monitor acts (a refused optimizer step, a stop, a rollback). A diagnostic may end the run right after a
step with its row alone (its `exit_line`).

Exploding training: a non-finite gradient skips the optimizer step (`actor/skipped_steps`); non-finite
sampling scores (`rollout/non_finite_logits`) or parameters after an update (`actor/non_finite_parameters`)
end the run early with that reason, without saving the broken state as a checkpoint. A validation whose
scores are non-finite is logged as `val-env/<env>/non_finite_logits` and skipped.

Several ranks (`torchrun`, `train/sharded.py`): every rank holds the whole batch; rollouts are split by whole
groups, the no-grad passes, the updates and the analysis by rows; rank 0 alone writes the run directory, the
console and the checkpoints. With `train.row_seeded_sampling` a run gives the same batches, metrics and weights
(within float reduction order) on any number of ranks.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rldynamics import dist
from rldynamics import metric_names as names
from rldynamics.config import Config, apply_overrides, apply_remedy, save_config
from rldynamics.rollout.sampling import NonFiniteLogits
from rldynamics.tracking.console import StepConsole
from rldynamics.train import stages
from rldynamics.train.checkpoint import (
    checkpoint_step,
    checkpoints,
    crash_point,
    save_checkpoint,
    schedule_words,
    set_aside_after,
    state_bytes,
)
from rldynamics.train.diagnostics import trainer_state
from rldynamics.train.diagnostics.base import END, TRAIN
from rldynamics.train.early_stop import EarlyStopper
from rldynamics.train.lifecycle import opened, report_on_ranks
from rldynamics.train.session import Session, Start
from rldynamics.train.snapshots import rolls_back
from rldynamics.train.step_record import StepRecord

NOT_SAVED = (stages.NON_FINITE_LOGITS, stages.NON_FINITE_PARAMETERS)  # stops whose state is broken: no checkpoint
AFTER_TROUBLE = "checkpoints_after_trouble"  # where a stop that keeps an earlier state moves the checkpoints after it


@dataclass(frozen=True)
class StepResult:
    """A step's metrics row, its stop reason (None: go on), the checkpoint to roll back to (None: none), the
    kept state a stopping run ends with (None: its own) and the line of a diagnostic that ends the run right after
    it (None: none)."""

    metrics: dict[str, float]
    stop: str | None = None
    rollback_to: int | None = None  # the step whose kept state a health rollback goes back to
    end_with: int | None = None  # the step whose kept state a health stop leaves as the last checkpoint
    exit_line: str | None = None


def train(cfg: Config, run_dir: Path | None = None, job: str = TRAIN) -> Path:
    """Run training as configured (into `run_dir` if given; `job` chooses the diagnostics: a replay's retraining
    keeps no records); returns the run directory. A health rollback reopens the run from the checkpoint it goes
    back to (the same checks and restores as a resume)."""
    kept = None  # the states in memory of the run before a rollback
    while True:
        with opened(cfg, run_dir, job=job, report=False) as (s, start, stopper):
            if kept is not None:
                s.snapshots.carry(kept, start.step)
            back = run_steps(s, start, stopper)
        if back is None:
            break
        checkpoint, cfg = back
        cfg, run_dir, kept = apply_overrides(cfg, [f"checkpoint.resume={checkpoint}"]), s.run_dir, s.snapshots
    if cfg.log.report:
        report_on_ranks(s.run_dir)
    if cfg.log.progress:
        dist.on_main(_say_result, s.run_dir)
    return s.run_dir


def _say_result(run_dir: Path) -> None:
    """The run's result on the console: validation start -> end, the health verdict, the report."""
    from rldynamics.plots.cli import result_command

    try:
        result_command(run_dir)
    except (OSError, ValueError) as e:  # the run is complete: a line that cannot be written must not fail it
        print(f"warning: the result of {run_dir} could not be summarised ({e})")


def run_steps(s: Session, begun: Start, stopper: EarlyStopper) -> tuple[Path, Config] | None:
    """Validation before training, then the steps after `begun`, each logged before its checkpoint is saved;
    returns the checkpoint a health rollback goes back to and the config the run goes on with (None when the run
    ended)."""
    cfg, start = s.cfg, begun.step
    before = {}
    if cfg.val.before_train and begun.checkpoint is None:
        validation = stages.validate(s)
        before = validation.metrics
        s.log(start, before)
        for d in s.diagnostics:
            d.before_training(validation)
    if s.snapshots.due(start, start=True):
        s.snapshots.keep(s, start, trainer_state(stopper.state_dict(), s.diagnostics), start=True)
    if s.main:
        _say_storage(s)
    with StepConsole(cfg.train.steps, cfg.env.name, enabled=cfg.log.progress and s.main) as console, \
            _rollouts_closed(s):
        s.console = console
        console.advance(start, before)  # the `step 0` line: the validation before training
        for step in range(start + 1, cfg.train.steps + 1):
            t0 = time.perf_counter()
            try:
                result = train_step(s, step, stopper)
            except NonFiniteLogits:
                result = StepResult(stages.non_finite_logits(), stages.NON_FINITE_LOGITS)
            metrics, stop = result.metrics, result.stop
            if result.exit_line is not None:  # a diagnostic ends the run: its row, nothing else
                s.log(step, metrics)
                console.print(result.exit_line)
                break
            if stop is not None:
                metrics[names.early_stopped(stop)] = 1.0
            metrics[names.STEP_TIME] = time.perf_counter() - t0
            s.log(step, metrics)  # before the checkpoint: a resumed run never lacks this row
            crash_point("logged", step)
            if result.rollback_to is not None and stop is None:
                return _roll_back(s, step, result.rollback_to)
            if stop is not None and result.end_with is not None:
                _end_with(s, step, result.end_with)
            elif stop not in NOT_SAVED and _checkpoint_due(cfg, step, stop is not None):
                console.phase("checkpoint")
                _save(s, step, stopper)
            if stop is None and s.snapshots.due(step):
                s.snapshots.keep(s, step, trainer_state(stopper.state_dict(), s.diagnostics))
            console.advance(step, metrics)
            if stop is not None:
                console.print(f"[yellow]early stop at step {step}: {stop}")
                break
    return None


@contextmanager
def _rollouts_closed(s: Session):
    """A rollout generated ahead is waited for and dropped when the steps end (a stop, a rollback, an error)."""
    try:
        yield
    finally:
        if s.lagged is not None:
            s.lagged.close()


def _say_storage(s: Session) -> None:
    """What the checkpoints will take on disk and, for a run that may roll back, what it can go back to: printed
    whatever `log.progress` is (a schedule that fills the disk, or a rule that cannot reach the state it needs,
    must be seen before the run is under way)."""
    print(schedule_words(s.cfg, state_bytes(s.model, s.critic) / 2**20), flush=True)
    if rolls_back(s.cfg):
        print(s.snapshots.words(), flush=True)


def _roll_back(s: Session, step: int, back: int) -> tuple[Path, Config]:
    """Go back to the state kept at step `back` (a checkpoint, or a state in memory written as one): the rows and
    checkpoints of the steps after it move to `rolled_back/attempt_<k>/`, and `health.remedy` changes the settings
    the run goes on with (events.jsonl, config_history.jsonl, config.yaml). Returns the checkpoint and the new
    config."""
    cfg, changes = apply_remedy(s.cfg)
    said = "; ".join(f"{k} {old} -> {new}" for k, (old, new) in changes.items())
    s.console.print(f"[yellow]rolling back to step {back} ({_steps(back + 1, step)} kept in rolled_back/)"
                    + (f"; going on with {said}" if said else ""))
    dist.on_main(_archive, s, step, back, cfg, changes)  # first: its checkpoints after `back` are set aside
    checkpoint = dist.on_main(_checkpoint_of, s, back)  # rank 0 alone looks: the others would race its writing
    return checkpoint, cfg


def _end_with(s: Session, step: int, back: int) -> None:
    """A health rule stopped the run at `step` with no rollback left: the state kept at step `back`, from before
    the trouble, becomes its last checkpoint (written from memory where it is not on disk); `step`'s state is not
    saved, and checkpoints saved after `back` move to `AFTER_TROUBLE/`, so the policy the run leaves is the one
    before the trouble. The rows of the steps after `back` stay."""
    moved = dist.on_main(set_aside_after, s.run_dir, back, s.run_dir / AFTER_TROUBLE)
    checkpoint = dist.on_main(_checkpoint_of, s, back)
    aside = f"; {_names(moved)}, saved after it, moved to {AFTER_TROUBLE}/" if moved else ""
    s.console.print(f"[yellow]the run ends with the state of step {back}, from before the trouble: {checkpoint} "
                    f"(the state of step {step} is not saved{aside})")


def _names(paths: list[Path]) -> str:
    """`step_10` or `step_10, step_20`."""
    return ", ".join(p.name for p in paths)


def _steps(first: int, last: int) -> str:
    """`step 4` or `steps 4-6`."""
    return f"step {first}" if first == last else f"steps {first}-{last}"


def _checkpoint_of(s: Session, back: int) -> Path:
    """The checkpoint of step `back`: on disk, or the state kept in memory written as one."""
    on_disk = {checkpoint_step(p): p for p in checkpoints(s.run_dir)}
    return on_disk.get(back) or s.snapshots.write(s, back)


def _archive(s: Session, step: int, back: int, cfg: Config, changes: dict) -> None:
    """The undone steps' rows and entries, and their checkpoints, into `rolled_back/attempt_<k>/`; the event and
    the config change."""
    archive = s.writer.archive_after(back)
    set_aside_after(s.run_dir, back, archive / "checkpoints")
    changed = {k: list(v) for k, v in changes.items()}  # key -> [before, after]
    s.writer.log_event({"step": back, "rule": "rollback", "action": "rollback", "from_step": step,
                        "archive": archive.name, "message": f"{_steps(back + 1, step)} rolled back",
                        **({"changes": changed} if changed else {})})
    if changed:
        s.writer.log_config_change({"step": back, "attempt": s.attempt + 1, "changes": changed})
        save_config(cfg, s.run_dir / "config.yaml")  # the settings of the steps from back + 1 on


def _validation_due(cfg: Config, step: int) -> bool:
    return cfg.val.every > 0 and (step % cfg.val.every == 0 or step == cfg.train.steps)


def _checkpoint_due(cfg: Config, step: int, last: bool) -> bool:
    every = cfg.checkpoint.every
    final = step == cfg.train.steps or last
    return (every > 0 and step % every == 0) or (final and cfg.checkpoint.save_last)


def _save(s: Session, step: int, stopper: EarlyStopper) -> None:
    save_checkpoint(s.run_dir / "checkpoints", step, model=s.model, tokenizer=s.tokenizer, optimizer=s.optimizer,
                    critic=s.critic, critic_optimizer=s.critic_optimizer,
                    trainer_state=trainer_state(stopper.state_dict(), s.diagnostics),
                    keep_last=s.cfg.checkpoint.keep_last, merged=s.cfg.checkpoint.save_merged,
                    sampler=s.sampler_versions(step))


def train_step(s: Session, step: int, stopper: EarlyStopper) -> StepResult:
    """One training step: its metrics row and a stop reason (an early stop, non-finite values, a diagnostic's),
    a checkpoint to roll back to, or a diagnostic's exit."""
    due = stages.due_diagnostics(s, step)
    record = StepRecord(step=step, seed_step=step)
    stop = stages.begin(s, due, record, stopper).stop
    if stop is None and _ahead_due(s.cfg, step):  # the next step's rollout runs while this step updates
        stages.generate_ahead(s, step + 1)
    if stop is None or len(record.filtered.batch) == 0:  # with nothing kept, an analysis of its own batch still runs
        phase = stages.update_phase(s, record, stages.needs_of(due, step), guard=stages.guard_of(due),
                                    before_actor=lambda: stages.before_update(s, due, record))
        stop = phase.stop or stop
        if stop is None and _sync_due(s, step, phase.actor_updated):
            record.add(stages.sync_engine(s))
    if s.lagged is not None:
        s.lagged.keep(step, s.model)  # the version later steps' rollouts sample with
    if stop is None and _validation_due(s.cfg, step):
        record.validation = validation = stages.validate(s)
        record.add(validation.metrics)
        if validation.success is not None:
            stop = stopper.after_validation(validation.success)
    record.early_stop = stopper.state_dict()
    ended = stages.run_point(s, due, END, record)  # every step, whatever stopped it
    stop = stop or ended
    targets = [r.rollback_to for r in record.results.values() if r.rollback_to is not None]
    ends = [r.end_with for r in record.results.values() if r.end_with is not None]
    return StepResult(record.metrics(), stop, min(targets, default=None), min(ends, default=None),
                      stages.exit_line(record))


def _sync_due(s: Session, step: int, actor_updated: bool) -> bool:
    """Whether the rollout engine gets the weights after `step`: after an update every `rollout.sync_every` steps and
    before a validation; under `rollout.staleness` only before a validation (the rollouts sync the sampler's)."""
    if s.engine is None:
        return False
    if s.lagged is not None:
        return _validation_due(s.cfg, step)
    return actor_updated and (step % s.cfg.rollout.sync_every == 0 or _validation_due(s.cfg, step))


def _ahead_due(cfg: Config, step: int) -> bool:
    """Whether the rollout of the step after `step` starts before `step`'s update (`rollout.overlap`)."""
    return cfg.rollout.overlap and step < cfg.train.steps
