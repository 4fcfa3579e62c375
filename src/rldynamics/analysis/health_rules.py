"""The health monitor's rules: pure functions of each step's numbers (`Signals`) and the rule's own history.

Each rule looks at one failure mode and, when its condition holds at a step, returns an `Alarm` with the value it
saw, the threshold it compared against and the step its trouble began (`since`: a rollback goes back to a
checkpoint saved before it). What each signal means, what usually causes it and what to try: docs/health.md.

`RULES` is the table (name -> class, in the order they are checked); `health.<name>` in the config sets a rule's
action (`train/diagnostics/health.py` carries it out) and `health.<name>_<knob>` its thresholds. The defaults
and the runs they were measured on: docs/health.md.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from rldynamics.config import HealthConfig

CLEAR = "clear"  # the action of the events.jsonl row written when a warning's rule stops firing


@dataclass
class Signals:
    """The numbers of one step that the rules read (None where the step had none)."""

    step: int
    progress: float = 0.0  # step / train.steps
    first_step: bool = False  # the first step of a run started from scratch
    entropy: float | None = None  # the rollout policy's entropy of the sampled tokens (aggregated like the loss)
    zero_variance_share: float | None = None  # groups whose rewards are all equal / all groups (before the filter)
    # pre-clip gradient norm of each optimizer step with a reward signal (some advantage not 0; a
    # step of equal-reward groups alone under GRPO / RLOO has a norm ~0 and is left out)
    grad_norms: tuple[float, ...] = ()
    first_ppo_kl: float | None = None  # PPO KL of the update's first optimizer step (0 on the rollout policy)
    ppo_kl: float | None = None  # the update's mean PPO KL (policy drift within the step)
    clipfrac: float | None = None  # the update's mean clipped share of tokens (low + high)
    kl_ref: float | None = None  # the update's KL to the reference model (with the KL term on)
    mismatch_kl: float | None = None  # sampler/trainer KL (k3) of the sampled tokens, when measured
    sampler_is_trainer: bool = True  # the HF engine: the trainer's own model samples (the mismatch must be ~0)
    reply_mean: float | None = None  # mean sampled tokens per reply
    truncation: float | None = None  # share of replies that reached env.max_new_tokens
    repetition: float | None = None  # share of replies that repeat their own n-grams
    component_shares: dict[str, float] = field(default_factory=dict)  # reward component -> its variance share
    mi: float | None = None  # template collapse: the first-turn MI estimate, when measured this step
    val_success: float | None = None  # validation success of this step, when validated
    val_count: int = 0  # trajectories of that validation
    val_se: float | None = None  # its SE clustered by problem (val-env/<env>/success_se), if logged
    non_finite_skips: int = 0  # optimizer steps skipped for a non-finite gradient
    refused: int = 0  # optimizer steps the guard refused (a gradient spike)


@dataclass(frozen=True)
class Alarm:
    """A rule's condition holding at a step."""

    rule: str
    value: float  # what the rule saw
    threshold: float  # what it compared against
    since: int  # the first step of this trouble
    message: str  # one line: what was seen


class Rule:
    """A rule: `check` a step's signals against the rule's thresholds and its history."""

    name = ""
    # the `Signals` fields the rule reads: it can fire only where each group has one of its fields (logs of
    # another trainer may lack them: `rldyn doctor` names the rules that cannot run)
    needs: tuple[tuple[str, ...], ...] = ()

    def __init__(self, cfg: HealthConfig):
        self.cfg = cfg
        self.streak_start: int | None = None  # first step of the current run of firing steps

    def check(self, x: Signals) -> Alarm | None:
        raise NotImplementedError

    def sees(self, x: Signals) -> bool:
        """Whether the step has this rule's signal at all (a step without it neither starts nor ends its streak)."""
        return True

    def alarm(self, x: Signals, value: float, threshold: float, message: str, since: int | None = None) -> Alarm:
        return Alarm(self.name, float(value), float(threshold), x.step if since is None else since, message)

    def state_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "cfg"}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            if hasattr(self, k):
                setattr(self, k, v)


