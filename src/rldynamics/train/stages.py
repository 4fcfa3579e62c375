"""The stages of a step, shared by `rldyn train` (`train/trainer.py`), `rldyn probe` (`train/probe.py`), `rldyn
replay` (`train/replay.py`) and `rldyn eval` (`train/evaluate.py`); each command composes them in its own way.

    roll_out -> filter_batch -> stop_after_filter -> update_phase -> sync_engine

`begin` is the opening a training step and a probe share: rollout, ROLLOUT diagnostics, filter, stopper.
`update_phase` is the update of a step, the same for training and replay:

    prepare (old / reference passes, values, advantages) -> critic update -> the critic's warm-up rule ->
    [BEFORE_UPDATE] -> actor update -> the finite check

Its decisions (which passes run, whether the actor updates) are made in one place, `plan_update`, from the config,
the step and what the due diagnostics need: a replay of a recorded step makes them the same way.

Each stage returns its typed result with its own metrics (and timings); the composition records them in a
`StepRecord` (`train/step_record.py`) and merges the row in one place. The diagnostics (`train/diagnostics/`) run at
the points `ROLLOUT`, `BEFORE_UPDATE` and `END` through `run_point`; the step asks the due ones what they need
(`needs_of`) before preparing the update. `validate` is the validation stage (the fixed validation seeds, RNG
streams left as they were).

Every sampling call is seeded from (seed, step): a resumed run replays exactly the steps an uninterrupted run
would have taken.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from rldynamics import metric_names as names
from rldynamics.config import Config
from rldynamics.models.sharding import all_finite
from rldynamics.rollout.agent import env_metric_summary
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.rollout.rewards import reward_component_metrics, reward_rows, reward_stats
from rldynamics.rollout.sampling import NonFiniteLogits
from rldynamics.train.actor import ActorUpdate, rows_after_first_step, update_actor, update_mini_batches
from rldynamics.train.batch_ops import (
    Filtered,
    Validation,
    data_metrics,
    env_seeds,
    filter_batch,
    problem_metrics,
    step_seed,
    train_seeds,
    validation_seeds,
)
from rldynamics.train.checkpoint import crash_point
from rldynamics.train.critic import update_critic
from rldynamics.train.diagnostics.base import BEFORE_UPDATE, ROLLOUT, Diagnostic, DiagnosticResult, Needs
from rldynamics.train.early_stop import EarlyStopper
from rldynamics.train.lagged import version_of
from rldynamics.train.prepare import Prepared, prepare_update
from rldynamics.train.session import Session
from rldynamics.train.sharded import rollout_groups
from rldynamics.train.step_record import StepRecord

NON_FINITE_LOGITS = "non_finite_logits"  # the stop reason of a rollout whose sampling scores were not finite
NON_FINITE_PARAMETERS = "non_finite_parameters"  # ... of an update that left a parameter non-finite
ATTEMPT_STREAM = 1000  # sampling streams of the attempts after rollbacks (0 for the first attempt)


@dataclass
class Rollout:
    """A step's rollout before the filter, logged (`rewards.jsonl`, samples) and summarised."""

    batch: RolloutBatch  # every group of the step
    metrics: dict[str, float]  # `<env>/*` summaries, reward components and statistics, `timing_s/gen`
    policy_version: int | None = None  # rollout.staleness: the step whose weights sampled it (None: the current)


@dataclass
class FilterDecision:
    """The early stopper's word on the filter's outcome."""

    stop: str | None  # a stop reason (reward-variance collapse, too many empty batches), or None
    metrics: dict[str, float]  # `rollout/empty_after_filter`, `rollout/consecutive_empty_after_filter_steps`


def roll_out(s: Session, step: int, seed_step: int) -> Rollout:
    """Roll out the groups of `seed_step`'s env seeds and sampling seed (or take the batch generated ahead for
    `step`: `generate_ahead`); log their rewards and samples as `step`."""
    cfg = s.cfg
    s.console.phase("rollout")
    ahead = s.lagged.take(step) if s.lagged is not None else None
    if ahead is None:
        start = time.perf_counter()
        batch = generation(s, step, seed_step)()
        metrics = {names.timing("gen"): time.perf_counter() - start}
    else:
        batch, metrics = ahead.batch, {names.timing("gen"): ahead.seconds, names.timing("gen_wait"): ahead.waited}
    version = version_of(step, cfg.rollout.staleness) if s.lagged is not None else None
    if version is not None:
        metrics.update({names.POLICY_VERSION: float(version), names.STALENESS: float(step - 1 - version)})
    metrics.update(env_metric_summary(batch, names.env_prefix(cfg.env.name), cfg.train.group_size))
    metrics.update(reward_component_metrics(batch.reward_components, batch.reward_names, batch.group_ids))
    rows = reward_rows(batch, step, s.tokenizer)
    for row in rows if version is not None else ():
        row["policy_version"] = version  # each trajectory: the weights that sampled it
    if s.main:
        s.writer.log_rewards(rows)
    metrics.update(reward_stats(rows, batch.reward_names))
    _log_samples(s, step, batch)
    crash_point("samples", step)
    return Rollout(batch, metrics, version)


