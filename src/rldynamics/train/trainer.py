"""The training loop. `train(cfg)` sets up a run; `train_step` is one step, read top to bottom:

    rollout -> filter (whole groups) -> old / ref log-probs, values -> advantages (+ filter loss scaling)
    -> critic update -> [gradient analysis, on schedule, read-only] -> actor update

(the collapse diagnostics, on their own schedule and read-only, score the unfiltered rollout: `train/collapse_stage.py`)

then, in `train`, validation, the step's metrics row and the checkpoint. Every sampling call is seeded from
(seed, step), so a resumed run replays exactly the steps an uninterrupted run would have taken. The gradient
analysis (`train/analysis_pass.py`) is read-only: a run with it on ends with the parameters of the run with it off.

Crash safety: the run directory is locked for the whole run (one writer), and a step's row is written before
its checkpoint is published, so no checkpoint is ever ahead of the rows; a resumed run drops what was written
after its checkpoint (rows, samples, analysis) and writes those steps again: every step once.

Exploding training: a non-finite gradient skips the optimizer step (`actor/skipped_steps`); non-finite
sampling scores (`rollout/non_finite_logits`) or parameters after an update (`actor/non_finite_parameters`)
end the run early with that reason, without saving the broken state as a checkpoint. A validation whose
scores are non-finite is logged as `val-env/<env>/non_finite_logits` and skipped.

Several ranks (`torchrun`, `train/sharded.py`): every rank holds the whole batch; rollouts are split by whole
groups, the no-grad passes, the updates and the analysis by rows; rank 0 alone writes the run directory, the
console and the checkpoints. With `train.row_seeded_sampling` a run gives the same batches, metrics and weights
(within float reduction order) on any number of ranks.

The stages of a step (`roll_out`, `record_filter`, `prepare`, `analyse`) are functions of the session that
`rldyn probe` (`train/probe.py`) composes in its own way: the loop here has no probe mode. `analysis.exit_after`
ends the loop right after the first analysis.
"""

from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from rldynamics import dist
from rldynamics import metric_names as names
from rldynamics.algo.rollout_corr import batch_mismatch, measures_mismatch
from rldynamics.config import Config
from rldynamics.models.sharding import all_finite
from rldynamics.rollout.agent import env_metric_summary
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.rollout.rewards import reward_component_metrics, reward_rows, reward_stats
from rldynamics.rollout.sampling import NonFiniteLogits
from rldynamics.tracking.console import StepConsole
from rldynamics.tracking.run_dir import RunLock
from rldynamics.train import setup
from rldynamics.train.actor import single_pass, update_actor
from rldynamics.train.analysis_pass import analysis_due, run_analysis
from rldynamics.train.checkpoint import crash_point, save_checkpoint
from rldynamics.train.collapse_stage import collapse_due, run_collapse
from rldynamics.train.critic import update_critic
from rldynamics.train.early_stop import EarlyStopper
from rldynamics.train.prepare import Prepared, prepare_update
from rldynamics.train.setup import Session
from rldynamics.train.sharded import rollout_groups
from rldynamics.train.stages import Filtered, data_metrics, filter_batch, step_seed, timed, train_seeds, val_seeds

EXITED = "exited_after_gradient_analysis"
NON_FINITE_LOGITS = "non_finite_logits"
NON_FINITE_PARAMETERS = "non_finite_parameters"


def train(cfg: Config, run_dir: Path | None = None) -> Path:
    """Run training as configured (into `run_dir` if given); returns the run directory.

    Under torchrun every rank calls it; the checks and the run directory are rank 0's (`dist.on_main`), so a
    start that fails raises the same error on every rank before any work."""
    with opened(cfg, run_dir) as (s, start, stopper):
        run_steps(s, start.step, stopper)
    return s.run_dir


