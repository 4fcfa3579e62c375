"""The health monitor's rules: pure functions of each step's numbers (`Signals`) and the rule's own history.

Each rule looks at one failure mode and, when its condition holds at a step, returns an `Alarm` with the value it
saw, the threshold it compared against and the step its trouble began (`since`: a rollback goes back to a
checkpoint saved before it). What each signal means, what usually causes it and what to try: docs/health.md.

`RULES` is the table (name -> class, in the order they are checked). Each rule carries its settings and its
glossary entry next to its check: `Config`, the dataclass of its `health.*` keys (`health.<name>` its action, which
`train/diagnostics/health.py` carries out, then its thresholds; `config.py` assembles every rule's into
`HealthConfig`), and `glossary`, what it means, its typical causes and what to try (`plots/glossary.py` renders it
into docs/health.md and the report). The defaults and the runs they were measured on: docs/health.md.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rldynamics.config_schema import health_action, within

if TYPE_CHECKING:
    from rldynamics.config import HealthConfig

CLEAR = "clear"  # the action of the events.jsonl row written when a warning's rule stops firing


@dataclass(frozen=True)
class Entry:
    """One glossary entry. `fires`: when the rule fires (for a signal: what it measures); `means`: what that says
    about the run; `causes`: what typically causes it; `tries`: what to try (left out where empty). Sources are named
    in the text."""

    fires: str
    means: str
    causes: str = ""  # empty: the rule the signal feeds says it
    tries: str = ""


@dataclass
class Signals:
    """The numbers of one step that the rules read (None where the step had none)."""

    step: int
    progress: float = 0.0  # step / train.steps
    first_step: bool = False  # the first step of a run started from scratch
    entropy: float | None = None  # the rollout policy's entropy of the sampled tokens (aggregated like the loss)
    train_success: float | None = None  # the rollout's success: mean of the env's `success` over its trajectories
    train_count: int = 0  # trajectories of that rollout
    zero_variance_share: float | None = None  # groups whose rewards are all equal / all groups (before the filter)
    # pre-clip gradient norm of each optimizer step with a reward signal (some advantage not 0; a
    # step of equal-reward groups alone under GRPO / RLOO has a norm ~0 and is left out)
    grad_norms: tuple[float, ...] = ()
    first_ppo_kl: float | None = None  # PPO KL of the update's first optimizer step (0 on the rollout policy)
    ppo_kl: float | None = None  # the update's mean PPO KL (policy drift within the step)
    clipfrac: float | None = None  # the update's mean clipped share of tokens (low + high)
    kl_ref: float | None = None  # the update's KL to the reference model (with the KL term on)
    mismatch_kl: float | None = None  # sampler/trainer KL (k3) of the sampled tokens, when measured
    update_kl: float | None = None  # KL (k3) of the policy before the update from the policy after it, on its batch
    sampler_is_trainer: bool = True  # the HF engine: the trainer's own model samples (the mismatch must be ~0)
    staleness: int = 0  # updates the sampler's weights are behind the trainer's (rollout.staleness; fewer at first)
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
    # its settings: a dataclass whose fields are `health.*` keys, its action `health.<name>` first (`config.py`
    # assembles every rule's into `HealthConfig`; a rule reads them, and the monitor's own, from `self.cfg`)
    Config: type
    glossary: Entry  # its entry in docs/health.md's glossary and the report's

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


class EntropyStart(Rule):
    """A rule that judges the entropy against its start: its mean over the run's first
    `baseline_steps` steps, up to the first step whose update was damaged (a non-finite or refused
    optimizer step, or the policy_drift condition). A step's entropy is measured before its update,
    so the later ones carry that damage."""

    def __init__(self, cfg: HealthConfig):
        super().__init__(cfg)
        self.start: list[float] = []
        self.start_closed = False  # a damaged update ended the start early

    def damaged(self, x: Signals) -> bool:
        """Whether the step's update was damaged: a non-finite or refused optimizer step, drift."""
        drift = (x.ppo_kl is not None and x.ppo_kl > self.cfg.drift_kl) or (
            x.clipfrac is not None and x.clipfrac > self.cfg.drift_clipfrac)
        return bool(x.non_finite_skips or x.refused or drift)

    def base(self, x: Signals) -> float | None:
        """The start entropy; None while the step's entropy (known) still goes into it."""
        if len(self.start) < self.cfg.baseline_steps and not self.start_closed:
            self.start.append(x.entropy)
            self.start_closed = self.damaged(x)
            return None
        return sum(self.start) / len(self.start)