class EntropyCollapse(Rule):
    """The entropy fell below `ratio` x its mean over the run's first steps: the first
    `baseline_steps`, up to the first step whose update was damaged (a non-finite or refused
    optimizer step, or the policy_drift condition). A step's entropy is measured before its update,
    so the later ones carry that damage."""

    name = "entropy_collapse"
    needs = (("entropy",),)

    def __init__(self, cfg: HealthConfig):
        super().__init__(cfg)
        self.start: list[float] = []
        self.start_closed = False  # a damaged update ended the start early

    def damaged(self, x: Signals) -> bool:
        """Whether the step's update was damaged: a non-finite or refused optimizer step, drift."""
        drift = (x.ppo_kl is not None and x.ppo_kl > self.cfg.drift_kl) or (
            x.clipfrac is not None and x.clipfrac > self.cfg.drift_clipfrac)
        return bool(x.non_finite_skips or x.refused or drift)

    def check(self, x: Signals) -> Alarm | None:
        if x.entropy is None:
            return None
        if len(self.start) < self.cfg.baseline_steps and not self.start_closed:
            self.start.append(x.entropy)
            self.start_closed = self.damaged(x)
            return None
        base = sum(self.start) / len(self.start)
        limit = self.cfg.entropy_collapse_ratio * base
        if x.entropy >= limit:
            return None
        return self.alarm(x, x.entropy, limit, f"entropy {x.entropy:.3g} < {self.cfg.entropy_collapse_ratio:g} x "
                          f"its start ({base:.3g})")


class RewardVarianceCollapse(Rule):
    """At least `share` of the groups had equal rewards on each of the last `steps` steps: little to learn from."""

    name = "reward_variance_collapse"
    needs = (("zero_variance_share",),)

    def __init__(self, cfg: HealthConfig):
        super().__init__(cfg)
        self.recent: list[tuple[int, float]] = []

    def check(self, x: Signals) -> Alarm | None:
        if x.zero_variance_share is None:
            return None
        self.recent = (self.recent + [(x.step, x.zero_variance_share)])[-self.cfg.zero_variance_steps:]
        limit = self.cfg.zero_variance_share
        if len(self.recent) < self.cfg.zero_variance_steps or any(v < limit for _, v in self.recent):
            return None
        return self.alarm(x, x.zero_variance_share, limit, f"{x.zero_variance_share:.0%} of the groups have "
                          f"equal rewards ({len(self.recent)} steps in a row)", since=self.recent[0][0])


class GradSpike(Rule):
    """An optimizer step's pre-clip gradient norm far above the recent ones: above both median + k x
    MAD and `grad_spike_factor` x the median of the last `window` accepted non-zero norms (the MAD
    at least `mad_floor` of the median). RL gradient norms are heavy-tailed (they scale with the
    batch's reward variance): on the default preset a healthy step reached 4.7 x the running median.
    `is_spike` is also the update's guard. The norms of optimizer steps without a reward signal (all
    advantages 0) are not in `Signals.grad_norms`: they are ~0 and would make every real step a
    spike."""

    name = "grad_spike"
    needs = (("grad_norms",),)
    mad_floor = 0.05  # the MAD counts as at least this share of the median

    def __init__(self, cfg: HealthConfig):
        super().__init__(cfg)
        self.norms: list[float] = []

    def limit(self) -> float | None:
        """The spike threshold now (None while fewer than `baseline_steps` norms are known)."""
        if len(self.norms) < self.cfg.baseline_steps:
            return None
        median = statistics.median(self.norms)
        mad = statistics.median(abs(n - median) for n in self.norms)
        return max(median + self.cfg.grad_spike_k * max(mad, self.mad_floor * median),
                   self.cfg.grad_spike_factor * median)

    def is_spike(self, norm: float) -> bool:
        limit = self.limit()
        return limit is not None and math.isfinite(norm) and norm > limit

    def check(self, x: Signals) -> Alarm | None:
        spikes = [n for n in x.grad_norms if self.is_spike(n)]
        limit = self.limit()
        accepted = [n for n in x.grad_norms if math.isfinite(n) and n > 0 and not self.is_spike(n)]
        self.norms = (self.norms + accepted)[-self.cfg.grad_spike_window:]  # a zero norm: no reward variance
        if not spikes:
            return None
        count = f"{len(spikes)} optimizer step{'s' if len(spikes) > 1 else ''}"
        return self.alarm(x, max(spikes), limit,
                          f"gradient norm {max(spikes):.3g} > {limit:.3g} (the recent median x "
                          f"{self.cfg.grad_spike_factor:g}, and + {self.cfg.grad_spike_k:g} MAD) "
                          f"at {count}")