@contextmanager
def opened(cfg: Config, run_dir: Path | None = None):
    """A session set up (`setup`: checks, models, the resumed checkpoint) with its run directory locked and first
    written; yields (session, start, early stopper). After the body: every gradient dump on disk, the writer closed
    and the report written (not after an error: what was written stays as it is)."""
    setup.check_world(cfg)
    run_dir = dist.on_main(lambda: run_dir or setup.resolve_run_dir(cfg))
    start = dist.on_main(setup.plan_start, cfg, run_dir)  # reads only; raises before any work
    stopper = EarlyStopper.for_run(cfg)
    setup.load_early_stop(stopper, start)
    s = setup.make_session(cfg, run_dir, start)  # writes nothing
    with ExitStack() as held:
        dist.on_main(_open, s, start, held)
        try:
            yield s, start, stopper
        finally:
            if s.dumper is not None:
                s.dumper.close()  # every queued gradient dump is on disk (or its error raised) before the run ends
        if s.main:
            s.writer.close()
            if cfg.log.report:
                _write_report(s.run_dir)


def _open(s: Session, start: setup.Start, held: ExitStack) -> None:
    """Lock the run directory for as long as `held` is (one writer per run), then make the first writes."""
    lock = held.enter_context(RunLock(s.run_dir))
    setup.open_run(s, start)
    if lock.stale:
        print(f"note: {s.run_dir} was last opened by {lock.stale}, which ended without closing it")
    if start.in_place and start.checkpoint is None:
        print(f"note: {s.run_dir} has no checkpoint yet; training it again from step 0")


def run_steps(s: Session, start: int, stopper: EarlyStopper) -> None:
    """Validation before training, then the steps after `start`, each logged before its checkpoint is saved."""
    cfg, env = s.cfg, s.cfg.env.name
    before = validate(s).metrics if cfg.val.before_train and start == 0 else {}
    if before:
        s.log(start, before)
    with StepConsole(cfg.train.steps, env, enabled=cfg.log.progress and s.main) as console:
        s.console = console
        console.advance(start, before)  # the `step 0` line: the validation before training
        for step in range(start + 1, cfg.train.steps + 1):
            t0 = time.perf_counter()
            try:
                metrics, stop = train_step(s, step, stopper)
            except NonFiniteLogits:
                metrics, stop = non_finite_logits(), NON_FINITE_LOGITS
            if stop == EXITED:  # analysis.exit_after: the row of the analysis, nothing else
                s.log(step, metrics)
                console.analysis_done(step)
                break
            if stop is None and cfg.val.every > 0 and (step % cfg.val.every == 0 or step == cfg.train.steps):
                val = validate(s)
                metrics.update(val.metrics)
                if val.success is not None:
                    stop = stopper.after_validation(val.success)
            if stop is not None:
                metrics[names.early_stopped(stop)] = 1.0
            metrics[names.STEP_TIME] = time.perf_counter() - t0
            s.log(step, metrics)  # before the checkpoint: a resumed run never lacks this row
            crash_point("logged", step)
            if stop not in (NON_FINITE_LOGITS, NON_FINITE_PARAMETERS) and _checkpoint_due(cfg, step, stop is not None):
                console.phase("checkpoint")
                save_checkpoint(s.run_dir / "checkpoints", step, model=s.model, tokenizer=s.tokenizer,
                                optimizer=s.optimizer, critic=s.critic, critic_optimizer=s.critic_optimizer,
                                trainer_state={"early_stop": stopper.state_dict(), "collapse_ema": s.collapse_ema},
                                keep_last=cfg.checkpoint.keep_last)
            console.advance(step, metrics)
            if stop is not None:
                console.print(f"[yellow]early stop at step {step}: {stop}")
                break


def non_finite_logits() -> dict[str, float]:
    """The row of a step whose sampling scores were not finite."""
    return {names.filter_metric(names.ROLLOUT, NON_FINITE_LOGITS): 1.0}


def _write_report(run_dir: Path) -> None:
    """Figures and the HTML report of the finished run (plotting reads only the run directory).

    The run is complete before this; a figure that cannot be drawn is reported in one line and never fails it."""
    from rldynamics.plots.cli import plot_command, report_command

    try:
        plot_command(run_dir)
        report_command(run_dir)
    except Exception as e:  # noqa: BLE001 (the training result must not be lost to a plotting problem)
        print(f"warning: the figures or report of {run_dir} could not be written ({e.__class__.__name__}: "
              f"{str(e).splitlines()[0] if str(e) else ''}); the run directory is complete, retry with "
              f"`rldyn report {run_dir}`")