class EntropyCollapse(EntropyStart):
    """The entropy fell below `ratio` x its mean over the run's first steps: the first
    `baseline_steps`, up to the first step whose update was damaged (a non-finite or refused
    optimizer step, or the policy_drift condition). A step's entropy is measured before its update,
    so the later ones carry that damage."""

    name = "entropy_collapse"
    needs = (("entropy",),)

    @dataclass
    class Config:
        entropy_collapse: str = health_action("warn")
        """The entropy below entropy_collapse_ratio x its start (the first baseline_steps steps, up to
        the first update that was non-finite, refused or drifted)."""
        entropy_collapse_ratio: float = within(0.1, 0, high=1)
        """Fraction of the start entropy below which the entropy has collapsed."""

    glossary = Entry(
        fires="The rollout policy's entropy (`actor/entropy`) is below "
              "`health.entropy_collapse_ratio` x its start: its mean over the run's first "
              "`health.baseline_steps` steps, up to the first step whose update was damaged (a "
              "non-finite or refused optimizer step, or the `policy_drift` condition: the PPO KL "
              "above `health.drift_kl` or the clipped share above `health.drift_clipfrac`). A "
              "step's entropy is measured before its update, so the later ones already carry the "
              "damage and stay out of the start.",
        means="The policy has become nearly deterministic: it stops exploring, its groups get equal rewards, and "
              "its performance stops improving. Cui et al. 2025 (\"The Entropy Mechanism of Reinforcement Learning "
              "for Reasoning Language Models\") find performance traded against entropy, R = -a exp(H) + b: once "
              "the entropy is spent, the gains stop.",
        causes="Confident tokens with a positive advantage: Cui et al. 2025 derive the step's entropy change as "
               "about -lr x Cov(log pi, A) over the sampled tokens (their natural-gradient form), so a positive "
               "`actor/entropy_cov` drives it down. "
               "Symmetric clipping that keeps unlikely tokens from rising (DAPO, Yu et al. 2025); too high a "
               "learning rate or too many epochs per step.",
        tries="Clip-higher: a larger `algo.clip_high` than `algo.clip_low` (DAPO uses 0.28 and 0.2, the defaults "
              "here); an entropy bonus (`algo.entropy_coef`, sensitive to its value); Cui et al.'s Clip-Cov or "
              "KL-Cov, which restrain the update of the few tokens of highest covariance (not in this trainer); a "
              "higher `train.temperature`; a lower `train.lr`.")

    def check(self, x: Signals) -> Alarm | None:
        base = None if x.entropy is None else self.base(x)
        if base is None:
            return None
        limit = self.cfg.entropy_collapse_ratio * base
        if x.entropy >= limit:
            return None
        return self.alarm(x, x.entropy, limit, f"entropy {x.entropy:.3g} < {self.cfg.entropy_collapse_ratio:g} x "
                          f"its start ({base:.3g})")


class EntropySurge(EntropyStart):
    """The entropy above `entropy_surge_ratio` x its start (as `entropy_collapse`'s) on each of the
    last `entropy_surge_steps` steps: the policy is spreading out, not sharpening."""

    name = "entropy_surge"
    needs = (("entropy",),)

    @dataclass
    class Config:
        entropy_surge: str = health_action("warn")
        """The entropy above entropy_surge_ratio x its start (as for entropy_collapse),
        entropy_surge_steps steps in a row."""
        entropy_surge_ratio: float = within(2.0, 1, inclusive=False)
        """Times the start entropy above which it has surged (the default preset's healthy runs held
        at most 1.08 x for 3 steps, 1.27 x with the spike guard off)."""
        entropy_surge_steps: int = within(3, 1)
        """Consecutive steps the entropy must stay above the bound."""

    glossary = Entry(
        fires="The rollout policy's entropy (`actor/entropy`) is above `health.entropy_surge_ratio` "
              "x its start on each of the last `health.entropy_surge_steps` steps; the start as for "
              "`entropy_collapse`: its mean over the run's first `health.baseline_steps` steps, up "
              "to the first step whose update was damaged (a non-finite or refused optimizer step, "
              "or the `policy_drift` condition: the PPO KL above `health.drift_kl` or the clipped "
              "share above `health.drift_clipfrac`).",
        means="The policy is spreading its probability over more tokens instead of sharpening: RL on a working "
              "reward lowers the entropy (the default preset's healthy seeds ended at 0.4-0.9 x their start), "
              "so a sustained rise says something pushes it the other way. The replies drift towards noise and "
              "the training success usually falls with it (`falling_success`).",
        causes="An entropy bonus too strong for the task signal (math-tiny with `algo.entropy_coef=0.5`: the "
               "entropy went from 0.19 to 1.22 in 20 steps, this rule fired at step 16, `falling_success` at "
               "14); a reward that pays for something random, or whose sign is wrong; a clip range so wide "
               "(`algo.clip_low`, `algo.clip_high`) that the update is barely bounded; too high a "
               "`train.temperature` or learning rate.",
        tries="Lower or switch off `algo.entropy_coef`; check the reward's sign and components "
              "(`reward/<component>/*`, the samples); restore the clip range (DAPO's 0.2 / 0.28); a lower "
              "`train.lr`.")

    def __init__(self, cfg: HealthConfig):
        super().__init__(cfg)
        self.recent: list[tuple[int, float]] = []  # (step, entropy) of the last steps after the start

    def check(self, x: Signals) -> Alarm | None:
        base = None if x.entropy is None else self.base(x)
        if base is None:
            return None
        self.recent = (self.recent + [(x.step, x.entropy)])[-self.cfg.entropy_surge_steps:]
        limit = self.cfg.entropy_surge_ratio * base
        if len(self.recent) < self.cfg.entropy_surge_steps or any(e <= limit for _, e in self.recent):
            return None
        return self.alarm(x, x.entropy, limit, f"entropy {x.entropy:.3g} > {self.cfg.entropy_surge_ratio:g} x its "
                          f"start ({base:.3g}), {len(self.recent)} steps in a row", since=self.recent[0][0])


