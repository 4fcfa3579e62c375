"""The stages of a step, shared by `rldyn train` (`train/trainer.py`), `rldyn probe` (`train/probe.py`) and
`rldyn eval` (`train/evaluate.py`); each command composes them in its own way.

    roll_out -> filter_batch -> stop_after_filter -> prepare -> critic_update -> actor_update -> sync_engine

(`begin` is the opening both a training step and a probe share: rollout, ROLLOUT diagnostics, filter, stopper.)

Each stage returns its typed result with its own metrics (and timings); the composition records them in a
`StepRecord` and merges the row in one place. The diagnostics (`train/diagnostics/`) run at the points
`ROLLOUT`, `BEFORE_UPDATE` and `END` through `run_point`; the step asks the due ones what passes they need
(`needs`) before preparing the update. `validate` is the validation stage (the fixed validation seeds, RNG
streams left as they were).

Every sampling call is seeded from (seed, step): a resumed run replays exactly the steps an uninterrupted run
would have taken.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from rldynamics import metric_names as names
from rldynamics.rollout.agent import env_metric_summary
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.rollout.rewards import reward_component_metrics, reward_rows, reward_stats
from rldynamics.rollout.sampling import NonFiniteLogits
from rldynamics.train.actor import ActorUpdate, update_actor
from rldynamics.train.checkpoint import crash_point
from rldynamics.train.critic import update_critic
from rldynamics.train.diagnostics.base import ROLLOUT, Diagnostic, DiagnosticResult, Needs, StepRecord
from rldynamics.train.early_stop import EarlyStopper
from rldynamics.train.prepare import Prepared, prepare_update
from rldynamics.train.setup import Session
from rldynamics.train.sharded import rollout_groups
from rldynamics.train.stages import (
    Filtered,
    Validation,
    data_metrics,
    env_seeds,
    filter_batch,
    problem_metrics,
    step_seed,
    train_seeds,
    val_seeds,
)

NON_FINITE_LOGITS = "non_finite_logits"  # the stop reason of a rollout whose sampling scores were not finite
ATTEMPT_STREAM = 1000  # sampling streams of the attempts after rollbacks (0 for the first attempt)


@dataclass
class Rollout:
    """A step's rollout before the filter, logged (`rewards.jsonl`, samples) and summarised."""

    batch: RolloutBatch  # every group of the step
    metrics: dict[str, float]  # `<env>/*` summaries, reward components and statistics, `timing_s/gen`


@dataclass
class FilterDecision:
    """The early stopper's word on the filter's outcome."""

    stop: str | None  # a stop reason (reward-variance collapse, too many empty batches), or None
    metrics: dict[str, float]  # `rollout/empty_after_filter`, `rollout/consecutive_empty_after_filter_steps`


def roll_out(s: Session, step: int, seed_step: int) -> Rollout:
    """Roll out the groups of `seed_step`'s env seeds and sampling seed; log their rewards and samples as `step`."""
    cfg = s.cfg
    s.console.phase("rollout")
    start = time.perf_counter()
    batch = rollout_groups(cfg, s.model, s.tokenizer,
                           env_seeds(cfg, train_seeds(cfg.train.seed_base, cfg.train.env_groups, seed_step)),
                           cfg.train.group_size, cfg.train.temperature, sampling_seed(s, seed_step),
                           engine=s.engine)
    metrics = {names.timing("gen"): time.perf_counter() - start}
    metrics.update(env_metric_summary(batch, names.env_prefix(cfg.env.name), cfg.train.group_size))
    metrics.update(reward_component_metrics(batch.reward_components, batch.reward_names, batch.group_ids))
    rows = reward_rows(batch, step, s.tokenizer)
    if s.main:
        s.writer.log_rewards(rows)
    metrics.update(reward_stats(rows, batch.reward_names))
    _log_samples(s, step, batch)
    crash_point("samples", step)
    return Rollout(batch, metrics)


def begin(s: Session, due: list[Diagnostic], record: StepRecord, stopper: EarlyStopper) -> FilterDecision:
    """The opening of a training step and of a probe, recorded in `record`: the rollout of `record.seed_step`'s
    seeds, the ROLLOUT diagnostics, the filter and the early stopper's word on it."""
    rollout = roll_out(s, record.step, record.seed_step)
    record.rollout, record.sampling_seed = rollout.batch, sampling_seed(s, record.seed_step)
    record.add(rollout.metrics)
    run_point(s, due, ROLLOUT, record)
    record.filtered = filter_batch(rollout.batch, s.cfg.filter)
    decision = stop_after_filter(stopper, record.filtered)
    record.add(record.filtered.metrics, decision.metrics)
    return decision


def sampling_seed(s: Session, step: int) -> int:
    """The rollout's sampling seed of `step`: (seed, step), and after the k-th rollback a stream of its own (the
    same puzzles, new samples)."""
    return step_seed(s.cfg.seed, step, stream=ATTEMPT_STREAM * s.attempt)


def stop_after_filter(stopper: EarlyStopper, filtered: Filtered) -> FilterDecision:
    """Give the filter's outcome to the early stopper (reward-variance rule, empty batches)."""
    empty = len(filtered.batch) == 0
    stop = stopper.after_rollout(filtered.reward_std, empty=empty)
    return FilterDecision(stop, {
        names.EMPTY_AFTER_FILTER: float(empty),
        names.filter_metric(names.ROLLOUT, "consecutive_empty_after_filter_steps"): float(stopper.empty)})


