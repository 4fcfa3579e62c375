"""The health monitor as a diagnostic of the step (`Health`, at END; `health.*`, docs/health.md).

After every step it reads the step's typed results (`StepRecord`: rollout, filter, prepared inputs, actor update
with its optimizer-step traces, validation, the collapse diagnostic's MI), turns them into `Signals`, and checks
every rule of `analysis/health_rules.py`. For each rule it logs `health/<rule>` (1 on a step where it fires,
else 0); when a rule starts firing it writes one line to `events.jsonl` and acts as configured:

- record: the metric and the event line only;
- warn: also one console line; when the rule stops firing, a `clear` line and one console line more;
- skip (`health.grad_spike`): the rule is the actor update's guard, refusing a spiking optimizer
  step before it is taken (the weights and optimizer state stay as they were); the event says so,
  and every step that refused optimizer steps prints how many;
- rollback: the run goes back to the last state it keeps from before the trouble began and goes on with
  new sampling seeds (`train/trainer.py`; at most `health.max_rollbacks`); with no rollback left it stops
  with that state as its last checkpoint (the policy it leaves is the one before the trouble), and with no
  such state it stops where it is; either way it says why;
- stop: an early stop with `health_<rule>` as its reason (sweeps count it as a failed regime).

Signals no other trainer logs, also logged here: `actor/entropy_cov` (the token covariance of the sampled token's
log-prob and its advantage, `analysis.health_signals.token_covariance`: Cui et al. 2025 predict the step's
entropy change as about −lr × it) beside `actor/entropy_change` (the realised change of the rollout policy's
entropy since the previous step), `health/zero_variance_share`, `health/repetition_rate` and
`health/reward_share/<component>`. The per-layer gradient norms and update ratios come with the actor update
(`health.layer_norms`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rldynamics import metric_names as names
from rldynamics.algo.losses import aggregate
from rldynamics.algo.rollout_corr import k3_kl
from rldynamics.analysis.health_events import VALIDATION_RULES, alarm_row, check_rules, clear_row, writes_row
from rldynamics.analysis.health_rules import (
    RULES,
    Alarm,
    GradSpike,
    NonFinite,
    Repetition,
    Signals,
    UpdateKl,
)
from rldynamics.analysis.health_signals import component_shares, repetition_rate, reply_lengths, token_covariance
from rldynamics.config import Config
from rldynamics.train.checkpoint import checkpoint_step, checkpoints
from rldynamics.train.diagnostics.base import END, ROLL_FORWARD, TRAIN, Diagnostic, DiagnosticResult, Needs, StepRecord
from rldynamics.train.diagnostics.collapse import Collapse, CollapseResult
from rldynamics.train.prepare import logprob_pass
from rldynamics.train.session import Session


class Health(Diagnostic):
    """The rules of `analysis/health_rules.py` with their actions; state: each rule's history."""

    name, point = "health", END
    jobs = frozenset({TRAIN, ROLL_FORWARD})  # it watches training: a probe trains nothing
    reads = (Collapse,)  # the first-turn MI of the template-collapse rule

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.rules = {name: rule(cfg.health) for name, rule in RULES.items()}
        self.last_entropy: float | None = None
        self.fired_at: dict[str, int] = {}  # rule -> the step its latest streak started firing

    @staticmethod
    def enabled(cfg: Config) -> bool:
        return cfg.health.enabled

    def action(self, rule: str) -> str:
        return getattr(self.cfg.health, rule)

    def needs(self, step: int) -> Needs:
        # the entropy covariance and the mismatch read the rollout policy's log-probs; the same-batch entropy change
        # compares the old-log-prob pass's entropy with the batch's after the update
        return Needs(old_logprobs=self.cfg.health.entropy_after_update, update_logprobs=True,
                     layer_traces=self.cfg.health.layer_norms)

    def guard(self, trace) -> bool:
        """Refuse an optimizer step whose gradient norm is a spike (`health.grad_spike=skip`); a
        step without a reward signal (its advantages all 0) is not judged."""
        spike: GradSpike = self.rules[GradSpike.name]
        skip = self.action(GradSpike.name) == "skip"
        return skip and trace.signal and spike.is_spike(trace.grad_norm)

    def before_training(self, validation) -> None:
        """The validation rules start from the validation before training (their best and their first value)."""
        if validation.success is not None:
            x = Signals(step=0)
            _validation_signals(x, self.cfg, validation)
            for name in VALIDATION_RULES:
                self.rules[name].check(x)

    def run(self, s: Session, record: StepRecord) -> DiagnosticResult:
        x = signals(self.cfg, record)
        metrics = self.signal_metrics(s, record, x)
        result = DiagnosticResult(metrics)
        for o in check_rules(self.rules, x):
            metrics[names.health(o.rule)] = float(o.alarm is not None)
            if o.ended is not None:
                self.cleared(s, record.step, o.rule, o.ended)
            if o.alarm is not None:
                self.act(s, x, o.alarm, o.new, result)
            if o.new:
                result.alarms.append(o.rule)
        return result

    def act(self, s: Session, x: Signals, alarm: Alarm, new: bool, result: DiagnosticResult) -> None:
        """Carry out the rule's action: the event line when its trouble is new (or it ends or rolls
        back the run), the console line then too, and on every step that refused optimizer steps."""
        action, why = self.resolve(s, alarm, result)
        if new:
            self.fired_at[alarm.rule] = x.step
        quiet = not writes_row(new, action)
        if s.main and not quiet:
            ends_with = result.end_with if action == "stop" else None
            s.writer.log_event(alarm_row(x.step, alarm, action, why, ends_with))
        if s.console is None or action == "record" or (quiet and action != "skip"):
            return
        done = _refused(alarm.rule, x) if action == "skip" else why
        said = f"{alarm.message} ({alarm.rule}: {self.action(alarm.rule)})"
        s.console.print(f"[yellow]health at step {x.step}: {said}" + (f"; {done}" if done else ""))

    def resolve(self, s: Session, alarm: Alarm, result: DiagnosticResult) -> tuple[str, str]:
        """The action carried out, and why it is not the configured one (a rollback that cannot
        happen stops the run); sets the result's rollback target, or its stop reason and the kept
        state the run ends with."""
        action, why = self.action(alarm.rule), ""
        if action == "rollback":
            target, kept, why = rollback_target(s, alarm.since)
            if target is None:
                action = "stop"
                if kept is not None and (result.end_with is None or kept < result.end_with):
                    result.end_with = kept  # the earliest of the rules' states before their trouble
            elif result.rollback_to is None or target < result.rollback_to:
                result.rollback_to = target  # the earliest of the rules' targets
        if action == "stop":
            result.stop = result.stop or f"health_{alarm.rule}"
        return action, why

    def cleared(self, s: Session, step: int, rule: str, since: int) -> None:
        """A warning whose rule stopped firing (its streak began at `since`): a `clear` event line and a
        console line."""
        if self.action(rule) != "warn":
            return
        row = clear_row(step, rule, since, self.fired_at.get(rule, since))
        if s.main:
            s.writer.log_event(row)
        if s.console is not None:
            s.console.print(f"[green]health at step {step}: {row['message']}")

    def signal_metrics(self, s: Session, record: StepRecord, x: Signals) -> dict[str, float]:
        """The signals no other trainer logs, as metrics."""
        out: dict[str, float] = {}
        after = after_update(s, record, self.cfg.health.entropy_after_update, self.rules[UpdateKl.name].due())
        if after.entropy is not None:
            out[names.ENTROPY_CHANGE_SAME_BATCH] = after.entropy - record.prepared.entropy
        if after.kl is not None:
            out[names.HEALTH_UPDATE_KL] = x.update_kl = after.kl
        if x.zero_variance_share is not None:
            out[names.HEALTH_ZERO_VARIANCE_SHARE] = x.zero_variance_share
        if x.repetition is not None:
            out[names.HEALTH_REPETITION_RATE] = x.repetition
        out.update({names.health_reward_share(k): v for k, v in x.component_shares.items()})
        cov = entropy_covariance(record)
        if cov is not None:
            out[names.ENTROPY_COV] = cov
        if x.entropy is not None:
            if self.last_entropy is not None:
                out[names.ENTROPY_CHANGE] = x.entropy - self.last_entropy
            self.last_entropy = x.entropy
        return out

    def state_dict(self) -> dict:
        return {"rules": {name: rule.state_dict() for name, rule in self.rules.items()},
                "last_entropy": self.last_entropy, "fired_at": dict(self.fired_at)}

    def load_state_dict(self, state: dict) -> None:
        for name, saved in state.get("rules", {}).items():
            if name in self.rules:
                self.rules[name].load_state_dict(saved)
        self.last_entropy = state.get("last_entropy")
        self.fired_at = dict(state.get("fired_at", {}))


