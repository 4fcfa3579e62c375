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

Probe mode (`analysis.only`, what `rldyn probe` runs): nothing is updated, early stopping is off, no
checkpoint is written, a run resumed from a checkpoint keeps the checkpoint's step number (RAGEN's
probe), and its k-th step draws the env seeds and sampling seed of step k (`stages.seed_step`), so probes
of different checkpoints analyse the same puzzles.
"""

from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from rldynamics import dist
from rldynamics.algo.filter import loss_scale
from rldynamics.algo.losses import aggregate, masked_mean
from rldynamics.analysis.objective import ActorInputs
from rldynamics.config import Config
from rldynamics.models.forward import batch_logprobs, batch_values
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
from rldynamics.train.setup import Session
from rldynamics.train.sharded import rollout_groups, row_pass
from rldynamics.train.stages import (
    advantages_and_returns,
    data_metrics,
    filter_batch,
    step_seed,
    train_seeds,
    val_seeds,
)

EXITED = "exited_after_gradient_analysis"
NON_FINITE_LOGITS = "non_finite_logits"
NON_FINITE_PARAMETERS = "non_finite_parameters"


@contextmanager
def timed(metrics: dict[str, float], name: str):
    """Add the wall time of the block to `metrics["timing_s/<name>"]`."""
    start = time.perf_counter()
    yield
    metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start


def train(cfg: Config, run_dir: Path | None = None) -> Path:
    """Run training as configured (into `run_dir` if given); returns the run directory.

    Under torchrun every rank calls it; the checks and the run directory are rank 0's (`dist.on_main`), so a
    start that fails raises the same error on every rank before any work."""
    setup.check_world(cfg)
    run_dir = dist.on_main(lambda: run_dir or setup.resolve_run_dir(cfg))
    start = dist.on_main(setup.plan_start, cfg, run_dir)  # reads only; raises before any work
    stopper = EarlyStopper.for_run(cfg)
    setup.load_early_stop(stopper, start)
    s = setup.make_session(cfg, run_dir, start)  # writes nothing
    with ExitStack() as held:
        dist.on_main(_open, s, start, held)
        try:
            run_steps(s, start.step, stopper)
        finally:
            if s.dumper is not None:
                s.dumper.close()  # every queued gradient dump is on disk (or its error raised) before the run ends
        if s.main:
            s.writer.close()
            if cfg.log.report:
                _write_report(s.run_dir)
    return s.run_dir


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
    s.first_step = start if cfg.analysis.only and start > 0 else start + 1  # a probe keeps the checkpoint's step
    if cfg.val.before_train and (start == 0 or cfg.analysis.only):
        s.log(start, validate(s))
    with StepConsole(cfg.train.steps, env, enabled=cfg.log.progress and s.main) as console:
        s.console = console
        console.advance(s.first_step - 1, {})
        for step in range(s.first_step, cfg.train.steps + 1):
            t0 = time.perf_counter()
            try:
                metrics, stop = train_step(s, step, stopper)
            except NonFiniteLogits:
                metrics, stop = {"rollout/non_finite_logits": 1.0}, NON_FINITE_LOGITS
            if stop == EXITED:
                s.log(step, metrics)
                console.print(f"[yellow]exited after the gradient analysis of step {step}")
                break
            if stop is None and cfg.val.every > 0 and (step % cfg.val.every == 0 or step == cfg.train.steps):
                metrics.update(validate(s))
                if f"val-env/{env}/success" in metrics:
                    stop = stopper.after_validation(metrics[f"val-env/{env}/success"])
            if stop is not None:
                metrics[f"early_stopped/{stop}"] = 1.0
            metrics["timing_s/step"] = time.perf_counter() - t0
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
    if cfg.analysis.only:  # nothing was updated: a probe never writes checkpoints
        return False
    every = cfg.checkpoint.every
    final = step == cfg.train.steps or last
    return (every > 0 and step % every == 0) or (final and cfg.checkpoint.save_last)


def train_step(s: Session, step: int, stopper: EarlyStopper) -> tuple[dict[str, float], str | None]:
    """One training step; returns its metrics and a stop reason (early stop, or EXITED after analysis)."""
    cfg, m = s.cfg, {}
    s.console.phase("rollout")
    with timed(m, "gen"):
        batch = rollout_groups(cfg, s.model, s.tokenizer,
                               train_seeds(cfg.train.seed_base, cfg.train.env_groups, s.seed_step(step)),
                               cfg.train.group_size, cfg.train.temperature, step_seed(cfg.seed, s.seed_step(step)))
    m.update(env_metric_summary(batch, f"train/{cfg.env.name}", cfg.train.group_size))
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

    batch, filter_m, group_std = filter_batch(batch, cfg.filter)
    m.update(filter_m)
    stop = stopper.after_rollout(filter_m["rollout/in_group_reward_std"], empty=len(batch) == 0)
    m["rollout/empty_after_filter"] = float(len(batch) == 0)
    m["rollout/consecutive_empty_after_filter_steps"] = float(stopper.empty)
    if len(batch) == 0:
        return m, _analyse(s, step, m, None, None, None, 0.0) or stop
    if stop is not None:
        return m, stop

    s.console.phase("log-probs")
    own_old = single_pass(cfg.train, len(batch)) and not cfg.analysis.only and not analysis_due(cfg, step)
    inputs, values, returns = prepare_update(s, batch, m, filter_m["rollout/filter_kept_ratio"], old_pass=not own_old)
    m.update(data_metrics(batch, inputs.advantages, returns, values))

    if s.critic is not None and not cfg.analysis.only:
        s.console.phase("critic")
        with timed(m, "update_critic"):
            m.update(update_critic(s.critic, s.critic_optimizer, batch, values, returns, cfg.algo, cfg.critic,
                                   cfg.train))
    if step <= cfg.critic.warmup_steps:  # critic warm-up: the actor waits for a critic that predicts something
        m["critic/warmup"] = 1.0
        return m, None
    if _analyse(s, step, m, batch, inputs, group_std, filter_m["rollout/filter_kept_ratio"]):
        return m, EXITED
    if not cfg.analysis.only:
        s.console.phase("actor")
        with timed(m, "update_actor"):
            m.update(update_actor(s.model, s.optimizer, batch, inputs, cfg.algo, cfg.train,
                                  torch.Generator().manual_seed(step_seed(cfg.seed, step, stream=1))))
        if inputs.old_logprobs is None:  # one step on the rollout policy: its entropy is the update's
            m["actor/entropy"] = m["actor/entropy_loss"]
        if not all_finite(s.model, s.critic):  # an optimizer step overflowed: nothing left to train or save
            m["actor/non_finite_parameters"] = 1.0
            return m, NON_FINITE_PARAMETERS
    return m, None


def _analyse(s: Session, step: int, m: dict, batch, inputs, group_std, kept_ratio: float) -> str | None:
    """Run the gradient analysis when due; returns EXITED when the run should end right after it."""
    cfg = s.cfg
    m["trainer/gradient_analysis_only"] = float(cfg.analysis.only)
    if not analysis_due(cfg, step):
        return None
    s.console.phase("analysis")
    with timed(m, "gradient_analysis"):
        m.update(run_analysis(s, step, batch, inputs, group_std, kept_ratio,
                              lambda b, metrics, kept: prepare_update(s, b, metrics, kept)))
    crash_point("analysis", step)
    if cfg.analysis.exit_after:
        m["trainer/exited_after_gradient_analysis"] = 1.0
        return EXITED
    return None


def prepare_update(s: Session, batch: RolloutBatch, m: dict, kept_ratio: float, *,
                   old_pass: bool = True) -> tuple[ActorInputs, torch.Tensor | None, torch.Tensor | None]:
    """Old / reference log-probs, critic values, advantages (scaled by the filter) and returns of a batch.

    `old_pass=False` skips the old-log-prob forward for an on-policy update (`actor.single_pass`): the update
    then uses its own detached log-probs (`ActorInputs.old_logprobs` None) and `actor/entropy` comes from it.
    """
    cfg = s.cfg
    micro = cfg.train.micro_batch_size
    inputs = ActorInputs(old_logprobs=None, advantages=torch.zeros_like(batch.response_mask))
    if old_pass:
        with timed(m, "old_log_prob"):
            inputs.old_logprobs, entropy = _logprob_pass(cfg, s.model, batch, with_entropy=True)  # [N, L] each
        m["actor/entropy"] = aggregate(entropy, batch.response_mask, cfg.algo.loss_agg_mode).item()
    if s.ref_model is not None:
        with timed(m, "ref"):
            inputs.ref_logprobs, = _logprob_pass(cfg, s.ref_model, batch, with_entropy=False)  # [N, L]
        m["rollout/ref_log_prob"] = masked_mean(inputs.ref_logprobs, batch.response_mask).item()
    values = None
    if s.critic is not None:
        with timed(m, "values"):
            values, = row_pass((s.critic,), batch, lambda rows: (batch_values(
                s.critic, batch.input_ids[rows], batch.attention_mask[rows], micro_batch_size=micro),))  # [N, L]
    with timed(m, "adv"):
        advantages, returns = advantages_and_returns(batch, values, cfg.algo)  # [N, L]
        inputs.advantages = advantages * loss_scale(kept_ratio, cfg.filter.loss_scaling)  # [N, L]
    return inputs, values, returns


def _logprob_pass(cfg: Config, model, batch: RolloutBatch, *, with_entropy: bool) -> tuple[torch.Tensor, ...]:
    """The log-probs (and entropies) of `batch`'s response tokens under `model`, without gradients, the rows split
    over the ranks (`row_pass`). ([N, L], and [N, L] with `with_entropy`)"""

    def compute(rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logprobs, entropy = batch_logprobs(
            model, batch.input_ids[rows], batch.attention_mask[rows], micro_batch_size=cfg.train.micro_batch_size,
            temperature=cfg.train.temperature, with_entropy=with_entropy, positions=batch.response_mask[rows],
            shared_prefix=cfg.train.shared_prefix)  # [n, L], [n, L] | None
        return (logprobs, entropy) if with_entropy else (logprobs,)

    return row_pass((model,), batch, compute)


def _log_samples(s: Session, step: int, batch: RolloutBatch) -> None:
    k = s.cfg.log.samples_per_step
    if k > 0 and s.main:
        picks = range(0, len(batch), max(1, len(batch) // k))
        s.writer.log_samples(step, [{"seed": batch.seeds[i], "reward": batch.scores[i].item(),
                                     "success": batch.env_metrics[i]["success"], "text": batch.texts[i]}
                                    for i in list(picks)[:k]])


@torch.no_grad()
def validate(s: Session) -> dict[str, float]:
    """Validation rollouts on the fixed puzzles; RNG streams are left as they were.

    Returns only `val-env/<env>/non_finite_logits` when the policy's sampling scores are not finite."""
    cfg = s.cfg
    if s.console is not None:
        s.console.phase("validation")
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        try:
            batch = rollout_groups(cfg, s.model, s.tokenizer, val_seeds(cfg.val.seed_base, cfg.val.env_groups),
                                   cfg.val.group_size, cfg.val.temperature, step_seed(cfg.seed, 0, stream=2))
        except NonFiniteLogits:
            return {f"val-env/{cfg.env.name}/non_finite_logits": 1.0}
    metrics = env_metric_summary(batch, f"val-env/{cfg.env.name}", cfg.val.group_size)
    metrics["timing_s/val"] = time.perf_counter() - start
    return metrics