class RewardVarianceCollapse(Rule):
    """At least `share` of the groups had equal rewards on each of the last `steps` steps: little to learn from."""

    name = "reward_variance_collapse"
    needs = (("zero_variance_share",),)

    @dataclass
    class Config:
        reward_variance_collapse: str = health_action("warn")
        """At least zero_variance_share of the groups with equal rewards, zero_variance_steps steps in a row."""
        zero_variance_share: float = within(0.9, 0, high=1)
        """Share of equal-reward groups that counts as collapsed."""
        zero_variance_steps: int = within(5, 1)
        """Consecutive steps the share must hold."""

    glossary = Entry(
        fires="At least `health.zero_variance_share` of the groups had equal rewards (`health/zero_variance_share`, "
              "before the filter) on each of the last `health.zero_variance_steps` steps.",
        means="A group whose replies all score the same has group-relative advantages of 0: no "
              "task gradient. The update then comes from the few groups left, and from the "
              "regularisers when their coefficients are on (`algo.entropy_coef`, `algo.kl_coef`). "
              "RAGEN-2 ties this reward-variance collapse to a task gradient too weak against the "
              "regularisers (see `template_collapse`).",
        causes="Prompts too easy (all succeed) or too hard (all fail) for the current policy; entropy collapse "
               "(the same reply, the same reward); a sparse binary reward; a reward function that always returns "
               "the same value.",
        tries="Tell all-success from all-failure groups (the samples, `train/<env>/success`); dynamic sampling "
              "(DAPO, Yu et al. 2025) drops the equal-reward groups and samples more to keep the batch full, and "
              "the filter here can drop them (`filter.include_zero=false`); a larger `train.group_size` or "
              "`train.temperature`; prompts of a difficulty the policy can still tell apart; a denser reward.")

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

    @dataclass
    class Config:
        grad_spike: str = health_action("skip")
        """A pre-clip gradient norm above grad_spike_factor x the median of the recent ones and above
        the median + grad_spike_k MAD (optimizer steps without a reward signal, all advantages 0, are
        not judged); skip refuses the step and the console counts every refusal."""
        grad_spike_factor: float = within(20.0, 1)
        """Times the recent median that make a spike (healthy runs reached 11-17: 3 of 10 default
        seeds once, a countdown-tiny seed 15)."""
        grad_spike_k: float = within(10.0, 0, inclusive=False)
        """MADs above the median that make a spike."""
        grad_spike_window: int = within(20, 1)
        """Accepted optimizer steps (with a reward signal) whose norms form the median and MAD."""

    glossary = Entry(
        fires="An optimizer step's pre-clip gradient norm is above both `health.grad_spike_factor` "
              "(20) x the median and the median + `health.grad_spike_k` (10) MAD of the last "
              "`health.grad_spike_window` accepted norms (the MAD at least 5 % of the median), "
              "once `health.baseline_steps` norms are known. Optimizer steps without a reward "
              "signal (a mini-batch of groups with equal rewards under GRPO or RLOO: all "
              "advantages 0, a norm ~0) are neither judged nor part of that history. With "
              "`health.grad_spike=skip` the update refuses the spiking optimizer step before it is "
              "taken: the weights and the AdamW state stay as they were; the console says how many "
              "were refused on every step that refused one.",
        means="One mini-batch pushed much harder than the recent ones. Clipping bounds the step's size but not its "
              "direction, which that batch then dominates; repeated or growing spikes precede divergence. "
              "On seed 5 of the default preset the step refused at 12 x the median, let through, doubled the "
              "replies' length (30-43 -> 83-85 tokens) for most of the run; that run still ended higher (25.8 % "
              "against 17.8 %): one seed does not show whether refusing helps.",
        causes="A few tokens with extreme importance ratios (off-policy tokens: Liu, Li et al. 2025, \"When Speed "
               "Kills Stability\", trace collapses with exploding gradient norms to the sampler/trainer mismatch); "
               "a reward outlier; a very long reply under a sum aggregation; too high a learning rate.",
        tries="See which layers spiked (`actor/grad_norm/<group>` at that step) and whether `rollout/corr/*` moved; "
              "read the step's samples; lower `train.lr` or `train.max_grad_norm`; with a mismatch, TIS or MIS "
              "(see `mismatch`).")

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

    @dataclass
    class Config:
        policy_drift: str = health_action("warn")
        """The update's PPO KL above drift_kl or its clipped share above drift_clipfrac."""
        drift_kl: float = within(0.1, 0)
        """PPO KL limit."""
        drift_clipfrac: float = within(0.3, 0, high=1)
        """Clipped-token share limit (low + high)."""

    glossary = Entry(
        fires="The update's mean PPO KL (`actor/ppo_kl`) is above `health.drift_kl`, or its clipped token share "
              "(low + high, `actor/pg_clipfrac` and `actor/pg_clipfrac_lower`) is above `health.drift_clipfrac`.",
        means="Within one step the policy moved far from the policy that sampled the batch: the clipped objective "
              "ignores many tokens, and the later mini-batches are trained off-policy.",
        causes="Too high a learning rate; too many passes or optimizer steps per batch (`train.ppo_epochs`, a "
               "small `train.mini_batch_size`); large advantages; a sampler that differs from the trainer (see "
               "`mismatch`).",
        tries="Lower `train.lr`; fewer `train.ppo_epochs` or a larger `train.mini_batch_size`; check `mismatch`.")

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

    @dataclass
    class Config:
        kl_acceleration: str = health_action("record")
        """The KL to the reference above kl_acceleration_min and growing faster each step (5 steps)."""
        kl_acceleration_min: float = within(0.05, 0)
        """KL below which its growth is not flagged."""

    glossary = Entry(
        fires="With the KL term on (`algo.kl_coef` > 0): the KL to the reference (`actor/kl_loss`) "
              "is above `health.kl_acceleration_min` and grew faster over each of the last 5 steps "
              "(positive first and second differences).",
        means="The policy is running away from the reference model at a growing rate, a common prelude to reward "
              "hacking or to text drifting away from language.",
        causes="A reward the policy has found a way to exploit; a KL coefficient too small for the learning rate; "
               "entropy collapse onto a narrow mode far from the reference.",
        tries="Read the samples for a hack and the reward components for the one that grows; raise "
              "`algo.kl_coef`; lower `train.lr`.")

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

    @dataclass
    class Config:
        mismatch: str = health_action("warn")
        """Sampler/trainer KL above mismatch_kl."""
        mismatch_kl: float = within(0.01, 0)
        """Sampler/trainer KL (k3, mean over tokens) limit."""

    glossary = Entry(
        fires="The sampler/trainer KL (k3, mean over the trained batch's sampled tokens; `rollout/corr/k3_kl`) is "
              "above `health.mismatch_kl`.",
        means="The engine that sampled the replies gives them other probabilities than the trainer does, so the "
              "\"on-policy\" update is off-policy. Yao, Liu et al. 2025 (\"Your Efficient RL Framework Secretly "
              "Brings You Off-Policy RL Training\") show the gap biases the gradient silently; Liu, Li et al. 2025 "
              "(\"When Speed Kills Stability\") trace training collapses to it.",
        causes="bfloat16 in the sampler or the trainer (different kernels round differently); different dtypes on "
               "the two sides (`rollout.vllm_dtype`, `model.dtype`); weights not synced after an update, or on "
               "purpose (`rollout.staleness`, `rollout.sync_every`); sampling settings applied on one side only.",
        tries="Truncated importance sampling, `algo.tis_cap` (Yao, Liu et al. 2025); sequence masking, "
              "`algo.mis=true` with the band `algo.mismatch_band` (Liu, Li et al. 2025); more precision on both "
              "sides: Qi et al. 2025 (\"Defeating the Training-Inference Mismatch via FP16\") remove most of the "
              "gap with FP16 instead of BF16, and this trainer offers float32 (`model.dtype=float32`, "
              "`rollout.vllm_dtype=float32`). `docs/vllm.md` has the metrics and the corrections.")

    def check(self, x: Signals) -> Alarm | None:
        if x.mismatch_kl is None or x.mismatch_kl <= self.cfg.mismatch_kl:
            return None
        behind = (f"; the sampler is {x.staleness} update{'s' if x.staleness > 1 else ''} behind the trainer "
                  "(rollout.staleness): algo.tis_cap or algo.mis correct it" if x.staleness else "")
        return self.alarm(x, x.mismatch_kl, self.cfg.mismatch_kl,
                          f"sampler/trainer KL {x.mismatch_kl:.3g} > {self.cfg.mismatch_kl:g}{behind}")