def _checkpoint_due(cfg: Config, step: int, last: bool) -> bool:
    every = cfg.checkpoint.every
    final = step == cfg.train.steps or last
    return (every > 0 and step % every == 0) or (final and cfg.checkpoint.save_last)


def train_step(s: Session, step: int, stopper: EarlyStopper) -> tuple[dict[str, float], str | None]:
    """One training step; returns its metrics and a stop reason (early stop, or EXITED after analysis)."""
    cfg, m = s.cfg, {}
    filtered = roll_out(s, step, step, m)
    batch = filtered.batch
    stop = record_filter(m, stopper, filtered)
    if len(batch) == 0:
        return m, _analyse(s, step, m, filtered, None) or stop
    if stop is not None:
        return m, stop

    # an on-policy single-pass update needs no old-log-prob pass: its own forward gives them (the mismatch metrics
    # read them after the update; under torchrun each rank holds only its rows, so the pass stays there)
    own_old = single_pass(cfg.train, len(batch)) and not analysis_due(cfg, step) and not (
        measures_mismatch(cfg) and dist.distributed())
    # the reference model is loaded for the analysis too; with KL off only an analysis step reads its log-probs
    prepared = prepare(s, filtered, m, old_pass=not own_old, ref_pass=cfg.algo.kl_coef > 0 or analysis_due(cfg, step))
    if s.critic is not None:
        s.console.phase("critic")
        with timed(m, "update_critic"):
            m.update(update_critic(s.critic, s.critic_optimizer, batch, prepared.values, prepared.returns, cfg.algo,
                                   cfg.critic, cfg.train))
    if step <= cfg.critic.warmup_steps:  # critic warm-up: the actor waits for a critic that predicts something
        m["critic/warmup"] = 1.0
        return m, None
    if _analyse(s, step, m, filtered, prepared):
        return m, EXITED
    s.console.phase("actor")
    with timed(m, "update_actor"):
        update = update_actor(s.model, s.optimizer, batch, prepared.inputs, cfg.algo, cfg.train,
                              torch.Generator().manual_seed(step_seed(cfg.seed, step, stream=1)),
                              record=own_old and measures_mismatch(cfg))
    m.update(update.metrics)
    if own_old:
        m.update(batch_mismatch(cfg, batch, update.logprobs))
    if prepared.entropy is None:  # one step on the rollout policy: its entropy is the update's
        m[names.ENTROPY] = update.entropy
    if not all_finite(s.model, s.critic):  # an optimizer step overflowed: nothing left to train or save
        m[names.actor(NON_FINITE_PARAMETERS)] = 1.0
        return m, NON_FINITE_PARAMETERS
    if s.engine is not None:
        with timed(m, "weight_sync"):
            s.engine.sync(s.model)
    return m, None


def roll_out(s: Session, step: int, seed_step: int, m: dict[str, float]) -> Filtered:
    """Roll out the groups of `seed_step`'s env seeds and sampling seed, log its rewards and samples (as `step`),
    and filter it; its metrics go into `m`."""
    cfg = s.cfg
    s.console.phase("rollout")
    with timed(m, "gen"):
        batch = rollout_groups(cfg, s.model, s.tokenizer,
                               train_seeds(cfg.train.seed_base, cfg.train.env_groups, seed_step),
                               cfg.train.group_size, cfg.train.temperature, step_seed(cfg.seed, seed_step),
                               engine=s.engine)
    m.update(env_metric_summary(batch, names.env_prefix(cfg.env.name), cfg.train.group_size))
    m.update(reward_component_metrics(batch.reward_components, batch.reward_names, batch.group_ids))
    rows = reward_rows(batch, step, s.tokenizer)
    if s.main:
        s.writer.log_rewards(rows)
    m.update(reward_stats(rows, batch.reward_names))
    _log_samples(s, step, batch)
    crash_point("samples", step)
    if collapse_due(cfg, step):  # read-only, on the unfiltered batch
        s.console.phase("collapse")
        m.update(run_collapse(s, step, batch))
    filtered = filter_batch(batch, cfg.filter)
    m.update(filtered.metrics)
    return filtered