class PolicyDrift(Rule):
    """The update moved the policy far from the rollout policy: PPO KL or the clipped share above its limit."""

    name = "policy_drift"
    needs = (("ppo_kl", "clipfrac"),)

    def check(self, x: Signals) -> Alarm | None:
        if x.ppo_kl is not None and x.ppo_kl > self.cfg.drift_kl:
            return self.alarm(x, x.ppo_kl, self.cfg.drift_kl, f"PPO KL {x.ppo_kl:.3g} > {self.cfg.drift_kl:g}")
        if x.clipfrac is not None and x.clipfrac > self.cfg.drift_clipfrac:
            return self.alarm(x, x.clipfrac, self.cfg.drift_clipfrac,
                              f"clipped share {x.clipfrac:.3g} > {self.cfg.drift_clipfrac:g}")
        return None


class KlAcceleration(Rule):
    """The KL to the reference grows faster each step (positive first and second differences over
    the last `steps` steps) and is above `kl_acceleration_min`: the policy runs away from the
    reference."""

    name = "kl_acceleration"
    needs = (("kl_ref",),)
    steps = 5  # KL values whose differences must all grow

    def __init__(self, cfg: HealthConfig):
        super().__init__(cfg)
        self.recent: list[tuple[int, float]] = []

    def check(self, x: Signals) -> Alarm | None:
        if x.kl_ref is None:
            return None
        self.recent = (self.recent + [(x.step, x.kl_ref)])[-self.steps:]
        if len(self.recent) < self.steps or x.kl_ref <= self.cfg.kl_acceleration_min:
            return None
        kl = [v for _, v in self.recent]
        first = [b - a for a, b in zip(kl, kl[1:], strict=False)]  # steps - 1 differences
        second = [b - a for a, b in zip(first, first[1:], strict=False)]  # steps - 2
        if min(first) <= 0 or min(second) <= 0:
            return None
        return self.alarm(x, x.kl_ref, self.cfg.kl_acceleration_min,
                          f"KL to the reference {x.kl_ref:.3g}, accelerating over {self.steps} "
                          "steps",
                          since=self.recent[0][0])


class Mismatch(Rule):
    """The sampler's and the trainer's log-probs disagree: KL above `mismatch_kl`."""

    name = "mismatch"
    needs = (("mismatch_kl",),)

    def check(self, x: Signals) -> Alarm | None:
        if x.mismatch_kl is None or x.mismatch_kl <= self.cfg.mismatch_kl:
            return None
        return self.alarm(x, x.mismatch_kl, self.cfg.mismatch_kl,
                          f"sampler/trainer KL {x.mismatch_kl:.3g} > {self.cfg.mismatch_kl:g}")


class LengthSurge(Rule):
    """Replies grew to more than `length_surge_ratio` x their mean length over the run's first steps."""

    name = "length_surge"
    needs = (("reply_mean",),)

    def __init__(self, cfg: HealthConfig):
        super().__init__(cfg)
        self.start: list[float] = []

    def check(self, x: Signals) -> Alarm | None:
        if x.reply_mean is None:
            return None
        if len(self.start) < self.cfg.baseline_steps:
            self.start.append(x.reply_mean)
            return None
        limit = self.cfg.length_surge_ratio * sum(self.start) / len(self.start)
        if x.reply_mean <= limit:
            return None
        return self.alarm(x, x.reply_mean, limit, f"mean reply {x.reply_mean:.1f} tokens > {limit:.1f}")


class Truncation(Rule):
    """Too many replies reached `env.max_new_tokens` (cut off, graded as written)."""

    name = "truncation"
    needs = (("truncation",),)

    def check(self, x: Signals) -> Alarm | None:
        if x.truncation is None or x.truncation <= self.cfg.truncation_rate:
            return None
        return self.alarm(x, x.truncation, self.cfg.truncation_rate,
                          f"{x.truncation:.0%} of the replies reached max_new_tokens")