class LengthSurge(Rule):
    """Replies grew to more than `length_surge_ratio` x their mean length over the run's first steps."""

    name = "length_surge"
    needs = (("reply_mean",),)

    @dataclass
    class Config:
        length_surge: str = health_action("warn")
        """Mean reply length above length_surge_ratio x its start."""
        length_surge_ratio: float = within(2.0, 1, inclusive=False)
        """Growth factor of the mean reply length."""

    glossary = Entry(
        fires="The mean reply length is above `health.length_surge_ratio` x its mean over the run's first "
              "`health.baseline_steps` steps.",
        means="The policy writes much more than it did. That can be learning to reason longer, or rambling, "
              "looping, or a length that the reward pays for.",
        causes="A reward (component) that grows with length; a per-sequence loss average, under which each token "
               "of a long reply weighs less, so long low-quality replies are punished too little (DAPO, Yu et al. "
               "2025, motivate their token-level loss with this); repetition; truncated replies graded as written.",
        tries="Read the samples; check `repetition` and `truncation`; `algo.loss_agg_mode=token-mean` (DAPO's "
              "token-level loss); a length term in the reward, like DAPO's soft overlong punishment.")

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

    @dataclass
    class Config:
        truncation: str = health_action("warn")
        """More than truncation_rate of the replies reached env.max_new_tokens."""
        truncation_rate: float = within(0.5, 0, high=1)
        """Share of cut-off replies."""

    glossary = Entry(
        fires="More than `health.truncation_rate` of the replies reached `env.max_new_tokens` "
              "(`response_length/clip_ratio`, verl's name; slime logs the same share as `truncated_ratio`).",
        means="Replies are cut off and graded as written, so their rewards say little about the reply: DAPO (Yu et "
              "al. 2025) calls the punishment of a cut reasonable reply reward noise.",
        causes="`env.max_new_tokens` too small for the task; looping or repeating replies; a length surge.",
        tries="Raise `env.max_new_tokens`; check `repetition`; DAPO's overlong filtering (leave truncated replies "
              "out of the loss; not in this trainer) or soft overlong punishment (a length penalty near the "
              "limit).")

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

    @dataclass
    class Config:
        repetition: str = health_action("warn")
        """More than repetition_rate of the replies repeat half of their own 4-grams."""
        repetition_rate: float = within(0.3, 0, high=1)
        """Share of repeating replies."""

    glossary = Entry(
        fires="More than `health.repetition_rate` of the replies (of 8 tokens or more) repeat at "
              "least 50 % of their own 4-grams (`health/repetition_rate`; slime logs a like share "
              "as `repetition_frac`).",
        means="Degenerate text: loops, the same phrase again and again, \"!!!!\". Such replies rarely earn a reward "
              "and often hit the length limit.",
        causes="Entropy collapse; a sampler that is off from the trainer (see `mismatch`); too low a sampling "
               "temperature; a reward that does not penalise it; a learning rate high enough to damage the model.",
        tries="Read the samples; check `mismatch` and `entropy_collapse`; a higher `train.temperature`; a lower "
              "`train.lr`; a repetition penalty as a reward component.")

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

    @dataclass
    class Config:
        reward_component: str = health_action("record")
        """A reward component carrying component_takeover of the reward's variance, or a share below
        component_against (moving against the total)."""
        component_takeover: float = within(0.95, 0, high=1)
        """Variance share that counts as taking over."""
        component_against: float = within(-0.1, -1, high=0)
        """Variance share below which a component moves against the total, in [-1, 0] (a share below 0
        moves against the total; the shares sum to 1)."""
        component_steps: int = within(5, 1)
        """Consecutive steps a component must take over (or move against) the total."""

    glossary = Entry(
        fires="One weighted reward component carries at least `health.component_takeover` of the "
              "trained reward's variance (`health/reward_share/<component>`), or a component's "
              "share is below `health.component_against` (it moves against the total), the same "
              "finding on each of the last `health.component_steps` steps.",
        means="The advantages are driven by that one component: the policy learns it, not the mix. When the "
              "correctness component takes over because the others saturated, that is fine; when a format or "
              "length component does, the task is not being learned. A negative share fights the total.",
        causes="Component weights out of scale with each other; the other components constant within the groups; "
               "a component that rewards something the others punish.",
        tries="Re-weight with `env.reward_weights.<component>`; see which components vary (`reward/<component>/*`); "
              "their gradients (`analysis.reward_grad=true`, `docs/reward-components.md`).")

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


