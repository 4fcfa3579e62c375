"""`rldyn train`: `train(cfg)` opens a run (`train/lifecycle.py`) and runs its steps; `train_step` is one step,
read top to bottom over the stages of `train/step.py`:

    rollout -> [diagnostics: ROLLOUT] -> filter (whole groups) -> early stopper -> old / ref log-probs, values,
    advantages -> critic update -> [diagnostics: BEFORE_UPDATE] -> actor update -> [diagnostics: END] -> weight sync

then, in `run_steps`, validation, the step's metrics row and the checkpoint. The diagnostics (`train/diagnostics/`:
reply lengths, template collapse, the gradient analysis, the sampler/trainer mismatch) are read-only: a run with
them on ends with the parameters of the run with them off. `analysis.exit_after` ends the loop right after the
first analysis.

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
from dataclasses import dataclass
from pathlib import Path

from rldynamics import dist
from rldynamics import metric_names as names
from rldynamics.config import Config, apply_overrides
from rldynamics.models.sharding import all_finite
from rldynamics.rollout.sampling import NonFiniteLogits
from rldynamics.tracking.console import StepConsole
from rldynamics.train import step as stages
from rldynamics.train.actor import single_pass
from rldynamics.train.checkpoint import checkpoint_step, crash_point, save_checkpoint
from rldynamics.train.diagnostics import diagnostic_states
from rldynamics.train.diagnostics.base import BEFORE_UPDATE, END, StepRecord
from rldynamics.train.diagnostics.gradient_analysis import EXITED
from rldynamics.train.early_stop import EarlyStopper
from rldynamics.train.lifecycle import opened
from rldynamics.train.setup import Session

NON_FINITE_PARAMETERS = "non_finite_parameters"
NOT_SAVED = (stages.NON_FINITE_LOGITS, NON_FINITE_PARAMETERS)  # stops whose state is broken: no checkpoint


@dataclass
class StepResult:
    """A step's metrics row, its stop reason (None: go on) and the checkpoint to roll back to (None: none)."""

    metrics: dict[str, float]
    stop: str | None = None
    rollback_to: Path | None = None


def train(cfg: Config, run_dir: Path | None = None) -> Path:
    """Run training as configured (into `run_dir` if given); returns the run directory. A health rollback reopens
    the run from the checkpoint it goes back to (the same checks and restores as a resume)."""
    while True:
        with opened(cfg, run_dir) as (s, start, stopper):
            back = run_steps(s, start.step, stopper)
        if back is None:
            if cfg.log.progress:
                dist.on_main(_say_result, s.run_dir)
            return s.run_dir
        cfg, run_dir = apply_overrides(cfg, [f"checkpoint.resume={back}"]), s.run_dir


def _say_result(run_dir: Path) -> None:
    """The run's result on the console: validation start -> end, the health verdict, the report."""
    from rldynamics.plots.cli import result_command

    try:
        result_command(run_dir)
    except (OSError, ValueError) as e:  # the run is complete: a line that cannot be written must not fail it
        print(f"warning: the result of {run_dir} could not be summarised ({e})")


def run_steps(s: Session, start: int, stopper: EarlyStopper) -> Path | None:
    """Validation before training, then the steps after `start`, each logged before its checkpoint is saved;
    returns the checkpoint a health rollback goes back to (None when the run ended)."""
    cfg = s.cfg
    before = {}
    if cfg.val.before_train and start == 0:
        validation = stages.validate(s)
        before = validation.metrics
        s.log(start, before)
        for d in s.diagnostics:
            d.before_training(validation)
    with StepConsole(cfg.train.steps, cfg.env.name, enabled=cfg.log.progress and s.main) as console:
        s.console = console
        console.advance(start, before)  # the `step 0` line: the validation before training
        for step in range(start + 1, cfg.train.steps + 1):
            t0 = time.perf_counter()
            try:
                result = train_step(s, step, stopper)
            except NonFiniteLogits:
                result = StepResult(stages.non_finite_logits(), stages.NON_FINITE_LOGITS)
            metrics, stop = result.metrics, result.stop
            if stop == EXITED:  # analysis.exit_after: the row of the analysis, nothing else
                s.log(step, metrics)
                console.analysis_done(step)
                break
            if stop is not None:
                metrics[names.early_stopped(stop)] = 1.0
            metrics[names.STEP_TIME] = time.perf_counter() - t0
            s.log(step, metrics)  # before the checkpoint: a resumed run never lacks this row
            crash_point("logged", step)
            if result.rollback_to is not None and stop is None:
                _roll_back(s, step, result.rollback_to)
                return result.rollback_to
            if stop not in NOT_SAVED and _checkpoint_due(cfg, step, stop is not None):
                console.phase("checkpoint")
                _save(s, step, stopper)
            console.advance(step, metrics)
            if stop is not None:
                console.print(f"[yellow]early stop at step {step}: {stop}")
                break
    return None