def prepare(s: Session, filtered: Filtered, *, old_pass: bool = True, ref_pass: bool = True) -> Prepared:
    """The update's inputs of the filtered batch (`prepare_update`) with the batch summaries (`data_metrics`)."""
    s.console.phase("log-probs")
    prepared = prepare_update(s, filtered.batch, filtered.kept_ratio, old_pass=old_pass, ref_pass=ref_pass)
    summaries = data_metrics(filtered.batch, prepared.inputs.advantages, prepared.returns, prepared.values)
    return replace(prepared, metrics={**prepared.metrics, **summaries})


def critic_update(s: Session, batch: RolloutBatch, prepared: Prepared) -> dict[str, float]:
    """The critic's value regression on the batch; its `critic/*` metrics and timing."""
    cfg = s.cfg
    s.console.phase("critic")
    start = time.perf_counter()
    metrics = update_critic(s.critic, s.critic_optimizer, batch, prepared.values, prepared.returns, cfg.algo,
                            cfg.critic, cfg.train)
    return {**metrics, names.timing("update_critic"): time.perf_counter() - start}


def actor_update(s: Session, step: int, batch: RolloutBatch, prepared: Prepared, *, record: bool,
                 guard=None) -> ActorUpdate:
    """The actor's PPO epochs on the batch (`update_actor`, mini-batches shuffled by (seed, step)); with `record`
    the update keeps its own log-probs of the sampled tokens; `guard` may refuse an optimizer step."""
    cfg = s.cfg
    s.console.phase("actor")
    start = time.perf_counter()
    update = update_actor(s.model, s.optimizer, batch, prepared.inputs, cfg.algo, cfg.train,
                          torch.Generator().manual_seed(step_seed(cfg.seed, step, stream=1)), record=record,
                          guard=guard, trace_groups=cfg.health.enabled and cfg.health.layer_norms)
    update.metrics[names.timing("update_actor")] = time.perf_counter() - start
    return update


def sync_engine(s: Session) -> dict[str, float]:
    """Give the rollout engine the updated weights; the sync's timing."""
    start = time.perf_counter()
    s.engine.sync(s.model)
    return {names.timing("weight_sync"): time.perf_counter() - start}


def due_diagnostics(s: Session, step: int) -> list[Diagnostic]:
    """The session's diagnostics due at `step`, in their fixed order."""
    return [d for d in s.diagnostics if d.due(step)]


def needs_of(due: list[Diagnostic], step: int) -> Needs:
    """What the due diagnostics need from the step, together."""
    out = Needs()
    for d in due:
        out = out | d.needs(step)
    return out


def run_point(s: Session, due: list[Diagnostic], point: str, record: StepRecord) -> str | None:
    """Run the due diagnostics of `point` in order, record their metrics (and `timing_s/<name>`); returns the first
    stop reason one gave (None: go on)."""
    stop = None
    for d in due:
        if d.point != point:
            continue
        if d.phase:
            s.console.phase(d.phase)
        start = time.perf_counter()
        result: DiagnosticResult = d.run(s, record)
        record.results[d.name] = result
        record.add(result.metrics, {names.timing(d.name): time.perf_counter() - start})
        stop = stop or result.stop
    return stop


def guard_of(due: list[Diagnostic]):
    """The due diagnostics' guards as one (any refusal refuses the optimizer step); None when none has one."""
    guards = [d.guard for d in due if type(d).guard is not Diagnostic.guard]
    return (lambda trace: any(g(trace) for g in guards)) if guards else None


def non_finite_logits() -> dict[str, float]:
    """The row of a step whose sampling scores were not finite."""
    return {names.filter_metric(names.ROLLOUT, NON_FINITE_LOGITS): 1.0}


def _log_samples(s: Session, step: int, batch: RolloutBatch) -> None:
    k = s.cfg.log.samples_per_step
    if k > 0 and s.main:
        picks = range(0, len(batch), max(1, len(batch) // k))
        s.writer.log_samples(step, [{"seed": batch.seeds[i], "reward": batch.scores[i].item(),
                                     "success": batch.env_metrics[i][names.SUCCESS], "text": batch.texts[i]}
                                    for i in list(picks)[:k]])


@torch.no_grad()
def validate(s: Session) -> Validation:
    """Validation rollouts on the fixed puzzles; RNG streams are left as they were.

    Its metrics are only `val-env/<env>/non_finite_logits` when the policy's sampling scores are not finite."""
    cfg = s.cfg
    if s.console is not None:
        s.console.phase("validation")
    start = time.perf_counter()
    prefix = names.env_prefix(cfg.env.name, validation=True)
    with torch.random.fork_rng(devices=[]):
        try:
            batch = rollout_groups(cfg, s.model, s.tokenizer,
                                   env_seeds(cfg, val_seeds(cfg.val.seed_base, cfg.val.env_groups), validation=True),
                                   cfg.val.group_size, cfg.val.temperature, step_seed(cfg.seed, 0, stream=2),
                                   engine=s.engine)
        except NonFiniteLogits:
            return Validation(None, {names.env_metric(cfg.env.name, NON_FINITE_LOGITS, validation=True): 1.0})
    metrics = env_metric_summary(batch, prefix, cfg.val.group_size)
    metrics.update(reward_component_metrics(batch.reward_components, batch.reward_names, batch.group_ids,
                                            names.VAL_REWARD))
    metrics.update(problem_metrics(batch, cfg, prefix))
    metrics[names.VAL_TIME] = time.perf_counter() - start
    success = sum(m[names.SUCCESS] for m in batch.env_metrics) / len(batch) if batch.env_metrics else None
    return Validation(success, metrics, trajectories=len(batch))