class FallingSuccess(Rule):
    """Training success, its mean over the last `falling_success_steps` steps, fell more than
    `falling_success_se` standard errors of the difference below the run's best such mean. Each step
    samples new prompts, whose difficulty moves the success far more than the binomial noise of its
    trajectories (the default preset's healthy steps ranged from 0 % to 56 %, the hard and the easy
    steps the same on every seed), so the standard error of the difference comes from the
    step-to-step spread of the run so far: with d the change of the success from one step to the
    next, two means of k steps each differ by sqrt(mean(d^2) / k) by chance; the binomial one over
    the two windows' trajectories when larger. It reads the training rollouts: no validation needed."""

    name = "falling_success"
    needs = (("train_success",),)

    @dataclass
    class Config:
        falling_success: str = health_action("warn")
        """Training success, its mean over falling_success_steps steps, more than falling_success_se
        standard errors below the run's best such mean."""
        falling_success_steps: int = within(5, 1)
        """Steps whose training success is averaged (a window: the run's best is its best window)."""
        falling_success_se: float = within(5.5, 0, inclusive=False)
        """Standard errors of the difference (from the step-to-step spread of the success, at least
        binomial). The best of many windows is biased upward: the default preset's healthy seeds came
        to 3.0 at most; of simulated noisy flat and rising 100-step runs, 5 flagged up to 3 %, 5.5
        none of 1,500."""

    glossary = Entry(
        fires="Training success (`train/<env>/success`, the rollouts' share of successful "
              "trajectories), its mean over the last `health.falling_success_steps` steps, is more "
              "than `health.falling_success_se` (5.5) standard errors of the difference below the "
              "run's best such mean so far. That standard error is the square root of the mean "
              "squared change of the success from one step to the next over the run so far, divided "
              "by `health.falling_success_steps` (each step samples new prompts, whose difficulty "
              "moves the success far more than the binomial noise of its trajectories), and at least "
              "the binomial one over the two windows' trajectories.",
        means="The policy now succeeds less often on the prompts it trains on than it did earlier in the run: "
              "training is making it worse. It reads the rollouts of every step, so it needs no validation: "
              "math-tiny with the correctness reward's sign flipped (`env.reward_weights.correctness=-1`) fell "
              "from 36 % at step 1 to 6 % at step 5, and the rule fired at step 13, where the preset's next "
              "validation would have come at step 25.",
        causes="A reward that does not pay for success (a wrong sign, a component that takes over: "
               "`reward_component`, a length or format term that outweighs correctness); an entropy bonus or a "
               "clip range that lets the policy drift (`entropy_surge`, `policy_drift`); too high a learning "
               "rate; entropy collapse onto a wrong answer.",
        tries="Read the samples of the steps around its `since`; check the reward's components and weights "
              "(`env.reward_weights.<component>`) and the rules that fired just before; a lower `train.lr`; "
              "keep a checkpoint from before the fall (`checkpoint.every`; a rollback goes back to the last "
              "one saved by the end of the best window).")

    def __init__(self, cfg: HealthConfig):
        super().__init__(cfg)
        self.recent: list[tuple[int, float, int]] = []  # (step, success, trajectories) of the last steps
        self.best: tuple[int, float, int] | None = None  # (last step, mean success, trajectories) of the best window
        self.squares = 0.0  # sum of the squared changes of the success from one step to the next
        self.changes = 0

    def sees(self, x: Signals) -> bool:
        return x.train_success is not None

    def check(self, x: Signals) -> Alarm | None:
        if x.train_success is None:
            return None
        if self.recent:
            change = x.train_success - self.recent[-1][1]
            self.squares, self.changes = self.squares + change * change, self.changes + 1
        k = self.cfg.falling_success_steps
        self.recent = (self.recent + [(x.step, x.train_success, x.train_count)])[-k:]
        if len(self.recent) < k:
            return None
        mean, count = sum(s for _, s, _ in self.recent) / k, sum(n for _, _, n in self.recent)
        if self.best is None or mean > self.best[1]:
            self.best = (x.step, mean, count)
            return None
        step, best, n = self.best
        spread = math.sqrt(self.squares / max(self.changes, 1) / k)
        se = max(spread, math.hypot(_binomial_se(best, n), _binomial_se(mean, count)))
        limit = best - self.cfg.falling_success_se * se
        if mean >= limit:
            return None
        return self.alarm(x, mean, limit, f"training success {mean:.1%} over the last {k} steps < the best "
                          f"{best:.1%} (steps {step - k + 1}-{step}) by more than "
                          f"{self.cfg.falling_success_se:g} standard errors", since=step + 1)