def rollback_target(s: Session, since: int) -> tuple[int | None, int | None, str]:
    """(the step a rollback goes back to, the last step before `since` whose state the run keeps, why the run
    stops instead). The kept step is a checkpoint on disk or a state in memory (`train/snapshots.py`, the state
    before step 1 among them); the rollback goes back to it while rollbacks are left (why: ""); with none left
    the run stops with that state as its last checkpoint; with no kept state both are None and it stops where it
    is. The same on every rank (the same signals, the same kept steps)."""
    allowed = s.cfg.health.max_rollbacks
    on_disk = {checkpoint_step(p) for p in checkpoints(s.run_dir)}
    before = sorted(k for k in on_disk | set(s.snapshots.steps() if s.snapshots else ()) if k < since)
    if not before:
        return None, None, f"cannot roll back: no checkpoint or state in memory before step {since}; stopping"
    kept = before[-1]
    ending = f"stopping with the state of step {kept}, from before the trouble, as the last checkpoint"
    if allowed == 0:
        return None, kept, f"no rollbacks allowed (health.max_rollbacks=0); {ending}"
    if s.attempt >= allowed:
        return None, kept, f"no rollbacks left (health.max_rollbacks={allowed}, all used); {ending}"
    return kept, kept, ""


def _refused(rule: str, x: Signals) -> str:
    """`2 optimizer steps refused` (a spike) or `... skipped` (a non-finite gradient)."""
    non_finite = rule == NonFinite.name
    count, done = (x.non_finite_skips, "skipped") if non_finite else (x.refused, "refused")
    return f"{count} optimizer step{'' if count == 1 else 's'} {done}"