def _roll_back(s: Session, step: int, checkpoint: Path) -> None:
    """Move the rows of the steps after `checkpoint` (this one's included) to `rolled_back/attempt_<k>/`."""
    s.rolling_back = True
    back = checkpoint_step(checkpoint)
    s.console.print(f"[yellow]rolling back to {checkpoint} (steps {back + 1}-{step} kept in rolled_back/)")
    dist.on_main(_archive, s, step, back)


def _archive(s: Session, step: int, back: int) -> None:
    archive = s.writer.archive_after(back)
    s.writer.log_event({"step": back, "rule": "rollback", "action": "rollback", "from_step": step,
                        "archive": archive.name, "message": f"steps {back + 1}-{step} rolled back"})


def _validation_due(cfg: Config, step: int) -> bool:
    return cfg.val.every > 0 and (step % cfg.val.every == 0 or step == cfg.train.steps)


def _checkpoint_due(cfg: Config, step: int, last: bool) -> bool:
    every = cfg.checkpoint.every
    final = step == cfg.train.steps or last
    return (every > 0 and step % every == 0) or (final and cfg.checkpoint.save_last)


def _save(s: Session, step: int, stopper: EarlyStopper) -> None:
    save_checkpoint(s.run_dir / "checkpoints", step, model=s.model, tokenizer=s.tokenizer, optimizer=s.optimizer,
                    critic=s.critic, critic_optimizer=s.critic_optimizer,
                    trainer_state={"early_stop": stopper.state_dict(), "diagnostics": diagnostic_states(s.diagnostics)},
                    keep_last=s.cfg.checkpoint.keep_last, merged=s.cfg.checkpoint.save_merged)


def train_step(s: Session, step: int, stopper: EarlyStopper) -> StepResult:
    """One training step: its metrics row and a stop reason (early stop, EXITED after the analysis, non-finite, a
    health rule), or a checkpoint to roll back to."""
    cfg = s.cfg
    due = stages.due_diagnostics(s, step)
    record = StepRecord(step=step, seed_step=step)
    decision = stages.begin(s, due, record, stopper)
    filtered = record.filtered
    batch = filtered.batch
    if len(batch) == 0:  # nothing to update; an analysis of its own batch still runs
        record.add({names.GRADIENT_ANALYSIS_ONLY: 0.0})
        stop = stages.run_point(s, due, BEFORE_UPDATE, record)
        return _end(s, due, stopper, record, stop or decision.stop)
    if decision.stop is not None:
        return _end(s, due, stopper, record, decision.stop)

    # an on-policy single-pass update needs no old-log-prob pass: its own forward gives the rollout policy's
    # log-probs, unless a due diagnostic asks for the pass
    needs = stages.needs_of(due, step)
    own_old = single_pass(cfg.train, len(batch)) and not needs.old_logprobs
    record.prepared = prepared = stages.prepare(s, filtered, old_pass=not own_old,
                                                ref_pass=cfg.algo.kl_coef > 0 or needs.ref_logprobs)
    record.add(prepared.metrics)
    if s.critic is not None:
        record.add(stages.critic_update(s, batch, prepared))
    if step <= cfg.critic.warmup_steps:  # critic warm-up: the actor waits for a critic that predicts something
        record.add({names.CRITIC_WARMUP: 1.0})
        return _end(s, due, stopper, record, None)
    record.add({names.GRADIENT_ANALYSIS_ONLY: 0.0})
    stop = stages.run_point(s, due, BEFORE_UPDATE, record)
    if stop is not None:
        return _end(s, due, stopper, record, stop)
    record.update = update = stages.actor_update(s, step, batch, prepared, record=own_old and needs.update_logprobs,
                                                 guard=stages.guard_of(due))
    record.add(update.metrics)
    if prepared.entropy is None:  # one step on the rollout policy: its entropy is the update's
        record.add({names.ENTROPY: update.entropy})
    if not all_finite(s.model, s.critic):  # an optimizer step overflowed: nothing left to train or save
        record.add({names.actor(NON_FINITE_PARAMETERS): 1.0})
        return _end(s, due, stopper, record, NON_FINITE_PARAMETERS)
    if s.engine is not None and (step % cfg.rollout.sync_every == 0 or _validation_due(cfg, step)):
        record.add(stages.sync_engine(s))
    return _end(s, due, stopper, record, None)


def _end(s: Session, due: list, stopper: EarlyStopper, record: StepRecord, stop: str | None) -> StepResult:
    """The step's validation (when due and the run goes on), then the END diagnostics; the step's result."""
    if stop is None and _validation_due(s.cfg, record.step):
        record.validation = val = stages.validate(s)
        record.add(val.metrics)
        if val.success is not None:
            stop = stopper.after_validation(val.success)
    record.early_stop = stopper.state_dict()
    ended = stages.run_point(s, due, END, record)
    targets = [r.rollback_to for r in record.results.values() if r.rollback_to is not None]
    back = min(targets, key=checkpoint_step) if targets else None
    return StepResult(record.metrics(), stop or ended, back)