class FallingValidation(Rule):
    """Validation success fell more than `falling_validation_se` standard errors of the difference
    below the run's best (each validation's SE clustered by problem, binomial when not logged) on
    each of the last `falling_validation_count` validations: one low validation between two good
    ones is the policy's own oscillation, not a fall."""

    name = "falling_validation"
    needs = (("val_success",),)

    @dataclass
    class Config:
        falling_validation: str = health_action("warn")
        """Validation success more than falling_validation_se standard errors below the run's best."""
        falling_validation_se: float = within(3.0, 0, inclusive=False)
        """Standard errors of the difference, each clustered by problem (val-env/<env>/success_se;
        binomial when not logged). The best of several validations is biased upward: math-tiny's healthy
        run dipped 2.6 below its best at step 100 and set a new best at 150."""
        falling_validation_count: int = within(2, 1)
        """Validations in a row that must each be that far below the best (healthy math-tiny seeds
        dipped 3.8 and 4.0 standard errors below their best at one validation and set a new best at
        the next)."""

    glossary = Entry(
        fires="Validation success is more than `health.falling_validation_se` (3) standard errors "
              "of the difference below the run's best, the validation before training included, on "
              "each of the last `health.falling_validation_count` (2) validations; each "
              "validation's standard error is clustered by problem (`val-env/<env>/success_se`: a "
              "problem drawn several times counts once), binomial when a validation did not log it.",
        means="The policy got worse on fixed held-out prompts, and stayed worse: training now hurts. The best "
              "checkpoint is the one to keep. One low validation between good ones is the policy's own "
              "oscillation, which is why one is not enough: two healthy math-tiny seeds dipped 3.8 and 4.0 "
              "standard errors below their best once and set a new best at the next validation.",
        causes="Entropy collapse, drift, reward hacking or overfitting to the training prompts; whichever other "
               "rule fired just before is the first suspect (the health timeline).",
        tries="Keep the best checkpoint (`checkpoint.every`); lower `train.lr`; address the rule that fired "
              "first.")

    def __init__(self, cfg: HealthConfig):
        super().__init__(cfg)
        self.best: tuple[int, float, int] | None = None  # (step, success, trajectories)
        self.best_se: float | None = None  # its clustered standard error, when logged
        self.below = 0  # validations in a row below the limit

    def sees(self, x: Signals) -> bool:
        return x.val_success is not None

    def check(self, x: Signals) -> Alarm | None:
        if x.val_success is None:
            return None
        if self.best is None or x.val_success > self.best[1]:
            self.best, self.best_se, self.below = (x.step, x.val_success, x.val_count), x.val_se, 0
            return None
        step, best, n = self.best
        now = validation_se(x.val_success, x.val_count, x.val_se)
        se = math.hypot(validation_se(best, n, self.best_se), now)
        limit = best - self.cfg.falling_validation_se * se
        self.below = self.below + 1 if x.val_success < limit else 0
        if self.below < self.cfg.falling_validation_count:
            return None
        times = "" if self.below == 1 else f", {self.below} validations in a row"
        return self.alarm(x, x.val_success, limit, f"validation {x.val_success:.1%} < the best {best:.1%} (step "
                          f"{step}) by more than {self.cfg.falling_validation_se:g} standard errors{times}",
                          since=step + 1)