def signals(cfg: Config, record: StepRecord) -> Signals:
    """The numbers the rules read, from the step's typed results."""
    x = Signals(step=record.step, progress=record.step / cfg.train.steps, first_step=record.step == 1,
                sampler_is_trainer=cfg.rollout.engine == "hf",
                staleness=min(cfg.rollout.staleness, record.step - 1))
    if record.rollout is not None:
        batch = record.rollout
        lengths = reply_lengths(batch.response_mask)
        if lengths:
            x.reply_mean = sum(lengths) / len(lengths)
            x.truncation = sum(n >= cfg.env.max_new_tokens for n in lengths) / len(lengths)
        x.repetition = repetition_rate(batch.input_ids, batch.response_mask, Repetition.ngram,
                                       Repetition.share)
        x.component_shares = component_shares(batch.reward_components, batch.reward_weights, batch.reward_names)
        if batch.env_metrics:  # one per trajectory: train/<env>/success is their mean
            x.train_count = len(batch.env_metrics)
            x.train_success = sum(m[names.SUCCESS] for m in batch.env_metrics) / x.train_count
    if record.filtered is not None and record.filtered.group_std:
        stds = list(record.filtered.group_std.values())
        x.zero_variance_share = sum(v <= 1e-8 for v in stds) / len(stds)
    if record.prepared is not None and record.prepared.entropy is not None:
        x.entropy = record.prepared.entropy
    _update_signals(x, record, cfg.algo.old_logprobs)
    x.mismatch_kl = _mismatch_kl(record)
    collapse: CollapseResult | None = record.result_of(Collapse)
    x.mi = collapse.mi if collapse is not None else None
    if record.validation is not None and record.validation.success is not None:
        _validation_signals(x, cfg, record.validation)
    return x