def generation(s: Session, step: int, seed_step: int) -> Callable[[], RolloutBatch]:
    """The rollout of `seed_step`'s seeds as work to run: on the trainer's model, or under `rollout.staleness` on
    the sampler, which this call sets to `step`'s version (so the work may run in another thread)."""
    cfg = s.cfg
    model = s.model if s.lagged is None else s.lagged.model_for(step)
    seeds = env_seeds(cfg, train_seeds(cfg.train.seed_base, cfg.train.env_groups, seed_step))
    seed = sampling_seed(s, seed_step)
    return lambda: rollout_groups(cfg, model, s.tokenizer, seeds, cfg.train.group_size, cfg.train.temperature, seed,
                                  engine=s.engine)


def generate_ahead(s: Session, step: int) -> None:
    """`rollout.overlap`: start `step`'s rollout in a thread, to run while the step before it updates."""
    s.lagged.launch(step, generation(s, step, step))


def begin(s: Session, due: list[Diagnostic], record: StepRecord, stopper: EarlyStopper) -> FilterDecision:
    """The opening of a training step and of a probe, recorded in `record`: the rollout of `record.seed_step`'s
    seeds, the ROLLOUT diagnostics, the filter and the early stopper's word on it."""
    rollout = roll_out(s, record.step, record.seed_step)
    record.rollout, record.sampling_seed = rollout.batch, sampling_seed(s, record.seed_step)
    record.policy_version = rollout.policy_version
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


def prepare(s: Session, filtered: Filtered, *, old_pass: bool = True, ref_pass: bool = True,
            later_rows: torch.Tensor | None = None) -> Prepared:
    """The update's inputs of the filtered batch (`prepare_update`) with the batch summaries (`data_metrics`)."""
    s.console.phase("log-probs")
    prepared = prepare_update(s, filtered.batch, filtered.kept_ratio, old_pass=old_pass, ref_pass=ref_pass,
                              later_rows=later_rows)
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
                 guard=None, layer_traces: bool = False, own_old: bool = False,
                 minis: list[torch.Tensor] | None = None) -> ActorUpdate:
    """The actor's PPO epochs on the batch (`update_actor`, mini-batches shuffled by (seed, step), or `minis`, the
    plan's); with `record` the update keeps its own log-probs of the sampled tokens; `guard` may refuse an
    optimizer step; `layer_traces` adds per-layer norms to its optimizer-step traces; `own_old`: the update takes
    its first step's own log-probs as old ones (`UpdatePlan.own_old`), whether or not a whole old-log-prob pass
    ran."""
    cfg = s.cfg
    s.console.phase("actor")
    start = time.perf_counter()
    inputs = replace(prepared.inputs, old_logprobs=None) if own_old else prepared.inputs
    update = update_actor(s.model, s.optimizer, batch, inputs, cfg.algo, cfg.train,
                          update_generator(cfg, step), record=record, guard=guard, trace_groups=layer_traces,
                          later_old=prepared.later_old, minis=minis)
    update.metrics[names.timing("update_actor")] = time.perf_counter() - start
    return update


@dataclass(frozen=True)
class UpdatePlan:
    """The update phase's decisions for one step."""

    old_pass: bool  # the old-log-prob pass runs over every row (for the update, or for a diagnostic)
    own_old: bool  # the update takes its first optimizer step's own log-probs as that step's rows' old ones
    minis: list[torch.Tensor]  # the update's mini-batches (`actor.update_mini_batches`), one optimizer step each
    later_rows: torch.Tensor | None  # [K] with `own_old` and several optimizer steps: the rows after the first
    # step (`actor.rows_after_first_step`), whose old log-probs a pass over them alone gives (none when K = 0)
    ref_pass: bool  # the reference pass runs (where the session has a reference model)
    keep_logprobs: bool  # the actor update keeps its own log-probs of the sampled tokens
    layer_traces: bool  # the optimizer-step traces carry per-layer norms
    actor: bool  # the actor updates (False during the critic's warm-up)


def plan_update(cfg: Config, step: int, rows: int, needs: Needs) -> UpdatePlan:
    """What the update of `step` on `rows` kept trajectories runs, given what the due diagnostics `needs`.

    The update's first optimizer step sees the parameters that sampled the batch, so its forwards give the old
    log-probs of its rows, and the old-log-prob pass runs over the other rows only (none in a one-step update, half
    with the default's two mini-batches); not with LoRA dropout and several steps (the dropout acting in the
    update's forwards would make the first step's log-probs noisy old ones for the later steps). The whole pass
    runs where a diagnostic asks for it, for the diagnostic alone: the update computes as without it, so a
    diagnostic never changes the trained weights. The actor waits for `critic.warmup_steps` steps so that it
    learns from a critic that predicts something."""
    actor = step > cfg.critic.warmup_steps
    minis = update_mini_batches(cfg.train, rows, update_generator(cfg, step))
    own_old = len(minis) == 1 or cfg.model.lora.rank == 0 or cfg.model.lora.dropout == 0
    later = rows_after_first_step(minis, rows) if own_old and len(minis) > 1 and actor else None
    return UpdatePlan(old_pass=needs.old_logprobs or not own_old, own_old=own_old, minis=minis, later_rows=later,
                      ref_pass=cfg.algo.kl_coef > 0 or needs.ref_logprobs,
                      keep_logprobs=own_old and needs.update_logprobs, layer_traces=needs.layer_traces, actor=actor)