class NoLearning(Rule):
    """Past `no_learning_after` of the run, no validation so far has been `no_learning_se` standard
    errors of the difference above the first (each validation's SE clustered by problem, binomial
    when not logged). A run that learned and then fell back is `falling_validation`'s; one standard
    error, not two: a run that learns slowly is not flagged as one that learns nothing."""

    name = "no_learning"
    needs = (("val_success",),)

    @dataclass
    class Config:
        no_learning: str = health_action("warn")
        """Past no_learning_after of the run, no validation so far no_learning_se standard errors of the
        difference above the first (the validation before training, when there is one)."""
        no_learning_after: float = within(0.5, 0, high=1)
        """Share of train.steps after which a flat validation is flagged."""
        no_learning_se: float = within(1.0, 0, inclusive=False)
        """Standard errors of the difference (each clustered by problem) the validation must rise above
        its start: the default run's was 1.9 at step 60 of 100 (15.2 % -> 19.7 %, 24.6 % at the end),
        which 2 flagged."""

    glossary = Entry(
        fires="Past `health.no_learning_after` of `train.steps`, no validation so far has been "
              "`health.no_learning_se` (1) standard error of the difference above the first (the "
              "validation before training, when there is one); each standard error clustered by "
              "problem, as for `falling_validation`.",
        means="Half the run (by default) has gone without a measurable gain on the validation "
              "prompts. The bar is one standard error, not two, so that slow learning is not "
              "mistaken for none: the default run was 1.9 standard errors above its start at step "
              "60 of 100 (15.2 % -> 19.7 %) and ended at 24.6 %. A run that gained and then fell "
              "back is `falling_validation`'s, not this rule's (seed 1 of the default: 16.6 % -> "
              "20.7 % at step 20, 18.4 % at 80).",
        causes="No reward signal (`reward_variance_collapse` from the start: all groups fail or all succeed); a "
               "setup bug (`first_step`); a learning rate far too low or too high; a filter that keeps almost "
               "nothing (`rollout/filter_kept_ratio`).",
        tries="Check `reward_variance_collapse`, `first_step` and the kept ratio; easier prompts or a warm start; "
              "a learning-rate sweep (`docs/sweeps.md`).")

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

    @dataclass
    class Config:
        template_collapse: str = health_action("record")
        """With collapse.enabled: the first-turn MI below template_mi_drop x its first value while the entropy holds."""
        template_mi_drop: float = within(0.5, 0, high=1)
        """Fraction of the first MI."""

    glossary = Entry(
        fires="With `collapse.enabled`: the first-turn MI estimate between prompt and reply is below "
              "`health.template_mi_drop` x its first value while the entropy holds (at least 80 % of its value "
              "then).",
        means="RAGEN-2's template collapse: the replies stay diverse (the entropy holds) but no longer depend on "
              "the input; the same templates for every prompt. The entropy alone cannot show it.",
        causes="By RAGEN-2's account, updates dominated by prompts of low reward variance: their task gradient is "
               "weak, so input-agnostic terms (regularisers, format) shape the policy.",
        tries="RAGEN-2's filtering by reward variance: train on the groups of highest reward std "
              "(`filter.strategy=top_p`, `filter.metric=reward_std`, `filter.value` below 1); `docs/collapse.md` "
              "has the metrics.")

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

    @dataclass
    class Config:
        first_step: str = health_action("warn")
        """First step: PPO KL ~0 on the rollout policy; sampler/trainer KL below first_step_kl with the HF engine."""
        first_step_kl: float = within(5e-3, 0)
        """Sampler/trainer KL the HF engine may show at the first step (bfloat16 rounding alone gave 1.2e-3 on
        SmolLM2 on an H200; float32 gives ~1e-7)."""

    glossary = Entry(
        fires="On the first step of a run started from scratch: the first optimizer step's PPO KL "
              "(`actor/ppo_kl`) is above 1e-3 in absolute value, or, with the HF engine (the "
              "trainer's own model samples), the sampler/trainer KL is above "
              "`health.first_step_kl` (5e-3). Both must be ~0 there (bfloat16 rounding alone gives "
              "a sampler/trainer KL of the order of 1e-3).",
        means="The old log-probs and the trainer's log-probs are not computed the same way: a setup bug, not a "
              "training problem. Every later number of the run inherits it.",
        causes="Dropout left on in one of the passes; old log-probs taken from another model, dtype or prompt "
               "format; different padding, masking or chat-template tokenisation between sampling and training.",
        tries="Compare the per-token log-probs of one sample from both passes; make the dtype, the template and the "
              "model mode (eval, no dropout) the same; do not trust the run's curves until this is fixed.")

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