def _validation_signals(x: Signals, cfg: Config, validation) -> None:
    """Success, trajectories and the success's standard error clustered by problem
    (`stages.problem_metrics`), when logged over two problems or more (None: the rules take the
    binomial one)."""
    x.val_success, x.val_count = validation.success, validation.trajectories
    env = cfg.env.name
    se = validation.metrics.get(names.env_metric(env, names.SUCCESS_SE, validation=True))
    problems = validation.metrics.get(names.env_metric(env, names.PROBLEMS, validation=True), 0)
    x.val_se = se if se is not None and problems >= 2 else None


def _update_signals(x: Signals, record: StepRecord, old_from: str) -> None:
    update = record.update
    if update is None:
        return
    if x.entropy is None:
        x.entropy = update.entropy
    x.grad_norms = tuple(t.grad_norm for t in update.steps if t.signal)
    x.non_finite_skips = sum(not math.isfinite(t.grad_norm) for t in update.steps)
    x.refused = sum(t.skipped and math.isfinite(t.grad_norm) for t in update.steps)
    # with the sampler's log-probs as pi_old (algo.old_logprobs=sampler) the first step's PPO KL is the mismatch, not ~0
    on_trainer = old_from == "trainer"
    x.first_ppo_kl = update.steps[0].stats.get("ppo_kl") if update.steps and on_trainer else None
    x.ppo_kl, x.clipfrac, x.kl_ref = update.ppo_kl, update.clipfrac_high + update.clipfrac_low, update.kl_loss


def _mismatch_kl(record: StepRecord) -> float | None:
    """The sampler/trainer k3 KL of the filtered batch, when the sampler's log-probs and the trainer's are known."""
    old = record.rollout_policy_logprobs()
    if record.filtered is None or old is None or record.filtered.batch.rollout_logprobs is None:
        return None
    batch = record.filtered.batch
    return k3_kl(old, batch.rollout_logprobs, batch.response_mask)


@dataclass(frozen=True)
class AfterUpdate:
    """The filtered batch under the updated policy (None: not measured)."""

    entropy: float | None = None  # its sampled tokens' entropy, aggregated like the old-log-prob pass's
    kl: float | None = None  # KL (k3) of the policy before the update from the policy after it, over its tokens


def after_update(s: Session, record: StepRecord, entropy: bool, kl: bool) -> AfterUpdate:
    """The batch's `entropy` and the update's `kl` under the updated policy, from one no-grad forward (none when
    neither is asked, nothing updated, or the policy before the update is unknown)."""
    before = record.rollout_policy_logprobs()  # [N, L]
    entropy = entropy and record.prepared is not None and record.prepared.entropy is not None
    kl = kl and before is not None
    if record.update is None or not (entropy or kl):
        return AfterUpdate()
    batch = record.filtered.batch
    logprobs, *token_entropy = logprob_pass(s.cfg, s.model, batch, with_entropy=entropy)  # [N, L] each
    return AfterUpdate(
        entropy=aggregate(token_entropy[0], batch.response_mask, s.cfg.algo.loss_agg_mode).item() if entropy else None,
        kl=k3_kl(logprobs, before, batch.response_mask) if kl else None)  # r = pi_after / pi_before


def entropy_covariance(record: StepRecord) -> float | None:
    """`token_covariance` of the rollout policy's log-probs and the trained advantages of the filtered batch."""
    old = record.rollout_policy_logprobs()
    if record.prepared is None or old is None:
        return None
    return token_covariance(old, record.prepared.inputs.advantages, record.filtered.batch.response_mask)