def record_filter(m: dict[str, float], stopper: EarlyStopper, filtered: Filtered) -> str | None:
    """Give the filter's outcome to the early stopper; returns its stop reason (or None)."""
    empty = len(filtered.batch) == 0
    stop = stopper.after_rollout(filtered.reward_std, empty=empty)
    m[names.filter_metric(names.ROLLOUT, "empty_after_filter")] = float(empty)
    m[names.filter_metric(names.ROLLOUT, "consecutive_empty_after_filter_steps")] = float(stopper.empty)
    return stop


def prepare(s: Session, filtered: Filtered, m: dict[str, float], *, old_pass: bool = True,
            ref_pass: bool = True) -> Prepared:
    """The update's inputs of the filtered batch (`prepare_update`) and the batch summaries; metrics into `m`."""
    s.console.phase("log-probs")
    prepared = prepare_update(s, filtered.batch, filtered.kept_ratio, old_pass=old_pass, ref_pass=ref_pass)
    m.update(prepared.metrics)
    m.update(batch_mismatch(s.cfg, filtered.batch, prepared.inputs.old_logprobs))
    m.update(data_metrics(filtered.batch, prepared.inputs.advantages, prepared.returns, prepared.values))
    return prepared


def analyse(s: Session, step: int, m: dict[str, float], filtered: Filtered, prepared: Prepared | None,
            seed_step: int) -> None:
    """The gradient analysis of `step` (`run_analysis`; a separate batch uses `seed_step`'s seeds); metrics into
    `m`."""
    s.console.phase("analysis")
    with timed(m, "gradient_analysis"):
        m.update(run_analysis(s, step, filtered, prepared, seed_step))
    crash_point("analysis", step)


def _analyse(s: Session, step: int, m: dict, filtered: Filtered, prepared: Prepared | None) -> str | None:
    """Run the gradient analysis when due; returns EXITED when the run should end right after it."""
    m[names.GRADIENT_ANALYSIS_ONLY] = 0.0
    if not analysis_due(s.cfg, step):
        return None
    analyse(s, step, m, filtered, prepared, step)
    if s.cfg.analysis.exit_after:
        m[names.EXITED_AFTER_ANALYSIS] = 1.0
        return EXITED
    return None


def _log_samples(s: Session, step: int, batch: RolloutBatch) -> None:
    k = s.cfg.log.samples_per_step
    if k > 0 and s.main:
        picks = range(0, len(batch), max(1, len(batch) // k))
        s.writer.log_samples(step, [{"seed": batch.seeds[i], "reward": batch.scores[i].item(),
                                     "success": batch.env_metrics[i]["success"], "text": batch.texts[i]}
                                    for i in list(picks)[:k]])


@dataclass
class Validation:
    """A validation's success rate (None when it has none: non-finite sampling scores) and its metrics."""

    success: float | None
    metrics: dict[str, float]


@torch.no_grad()
def validate(s: Session) -> Validation:
    """Validation rollouts on the fixed puzzles; RNG streams are left as they were.

    Its metrics are only `val-env/<env>/non_finite_logits` when the policy's sampling scores are not finite."""
    cfg = s.cfg
    if s.console is not None:
        s.console.phase("validation")
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        try:
            batch = rollout_groups(cfg, s.model, s.tokenizer, val_seeds(cfg.val.seed_base, cfg.val.env_groups),
                                   cfg.val.group_size, cfg.val.temperature, step_seed(cfg.seed, 0, stream=2),
                                   engine=s.engine)
        except NonFiniteLogits:
            return Validation(None, {f"{names.env_prefix(cfg.env.name, validation=True)}/{NON_FINITE_LOGITS}": 1.0})
    metrics = env_metric_summary(batch, names.env_prefix(cfg.env.name, validation=True), cfg.val.group_size)
    metrics.update(reward_component_metrics(batch.reward_components, batch.reward_names, batch.group_ids,
                                            names.VAL_REWARD))
    metrics[names.VAL_TIME] = time.perf_counter() - start
    success = sum(m["success"] for m in batch.env_metrics) / len(batch) if batch.env_metrics else None
    return Validation(success, metrics)