class UpdateKl(Rule):
    """The actor update moved the policy more than `update_kl_max` (KL, per sampled token) on the
    very batch it trained on, on the run's first `update_kl_steps` actor updates: a destructive
    first update, seen at the step that made it (the other rules read the next rollout). `due`
    tells the monitor whether to measure the next update."""

    name = "update_kl"
    needs = (("update_kl",),)

    @dataclass
    class Config:
        update_kl: str = health_action("warn")
        """On the first update_kl_steps actor updates: the update's KL on its own batch above
        update_kl_max (rollback goes back to the state before the step)."""
        update_kl_max: float = within(0.1, 0, inclusive=False)
        """KL (k3, mean over the batch's sampled tokens) of the policy before the update from the policy
        after it above which the update is destructive."""
        update_kl_steps: int = within(5, 0)
        """First actor updates of a run whose KL is measured (one forward of the batch after the update
        each; 0: never)."""

    glossary = Entry(
        fires="On the first `health.update_kl_steps` actor updates of a run: the KL (k3, mean over the "
              "step's sampled tokens, `health/update_kl_value`) of the policy before the actor update "
              "from the policy after it, on the batch it trained on, is above `health.update_kl_max`.",
        means="One update moved the policy far on the very replies it learned from: the update itself is "
              "destructive, and it is seen at the step that made it, before the next rollout shows the damage "
              "that every other rule reads. With `health.update_kl=rollback` the run goes back to the state "
              "before that step (kept in memory, `health.snapshot_every`), with `health.remedy`'s changes.",
        causes="A learning rate far too high for the model (a blow-up); a loss scale or aggregation that "
               "makes one step huge (a sum over long replies); advantages without normalisation on a reward "
               "of large scale.",
        tries="`health.update_kl=rollback` with `health.remedy=[train.lr*=0.1]`; a lower `train.lr` or "
              "`train.max_grad_norm`; check the advantages' scale (`critic/advantages/*`).")

    def __init__(self, cfg: HealthConfig):
        super().__init__(cfg)
        self.updates = 0  # updates judged so far

    def due(self) -> bool:
        """Whether the next actor update is one of the first `update_kl_steps`."""
        return self.updates < self.cfg.update_kl_steps

    def sees(self, x: Signals) -> bool:
        return x.update_kl is not None

    def check(self, x: Signals) -> Alarm | None:
        if x.update_kl is None or not self.due():
            return None
        self.updates += 1
        if x.update_kl <= self.cfg.update_kl_max:
            return None
        return self.alarm(x, x.update_kl, self.cfg.update_kl_max, f"the update moved the policy by KL "
                          f"{x.update_kl:.3g} > {self.cfg.update_kl_max:g} on its own batch")


class NonFinite(Rule):
    """Optimizer steps skipped for a non-finite gradient (the update skips them in any case)."""

    name = "non_finite"
    needs = (("non_finite_skips",),)

    @dataclass
    class Config:
        non_finite: str = health_action("record")
        """Optimizer steps with a non-finite gradient (always skipped)."""

    glossary = Entry(
        fires="An optimizer step of the actor update had a NaN or infinite gradient norm (the update skips such a "
              "step in any case; `actor/skipped_steps` counts them).",
        means="The loss or its gradient overflowed; that mini-batch taught the policy nothing, and a run of them "
              "means the update has stopped working.",
        causes="A sampled token the trainer gives (almost) zero probability, so its log-prob or importance ratio "
               "explodes (sampler/trainer mismatch, see `mismatch`); bfloat16 overflow in the logits or the loss; "
               "too high a learning rate.",
        tries="Look at `rollout/corr/*` and the step's samples; rerun a few steps with `model.dtype=float32` to see "
              "whether precision is the cause; lower `train.lr`.")

    def check(self, x: Signals) -> Alarm | None:
        if not x.non_finite_skips:
            return None
        return self.alarm(x, x.non_finite_skips, 0, f"{x.non_finite_skips} optimizer step(s) skipped: non-finite "
                          "gradient")


# `health.<name>` -> its rule, in the order they are checked
RULES: dict[str, type[Rule]] = {rule.name: rule for rule in (
    NonFinite, FirstStep, UpdateKl, GradSpike, EntropyCollapse, EntropySurge, RewardVarianceCollapse, PolicyDrift,
    KlAcceleration, Mismatch, LengthSurge, Truncation, Repetition, RewardComponent, TemplateCollapse, FallingSuccess,
    FallingValidation, NoLearning)}