class Repetition(Rule):
    """Too many replies repeat their own n-grams (degenerate or looping text): at least `share` of a
    reply's `ngram`-grams repeat an earlier one (`health_signals.repetition_rate`; replies of
    `min_tokens` or more)."""

    name = "repetition"
    needs = (("repetition",),)
    ngram = 4
    share = 0.5
    min_tokens = 2 * ngram  # shorter replies are not judged

    def check(self, x: Signals) -> Alarm | None:
        if x.repetition is None or x.repetition <= self.cfg.repetition_rate:
            return None
        return self.alarm(x, x.repetition, self.cfg.repetition_rate,
                          f"{x.repetition:.0%} of the replies repeat themselves")


class RewardComponent(Rule):
    """One reward component carries almost all of the trained reward's variance, or moves against the total, on each
    of the last `component_steps` steps (one step alone is common: a batch where only one component varied)."""

    name = "reward_component"
    needs = (("component_shares",),)

    def __init__(self, cfg: HealthConfig):
        super().__init__(cfg)
        self.recent: list[tuple[int, str]] = []  # (step, what the step showed: "<component>:over|against" or "")

    def sees(self, x: Signals) -> bool:
        return bool(x.component_shares)

    def check(self, x: Signals) -> Alarm | None:
        found = self.finding(x)
        if found is None:
            return None
        name, share, limit, message = found
        self.recent = (self.recent + [(x.step, f"{name}:{limit}")])[-self.cfg.component_steps:]
        if len(self.recent) < self.cfg.component_steps or len({seen for _, seen in self.recent}) > 1 or not name:
            return None
        return self.alarm(x, share, limit, f"{message} ({self.cfg.component_steps} steps in a row)",
                          since=self.recent[0][0])

    def finding(self, x: Signals) -> tuple[str, float, float, str] | None:
        """(component, share, limit crossed, message) of this step; ("", ...) when none crossed; None without
        components."""
        if not x.component_shares:
            return None
        for name, share in x.component_shares.items():
            if share >= self.cfg.component_takeover:
                return name, share, self.cfg.component_takeover, (
                    f"reward component {name} carries {share:.0%} of the reward's variance")
            if share < self.cfg.component_against:
                return name, share, self.cfg.component_against, (
                    f"reward component {name} moves against the total (share {share:.2f})")
        return "", 0.0, 0.0, ""


def _binomial_se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 1e-12) / max(n, 1))


def validation_se(success: float, count: int, clustered: float | None) -> float:
    """The standard error of a validation's success: clustered by problem when logged (a problem
    drawn k times counts once), else binomial over its trajectories."""
    return _binomial_se(success, count) if clustered is None else clustered


class FallingValidation(Rule):
    """Validation success fell more than `falling_validation_se` standard errors of the difference
    below the run's best (each validation's SE clustered by problem, binomial when not logged)."""

    name = "falling_validation"
    needs = (("val_success",),)

    def __init__(self, cfg: HealthConfig):
        super().__init__(cfg)
        self.best: tuple[int, float, int] | None = None  # (step, success, trajectories)
        self.best_se: float | None = None  # its clustered standard error, when logged

    def sees(self, x: Signals) -> bool:
        return x.val_success is not None

    def check(self, x: Signals) -> Alarm | None:
        if x.val_success is None:
            return None
        if self.best is None or x.val_success > self.best[1]:
            self.best, self.best_se = (x.step, x.val_success, x.val_count), x.val_se
            return None
        step, best, n = self.best
        now = validation_se(x.val_success, x.val_count, x.val_se)
        se = math.hypot(validation_se(best, n, self.best_se), now)
        limit = best - self.cfg.falling_validation_se * se
        if x.val_success >= limit:
            return None
        return self.alarm(x, x.val_success, limit, f"validation {x.val_success:.1%} < the best {best:.1%} (step "
                          f"{step}) by more than {self.cfg.falling_validation_se:g} standard errors", since=step + 1)