def update_generator(cfg: Config, step: int) -> torch.Generator:
    """The generator of `step`'s actor update (its mini-batch shuffle, its LoRA dropout), the same for every call."""
    return torch.Generator().manual_seed(step_seed(cfg.seed, step, stream=1))


@dataclass(frozen=True)
class UpdateOutcome:
    """What the update phase did: its plan, the stop it met (None: the step goes on) and whether the actor
    updated (its result is `record.update`)."""

    plan: UpdatePlan | None  # None: the filter kept nothing, so nothing was prepared
    stop: str | None = None  # a stop reason from before the actor update, or NON_FINITE_PARAMETERS after it
    actor_updated: bool = False


def update_phase(s: Session, record: StepRecord, needs: Needs, *, guard=None,
                 before_actor: Callable[[], str | None] = lambda: None) -> UpdateOutcome:
    """The update of `record`'s step on its filtered batch, recorded in `record` (`prepared`, `update`, metrics):
    prepare -> critic update -> the warm-up rule -> `before_actor` (the BEFORE_UPDATE diagnostics; a stop reason
    ends the phase) -> actor update (`guard` may refuse optimizer steps) -> the finite check. With nothing kept,
    `before_actor` alone runs (an analysis of a batch of its own still can)."""
    batch, cfg = record.filtered.batch, s.cfg
    if len(batch) == 0:
        return UpdateOutcome(None, before_actor())
    plan = plan_update(cfg, record.step, len(batch), needs)
    record.prepared = prepared = prepare(s, record.filtered, old_pass=plan.old_pass, ref_pass=plan.ref_pass,
                                         later_rows=plan.later_rows)
    record.add(prepared.metrics)
    if s.critic is not None:
        record.add(critic_update(s, batch, prepared))
    if not plan.actor:
        record.add({names.CRITIC_WARMUP: 1.0})
        return UpdateOutcome(plan)
    stop = before_actor()
    if stop is not None:
        return UpdateOutcome(plan, stop)
    record.update = update = actor_update(s, record.step, batch, prepared, record=plan.keep_logprobs, guard=guard,
                                          layer_traces=plan.layer_traces, own_old=plan.own_old, minis=plan.minis)
    record.add(update.metrics)
    if prepared.entropy is None:  # the rollout policy's entropy came from the update's forwards
        record.add({names.ENTROPY: update.entropy if update.rollout_entropy is None else update.rollout_entropy})
    if not all_finite(s.model, s.critic):  # an optimizer step overflowed: nothing left to train or save
        record.add({names.actor(NON_FINITE_PARAMETERS): 1.0})
        return UpdateOutcome(plan, NON_FINITE_PARAMETERS, actor_updated=True)
    return UpdateOutcome(plan, actor_updated=True)


def sync_engine(s: Session) -> dict[str, float]:
    """Give the rollout engine the updated weights; the sync's timing."""
    start = time.perf_counter()
    if s.lagged is not None:  # the engine holds the sampler's lagged weights: a rollout ahead may be using it
        s.lagged.wait()
    s.engine.sync(s.model)
    if s.lagged is not None:
        s.lagged.engine_lent()  # the trainer's weights: the next rollout syncs the sampler's again
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


def before_update(s: Session, due: list[Diagnostic], record: StepRecord, *, updates: bool = True) -> str | None:
    """The BEFORE_UPDATE point, its row flagged with whether the job updates (RAGEN's `gradient_analysis_only`:
    0 for a training step, 1 for a probe); the first stop reason a diagnostic gave."""
    record.add({names.NO_UPDATE_JOB: float(not updates)})
    return run_point(s, due, BEFORE_UPDATE, record)


def exit_line(record: StepRecord) -> str | None:
    """The line of the first diagnostic that ends the run right after this step (None: none does)."""
    return next((r.exit_line for r in record.results.values() if r.exit_line is not None), None)


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
            batch = rollout_groups(cfg, s.model, s.tokenizer, validation_seeds(cfg), cfg.val.group_size,
                                   cfg.val.temperature, step_seed(cfg.seed, 0, stream=2), engine=s.engine)
        except NonFiniteLogits:
            return Validation(None, {names.env_metric(cfg.env.name, NON_FINITE_LOGITS, validation=True): 1.0})
    metrics = env_metric_summary(batch, prefix, cfg.val.group_size)
    metrics.update(reward_component_metrics(batch.reward_components, batch.reward_names, batch.group_ids,
                                            names.VAL_REWARD))
    metrics.update(problem_metrics(batch, cfg, prefix))
    metrics[names.VAL_TIME] = time.perf_counter() - start
    success = sum(m[names.SUCCESS] for m in batch.env_metrics) / len(batch) if batch.env_metrics else None
    return Validation(success, metrics, trajectories=len(batch))