class NoLearning(Rule):
    """Past `no_learning_after` of the run, no validation so far has been `no_learning_se` standard
    errors of the difference above the first (each validation's SE clustered by problem, binomial
    when not logged). A run that learned and then fell back is `falling_validation`'s; one standard
    error, not two: a run that learns slowly is not flagged as one that learns nothing."""

    name = "no_learning"
    needs = (("val_success",),)

    def __init__(self, cfg: HealthConfig):
        super().__init__(cfg)
        self.first: tuple[float, int] | None = None
        self.first_se: float | None = None  # its clustered standard error, when logged
        self.learned: int | None = None  # the first step whose validation was above the limit

    def sees(self, x: Signals) -> bool:
        return x.val_success is not None

    def check(self, x: Signals) -> Alarm | None:
        if x.val_success is None:
            return None
        if self.first is None:
            self.first, self.first_se = (x.val_success, x.val_count), x.val_se
            return None
        start, n = self.first
        now = validation_se(x.val_success, x.val_count, x.val_se)
        se = math.hypot(validation_se(start, n, self.first_se), now)
        k = self.cfg.no_learning_se
        limit = start + k * se
        if x.val_success > limit and self.learned is None:
            self.learned = x.step
        if x.progress < self.cfg.no_learning_after or self.learned is not None:
            return None
        return self.alarm(x, x.val_success, limit,
                          f"no validation so far is {k:g} standard error"
                          f"{'' if k == 1 else 's'} above its start ({start:.1%}); now "
                          f"{x.val_success:.1%}", since=1)


class TemplateCollapse(Rule):
    """The MI between prompt and reply fell below `template_mi_drop` x its first value while the entropy held:
    replies that no longer depend on the input (RAGEN-2's template collapse)."""

    name = "template_collapse"
    needs = (("mi",), ("entropy",))
    entropy_held = 0.8  # the entropy holds while at least this share of its first value

    def __init__(self, cfg: HealthConfig):
        super().__init__(cfg)
        self.first_mi: float | None = None
        self.first_entropy: float | None = None

    def sees(self, x: Signals) -> bool:
        return x.mi is not None

    def check(self, x: Signals) -> Alarm | None:
        if x.mi is None or x.entropy is None:
            return None
        if self.first_mi is None:
            self.first_mi, self.first_entropy = x.mi, x.entropy
            return None
        limit = self.cfg.template_mi_drop * self.first_mi
        held = x.entropy >= self.entropy_held * self.first_entropy
        if self.first_mi <= 0 or x.mi >= limit or not held:
            return None
        return self.alarm(x, x.mi, limit, f"MI {x.mi:.3g} < {self.cfg.template_mi_drop:g} x its first value "
                          f"({self.first_mi:.3g}) while the entropy held ({x.entropy:.3g})")


class FirstStep(Rule):
    """Sanity of a run's first step: on the rollout policy the first optimizer step's PPO KL is ~0 (importance
    ratio 1), and with the trainer's own model as the sampler the mismatch is ~0."""

    name = "first_step"
    needs = (("first_ppo_kl", "mismatch_kl"),)
    ppo_kl_limit = 1e-3  # |PPO KL| of the first optimizer step on the rollout policy

    def check(self, x: Signals) -> Alarm | None:
        if not x.first_step:
            return None
        if x.first_ppo_kl is not None and abs(x.first_ppo_kl) > self.ppo_kl_limit:
            return self.alarm(x, x.first_ppo_kl, self.ppo_kl_limit,
                              f"first step: PPO KL {x.first_ppo_kl:.3g} on the rollout policy "
                              "(expected ~0: dropout on, or old log-probs from another model?)")
        limit = self.cfg.first_step_kl
        if x.sampler_is_trainer and x.mismatch_kl is not None and x.mismatch_kl > limit:
            return self.alarm(x, x.mismatch_kl, limit, f"first step: sampler/trainer KL {x.mismatch_kl:.3g} with the "
                              "trainer's own model sampling (expected ~0)")
        return None


class NonFinite(Rule):
    """Optimizer steps skipped for a non-finite gradient (the update skips them in any case)."""

    name = "non_finite"
    needs = (("non_finite_skips",),)

    def check(self, x: Signals) -> Alarm | None:
        if not x.non_finite_skips:
            return None
        return self.alarm(x, x.non_finite_skips, 0, f"{x.non_finite_skips} optimizer step(s) skipped: non-finite "
                          "gradient")


# `health.<name>` -> its rule, in the order they are checked
RULES: dict[str, type[Rule]] = {rule.name: rule for rule in (
    NonFinite, FirstStep, GradSpike, EntropyCollapse, RewardVarianceCollapse, PolicyDrift, KlAcceleration, Mismatch,
    LengthSurge, Truncation, Repetition, RewardComponent, TemplateCollapse, FallingValidation, NoLearning)}
