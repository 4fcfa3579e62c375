"""The health monitor's rules and tensor signals on hand-made inputs: each rule fires where its docstring says, not
elsewhere, at its boundary on the documented side, ignores missing signals, and keeps its decisions across a
checkpoint (state through JSON); the rule table matches the config's actions; the signals equal direct loops."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
import torch

from rldynamics.algo.rollout_corr import k3_kl
from rldynamics.analysis.health_rules import (
    RULES,
    Alarm,
    EntropyCollapse,
    EntropySurge,
    FallingSuccess,
    FallingValidation,
    FirstStep,
    GradSpike,
    KlAcceleration,
    LengthSurge,
    Mismatch,
    NoLearning,
    NonFinite,
    PolicyDrift,
    Repetition,
    RewardComponent,
    RewardVarianceCollapse,
    Signals,
    TemplateCollapse,
    Truncation,
    UpdateKl,
)
from rldynamics.analysis.health_signals import component_shares, repetition_rate, reply_lengths, token_covariance
from rldynamics.config import (
    CHOICES,
    HEALTH_ACTIONS,
    RANGES,
    SKIPPABLE,
    Config,
    ConfigError,
    HealthConfig,
    HealthMonitorConfig,
    documented_keys,
    make_config,
)

CFG = HealthConfig()


def cfg(**changes) -> HealthConfig:
    return dataclasses.replace(CFG, **changes)


def feed(rule, stream: list[Signals]) -> list[Alarm | None]:
    return [rule.check(x) for x in stream]


def fired_at(rule, stream: list[Signals]) -> list[int]:
    """The steps of `stream` on which the rule fires."""
    return [x.step for x in stream if rule.check(x) is not None]


def history(rule) -> dict:
    """The rule's own history (its state without the monitor's streak bookkeeping), copied."""
    return json.loads(json.dumps({k: v for k, v in rule.state_dict().items() if k != "streak_start"}))


def check_alarm(alarm: Alarm | None, rule: str, value: float, threshold: float, since: int) -> None:
    assert alarm is not None, f"{rule} did not fire"
    assert alarm.rule == rule
    assert alarm.value == pytest.approx(value, rel=1e-12, abs=1e-15)
    assert alarm.threshold == pytest.approx(threshold, rel=1e-12, abs=1e-15)
    assert alarm.since == since
    assert alarm.message and "\n" not in alarm.message


# the hand numbers below use 2 standard errors and one validation below the limit
SE2 = dataclasses.replace(CFG, falling_validation_se=2.0, falling_validation_count=1)
ONCE = dataclasses.replace(CFG, falling_validation_count=1)  # the default limit, one validation below it
ONE_STEP = dataclasses.replace(CFG, component_steps=1, update_kl_steps=8)  # a component rule that fires on one
# step; the update_kl rule judging 8 updates (the last 2 of them in the later steps of the state test)
KL4 = dataclasses.replace(CFG, first_step_kl=1e-4)  # the float32 first-step bound
MAD_ONLY = dataclasses.replace(CFG, grad_spike_factor=1.0)  # the spike bound by median + k MAD alone
NL2 = dataclasses.replace(CFG, no_learning_se=2.0)  # no-learning hand numbers at 2 standard errors


def test_defaults_the_hand_numbers_below_assume():
    assert (CFG.falling_validation_se, CFG.component_steps, CFG.first_step_kl) == (3.0, 5, 5e-3)
    assert (CFG.baseline_steps, CFG.grad_spike_k, CFG.grad_spike_window, CFG.grad_spike_factor) == (5, 10.0, 20, 20.0)
    assert (CFG.entropy_collapse_ratio, CFG.zero_variance_share, CFG.zero_variance_steps) == (0.1, 0.9, 5)
    assert (CFG.drift_kl, CFG.drift_clipfrac, CFG.kl_acceleration_min, CFG.mismatch_kl) == (0.1, 0.3, 0.05, 0.01)
    assert (CFG.length_surge_ratio, CFG.truncation_rate, CFG.repetition_rate) == (2.0, 0.5, 0.3)
    assert (CFG.component_takeover, CFG.component_against, CFG.template_mi_drop) == (0.95, -0.1, 0.5)
    assert (CFG.no_learning_after, CFG.no_learning_se) == (0.5, 1.0)
    assert (CFG.entropy_surge_ratio, CFG.entropy_surge_steps) == (2.0, 3)
    assert (CFG.falling_success_steps, CFG.falling_success_se, CFG.falling_validation_count) == (5, 5.5, 2)
    assert (CFG.update_kl_max, CFG.update_kl_steps) == (0.1, 5)


# --- NonFinite: any skipped optimizer step (> 0) ---

def test_non_finite():
    rule = NonFinite(CFG)
    check_alarm(rule.check(Signals(step=3, non_finite_skips=2)), "non_finite", 2, 0, 3)
    check_alarm(rule.check(Signals(step=4, non_finite_skips=1)), "non_finite", 1, 0, 4)  # boundary: 1 > 0 fires
    assert rule.check(Signals(step=5, non_finite_skips=0)) is None
    assert rule.check(Signals(step=6)) is None  # none known
    assert history(rule) == {}


# --- FirstStep: |first PPO KL| > 1e-3 on the first step; mismatch > 1e-4 with the trainer sampling ---

def test_first_step_ppo_kl():
    rule = FirstStep(CFG)
    check_alarm(rule.check(Signals(step=1, first_step=True, first_ppo_kl=0.01)), "first_step", 0.01, 1e-3, 1)
    check_alarm(rule.check(Signals(step=1, first_step=True, first_ppo_kl=-0.01)), "first_step", -0.01, 1e-3, 1)
    assert rule.check(Signals(step=7, first_step=False, first_ppo_kl=0.5, mismatch_kl=0.5)) is None  # not first
    assert rule.check(Signals(step=1, first_step=True, first_ppo_kl=1e-3)) is None  # boundary: > 1e-3 fires
    assert rule.check(Signals(step=1, first_step=True, first_ppo_kl=-1e-3)) is None
    assert rule.check(Signals(step=1, first_step=True, first_ppo_kl=2e-4)) is None
    assert rule.check(Signals(step=1, first_step=True)) is None  # nothing measured


def test_first_step_mismatch_only_with_the_trainer_sampling():
    rule = FirstStep(KL4)
    check_alarm(rule.check(Signals(step=1, first_step=True, mismatch_kl=2e-4)), "first_step", 2e-4, 1e-4, 1)
    assert rule.check(Signals(step=1, first_step=True, mismatch_kl=2e-4, sampler_is_trainer=False)) is None
    assert rule.check(Signals(step=1, first_step=True, mismatch_kl=1e-4)) is None  # boundary: > 1e-4 fires
    # both wrong: the PPO KL is reported
    check_alarm(rule.check(Signals(step=1, first_step=True, first_ppo_kl=0.5, mismatch_kl=0.5)),
                "first_step", 0.5, 1e-3, 1)


# --- GradSpike: norm > median + k * max(MAD, 0.05 median) of the last `window` accepted norms ---

BASE_NORMS = [1.0, 1.1, 0.9, 1.0, 1.2]
# median 1.0; |n - median| = 0, 0.1, 0.1, 0, 0.2 -> MAD 0.1 (> 0.05 x 1.0) -> limit 1.0 + 10 x 0.1 = 2.0
BASE_LIMIT = 2.0


def spike_rule(norms=BASE_NORMS, **changes) -> GradSpike:
    rule = GradSpike(cfg(**{"grad_spike_factor": 1.0, **changes}))
    assert feed(rule, [Signals(step=i + 1, grad_norms=(n,)) for i, n in enumerate(norms)]) == [None] * len(norms)
    return rule


def test_grad_spike_fires_above_median_plus_k_mad():
    rule = spike_rule()
    assert rule.limit() == pytest.approx(BASE_LIMIT)
    check_alarm(rule.check(Signals(step=6, grad_norms=(1.5, 2.01, 0.8))), "grad_spike", 2.01, BASE_LIMIT, 6)
    assert history(rule)["norms"] == pytest.approx(BASE_NORMS + [1.5, 0.8])  # the spike is not in the history


def test_grad_spike_just_below_does_not_fire_and_is_accepted():
    rule = spike_rule()
    assert rule.is_spike(2.01) and not rule.is_spike(1.99)
    assert rule.check(Signals(step=6, grad_norms=(1.99,))) is None
    assert history(rule)["norms"] == pytest.approx(BASE_NORMS + [1.99])


def test_grad_spike_spikes_stay_out_of_the_history():
    rule = spike_rule()
    before = history(rule)
    for step in (6, 7, 8):  # the same spike keeps firing against the same limit
        check_alarm(rule.check(Signals(step=step, grad_norms=(5.0,))), "grad_spike", 5.0, BASE_LIMIT, step)
    assert history(rule) == before
    # two spikes in one step: the larger is reported
    check_alarm(rule.check(Signals(step=9, grad_norms=(3.0, 5.0, 1.0))), "grad_spike", 5.0, BASE_LIMIT, 9)


def test_grad_spike_boundary_is_not_a_spike():
    # median 1.0; |n - 1| = 0, 0.25, 0.25, 0, 0.5 -> MAD 0.25 -> limit 1 + 10 x 0.25 = 3.5 exactly (binary fractions)
    norms = [1.0, 1.25, 0.75, 1.0, 1.5]
    rule = spike_rule(norms)
    assert rule.check(Signals(step=6, grad_norms=(3.5,))) is None  # "above": > 3.5
    check_alarm(spike_rule(norms).check(Signals(step=6, grad_norms=(3.5 + 1e-9,))), "grad_spike", 3.5 + 1e-9, 3.5, 6)


def test_grad_spike_mad_floor_is_five_percent_of_the_median():
    rule = spike_rule([2.0] * 5)  # MAD 0 -> floor 0.05 x 2 = 0.1 -> limit 2 + 10 x 0.1 = 3.0
    assert rule.check(Signals(step=6, grad_norms=(2.99,))) is None
    check_alarm(rule.check(Signals(step=7, grad_norms=(3.01,))), "grad_spike", 3.01, 3.0, 7)


def test_grad_spike_needs_a_baseline():
    rule = spike_rule(BASE_NORMS[:4])  # 4 < baseline_steps norms
    assert rule.limit() is None and not rule.is_spike(1000.0)
    assert rule.check(Signals(step=5, grad_norms=(1000.0,))) is None


def test_grad_spike_ignores_non_finite_and_missing_norms():
    rule = spike_rule()
    before = history(rule)
    assert rule.check(Signals(step=6, grad_norms=(math.nan, math.inf, -math.inf))) is None
    assert rule.check(Signals(step=7)) is None  # no optimizer step
    assert history(rule) == before
    assert not rule.is_spike(math.inf) and not rule.is_spike(math.nan)
    check_alarm(rule.check(Signals(step=8, grad_norms=(math.nan, 5.0))), "grad_spike", 5.0, BASE_LIMIT, 8)
    assert history(rule) == before


def test_grad_spike_history_is_the_last_window_norms():
    rule = spike_rule([10.0] * 5, grad_spike_window=5)  # limit 10 + 10 x 0.5 = 15: the ones below are accepted
    assert feed(rule, [Signals(step=6 + i, grad_norms=(1.0,)) for i in range(5)]) == [None] * 5
    assert history(rule)["norms"] == [1.0] * 5  # the tens left the window: limit 1 + 10 x 0.05 = 1.5
    check_alarm(rule.check(Signals(step=11, grad_norms=(2.0,))), "grad_spike", 2.0, 1.5, 11)


# --- EntropyCollapse: entropy < ratio x the mean of the first `baseline_steps` entropies ---

def test_entropy_collapse_fires_below_ratio_of_the_start():
    rule = EntropyCollapse(CFG)
    start = [1.0, 2.0, 1.5, 1.5, 1.0]  # mean 1.4 -> limit 0.1 x 1.4 = 0.14
    assert feed(rule, [Signals(step=i + 1, entropy=e) for i, e in enumerate(start)]) == [None] * 5
    assert rule.check(Signals(step=6, entropy=0.15)) is None
    check_alarm(rule.check(Signals(step=7, entropy=0.1)), "entropy_collapse", 0.1, 0.14, 7)


def test_entropy_collapse_baseline_is_the_first_steps_only():
    rule = EntropyCollapse(CFG)
    # the baseline steps themselves are never judged, however low
    assert feed(rule, [Signals(step=i + 1, entropy=e) for i, e in enumerate([1.0, 0.01, 1.0, 1.0, 1.0])]) == [None] * 5
    # mean 4.01 / 5 = 0.802 -> limit 0.0802; a later high entropy does not move it
    assert rule.check(Signals(step=6, entropy=10.0)) is None
    check_alarm(rule.check(Signals(step=7, entropy=0.08)), "entropy_collapse", 0.08, 0.1 * 0.802, 7)


def test_entropy_collapse_boundary_and_short_run():
    rule = EntropyCollapse(cfg(entropy_collapse_ratio=0.25))
    assert feed(rule, [Signals(step=i + 1, entropy=2.0) for i in range(4)]) == [None] * 4
    assert rule.check(Signals(step=5, entropy=0.0)) is None  # still the baseline (5th)
    # start mean (2 x 4 + 0) / 5 = 1.6 -> limit 0.4 (0.25 x 1.6: binary fractions, exact)
    assert rule.check(Signals(step=6, entropy=0.4)) is None  # "below": < 0.4
    check_alarm(rule.check(Signals(step=7, entropy=0.3999)), "entropy_collapse", 0.3999, 0.4, 7)


def test_entropy_collapse_missing_entropy_changes_nothing():
    rule = EntropyCollapse(CFG)
    feed(rule, [Signals(step=1, entropy=1.0), Signals(step=2, entropy=1.0)])
    before = history(rule)
    assert rule.check(Signals(step=3)) is None
    assert history(rule) == before
    feed(rule, [Signals(step=4 + i, entropy=1.0) for i in range(3)])  # 5 known entropies: the baseline is full
    check_alarm(rule.check(Signals(step=7, entropy=0.05)), "entropy_collapse", 0.05, 0.1, 7)


@pytest.mark.parametrize("damage", [{"non_finite_skips": 1}, {"refused": 1}, {"ppo_kl": 0.5},
                                    {"clipfrac": 0.5}])
def test_entropy_collapse_start_leaves_out_the_steps_after_a_damaged_update(damage):
    # step 2's update was marked (a non-finite or refused optimizer step, or the policy_drift
    # condition): the entropies of the later steps carry its damage, so the start is steps 1 and 2
    # (measured before the update)
    rule = EntropyCollapse(CFG)
    assert rule.check(Signals(step=1, entropy=1.0)) is None
    assert rule.check(Signals(step=2, entropy=0.8, **damage)) is None
    check_alarm(rule.check(Signals(step=3, entropy=0.05)), "entropy_collapse", 0.05, 0.1 * 0.9, 3)
    assert history(rule)["start"] == [1.0, 0.8]
    assert rule.check(Signals(step=4, entropy=0.5)) is None  # judged against the same start


def test_entropy_collapse_start_is_not_closed_by_a_healthy_update():
    rule = EntropyCollapse(CFG)
    at_the_limits = dict(entropy=1.0, ppo_kl=0.1, clipfrac=0.3, refused=0)
    feed(rule, [Signals(step=s, **at_the_limits) for s in range(1, 6)])
    assert history(rule)["start"] == [1.0] * 5  # at the drift limits, not above: not a blow-up


# --- EntropySurge: entropy > ratio x the start (entropy_collapse's) on each of the last `entropy_surge_steps` ---

# math-tiny with algo.entropy_coef=0.5 (20 steps, seed 0): the rollout policy's entropy at steps 1-20
ENTROPY_BONUS = [0.182, 0.221, 0.183, 0.175, 0.169, 0.184, 0.178, 0.217, 0.219, 0.229, 0.245, 0.287, 0.319, 0.4,
                 0.414, 0.432, 0.567, 0.649, 0.901, 1.219]


def entropies(values: list[float], first: int = 1) -> list[Signals]:
    return [Signals(step=first + i, entropy=e) for i, e in enumerate(values)]


def test_entropy_surge_fires_held_above_ratio_of_the_start():
    rule = EntropySurge(CFG)
    assert feed(rule, entropies([1.0, 2.0, 1.5, 1.5, 1.0])) == [None] * 5  # mean 1.4 -> limit 2 x 1.4 = 2.8
    assert feed(rule, entropies([3.0, 3.0], first=6)) == [None, None]  # above, but 2 steps of 3
    check_alarm(rule.check(Signals(step=8, entropy=2.9)), "entropy_surge", 2.9, 2.8, 6)


def test_entropy_surge_a_step_at_or_below_the_bound_restarts_the_count():
    rule = EntropySurge(CFG)
    feed(rule, entropies([1.0] * 5))  # limit 2.0
    assert feed(rule, entropies([2.5, 2.5, 2.0, 2.5, 2.5], first=6)) == [None] * 5  # "above": 2.0 does not count
    check_alarm(rule.check(Signals(step=11, entropy=2.5)), "entropy_surge", 2.5, 2.0, 9)


def test_entropy_surge_start_leaves_out_the_steps_after_a_damaged_update():
    # as entropy_collapse's: step 2's update drifted, so the start is steps 1 and 2 (mean 0.9, limit 1.8)
    rule = EntropySurge(CFG)
    assert rule.check(Signals(step=1, entropy=1.0)) is None
    assert rule.check(Signals(step=2, entropy=0.8, ppo_kl=0.5)) is None
    assert feed(rule, entropies([1.9, 1.9], first=3)) == [None, None]
    check_alarm(rule.check(Signals(step=5, entropy=1.9)), "entropy_surge", 1.9, 2 * 0.9, 3)


def test_entropy_surge_missing_entropy_changes_nothing():
    rule = EntropySurge(CFG)
    feed(rule, entropies([1.0] * 5) + entropies([2.5, 2.5], first=6))
    before = history(rule)
    assert rule.check(Signals(step=8)) is None
    assert history(rule) == before
    check_alarm(rule.check(Signals(step=9, entropy=2.5)), "entropy_surge", 2.5, 2.0, 6)


def test_entropy_surge_quiet_on_a_noisy_flat_and_a_slowly_rising_entropy():
    rng = random.Random(0)
    flat = [1.0 + rng.gauss(0, 0.15) for _ in range(100)]
    rising = [1.0 + 0.8 * s / 100 + rng.gauss(0, 0.05) for s in range(100)]  # to 1.8 x its start
    for series in (flat, rising):
        assert not any(feed(EntropySurge(CFG), entropies(series)))


def test_entropy_surge_on_the_entropy_bonus_run():
    assert fired_at(EntropySurge(CFG), entropies(ENTROPY_BONUS)) == [16, 17, 18, 19, 20]
    start = sum(ENTROPY_BONUS[:5]) / 5  # 0.1860
    check_alarm(feed(EntropySurge(CFG), entropies(ENTROPY_BONUS))[15], "entropy_surge", 0.432, 2 * start, 14)


# --- RewardVarianceCollapse: share >= limit on each of the last `zero_variance_steps` steps ---

def test_reward_variance_collapse_needs_consecutive_steps_since_the_first():
    rule = RewardVarianceCollapse(CFG)
    shares = [0.5, 0.95, 0.9, 1.0, 0.92]
    assert feed(rule, [Signals(step=i + 1, zero_variance_share=s) for i, s in enumerate(shares)]) == [None] * 5
    # steps 2..6 all >= 0.9 (0.9 itself counts: "at least")
    check_alarm(rule.check(Signals(step=6, zero_variance_share=0.95)), "reward_variance_collapse", 0.95, 0.9, 2)
    check_alarm(rule.check(Signals(step=7, zero_variance_share=1.0)), "reward_variance_collapse", 1.0, 0.9, 3)


def test_reward_variance_collapse_a_break_restarts_the_count():
    rule = RewardVarianceCollapse(CFG)
    shares = [0.95] * 4 + [0.89] + [0.95] * 4
    assert feed(rule, [Signals(step=i + 1, zero_variance_share=s) for i, s in enumerate(shares)]) == [None] * 9
    check_alarm(rule.check(Signals(step=10, zero_variance_share=0.95)), "reward_variance_collapse", 0.95, 0.9, 6)


def test_reward_variance_collapse_boundary_short_run_and_missing():
    rule = RewardVarianceCollapse(CFG)
    assert feed(rule, [Signals(step=i + 1, zero_variance_share=0.9) for i in range(4)]) == [None] * 4  # 4 < 5
    before = history(rule)
    assert rule.check(Signals(step=5)) is None  # no groups this step: neither counts nor breaks
    assert history(rule) == before
    check_alarm(rule.check(Signals(step=6, zero_variance_share=0.9)), "reward_variance_collapse", 0.9, 0.9, 1)
    assert RewardVarianceCollapse(CFG).check(Signals(step=1, zero_variance_share=1.0)) is None


def test_reward_variance_collapse_steps_override():
    rule = RewardVarianceCollapse(cfg(zero_variance_steps=2, zero_variance_share=0.5))
    assert rule.check(Signals(step=4, zero_variance_share=0.6)) is None
    check_alarm(rule.check(Signals(step=5, zero_variance_share=0.5)), "reward_variance_collapse", 0.5, 0.5, 4)


# --- PolicyDrift: PPO KL > drift_kl or clipped share > drift_clipfrac ---

def test_policy_drift():
    rule = PolicyDrift(CFG)
    check_alarm(rule.check(Signals(step=4, ppo_kl=0.2, clipfrac=0.1)), "policy_drift", 0.2, 0.1, 4)
    check_alarm(rule.check(Signals(step=5, ppo_kl=0.05, clipfrac=0.4)), "policy_drift", 0.4, 0.3, 5)
    check_alarm(rule.check(Signals(step=6, ppo_kl=0.2, clipfrac=0.4)), "policy_drift", 0.2, 0.1, 6)  # KL first
    check_alarm(rule.check(Signals(step=7, clipfrac=0.31)), "policy_drift", 0.31, 0.3, 7)  # KL unknown
    assert rule.check(Signals(step=8, ppo_kl=0.1, clipfrac=0.3)) is None  # boundary: "above"
    assert rule.check(Signals(step=9, ppo_kl=0.05, clipfrac=0.1)) is None
    assert rule.check(Signals(step=10)) is None
    assert history(rule) == {}


# --- KlAcceleration: last 5 KLs with positive 1st and 2nd differences, the latest > kl_acceleration_min ---

DOUBLING = [0.0625, 0.125, 0.25, 0.5, 1.0]  # differences 1/16, 1/8, 1/4, 1/2; second differences 1/16, 1/8, 1/4


def kl_stream(values, start=1):
    return [Signals(step=start + i, kl_ref=v) for i, v in enumerate(values)]


def test_kl_acceleration_fires_on_accelerating_growth_since_the_first_of_five():
    rule = KlAcceleration(CFG)
    alarms = feed(rule, kl_stream(DOUBLING + [2.0]))
    assert alarms[:4] == [None] * 4  # fewer than 5 values
    check_alarm(alarms[4], "kl_acceleration", 1.0, 0.05, 1)
    check_alarm(alarms[5], "kl_acceleration", 2.0, 0.05, 2)  # the window slides


def test_kl_acceleration_not_on_linear_decelerating_or_falling_kl():
    linear = [0.0625 * k for k in range(1, 7)]  # exact in binary: second differences exactly 0
    assert feed(KlAcceleration(CFG), kl_stream(linear)) == [None] * 6
    assert feed(KlAcceleration(CFG), kl_stream([0.1, 0.5, 0.8, 1.0, 1.1])) == [None] * 5  # decelerating
    assert feed(KlAcceleration(CFG), kl_stream([0.1, 0.2, 0.4, 0.35, 0.8])) == [None] * 5  # a fall
    # accelerating but small: below the minimum
    assert feed(KlAcceleration(CFG), kl_stream([0.001, 0.002, 0.004, 0.008, 0.016])) == [None] * 5


def test_kl_acceleration_boundary_and_missing():
    assert feed(KlAcceleration(cfg(kl_acceleration_min=1.0)), kl_stream(DOUBLING))[-1] is None  # "above": > 1.0
    check_alarm(feed(KlAcceleration(cfg(kl_acceleration_min=0.999)), kl_stream(DOUBLING))[-1],
                "kl_acceleration", 1.0, 0.999, 1)
    rule = KlAcceleration(CFG)
    feed(rule, kl_stream(DOUBLING[:3]))
    before = history(rule)
    assert rule.check(Signals(step=4)) is None  # no KL term: neither counts nor breaks
    assert history(rule) == before
    alarms = feed(rule, kl_stream(DOUBLING[3:], start=5))
    assert alarms[0] is None  # 4 values so far
    check_alarm(alarms[1], "kl_acceleration", 1.0, 0.05, 1)


# --- Mismatch, Truncation, Repetition: a value above a fixed limit ---

@pytest.mark.parametrize("rule_type, field, limit", [(Mismatch, "mismatch_kl", 0.01),
                                                      (Truncation, "truncation", 0.5),
                                                      (Repetition, "repetition", 0.3)])
def test_limit_rules(rule_type, field, limit):
    rule = rule_type(CFG)
    check_alarm(rule.check(Signals(step=3, **{field: limit * 1.5})), rule_type.name, limit * 1.5, limit, 3)
    assert rule.check(Signals(step=4, **{field: limit})) is None  # boundary: "above" / "more than"
    assert rule.check(Signals(step=5, **{field: limit / 2})) is None
    assert rule.check(Signals(step=6)) is None
    assert history(rule) == {}


def test_mismatch_is_judged_on_every_engine():
    check_alarm(Mismatch(CFG).check(Signals(step=2, mismatch_kl=0.02, sampler_is_trainer=False)),
                "mismatch", 0.02, 0.01, 2)


# --- LengthSurge: mean reply length > ratio x its mean over the first steps ---

def test_length_surge():
    rule = LengthSurge(CFG)
    start = [10.0, 20.0, 10.0, 20.0, 15.0]  # mean 15 -> limit 2 x 15 = 30
    assert feed(rule, [Signals(step=i + 1, reply_mean=m) for i, m in enumerate(start)]) == [None] * 5
    assert rule.check(Signals(step=6, reply_mean=30.0)) is None  # boundary: "more than"
    assert rule.check(Signals(step=7, reply_mean=25.0)) is None
    check_alarm(rule.check(Signals(step=8, reply_mean=31.0)), "length_surge", 31.0, 30.0, 8)
    before = history(rule)
    assert rule.check(Signals(step=9)) is None
    assert history(rule) == before


def test_length_surge_short_run_and_missing():
    rule = LengthSurge(CFG)
    stream = [Signals(step=1, reply_mean=10.0), Signals(step=2), Signals(step=3, reply_mean=10.0)]
    assert feed(rule, stream) == [None] * 3
    assert history(rule)["start"] == [10.0, 10.0]
    assert feed(rule, [Signals(step=4 + i, reply_mean=1000.0) for i in range(3)]) == [None] * 3  # still the start
    # start mean (10 + 10 + 3 x 1000) / 5 = 604 -> limit 1208
    check_alarm(rule.check(Signals(step=7, reply_mean=1209.0)), "length_surge", 1209.0, 1208.0, 7)


# --- RewardComponent: a share >= component_takeover, or below component_against ---

def test_reward_component_takeover():
    rule = RewardComponent(ONE_STEP)
    alarm = rule.check(Signals(step=3, component_shares={"format": 0.97, "success": 0.03}))
    check_alarm(alarm, "reward_component", 0.97, 0.95, 3)
    assert "format" in alarm.message
    # boundary: 0.95 is "carrying component_takeover" (>=)
    check_alarm(rule.check(Signals(step=4, component_shares={"a": 0.95, "b": 0.05})), "reward_component", 0.95, 0.95,
                4)
    assert rule.check(Signals(step=5, component_shares={"a": 0.94, "b": 0.06})) is None


def test_reward_component_against():
    rule = RewardComponent(ONE_STEP)
    alarm = rule.check(Signals(step=3, component_shares={"a": 0.6, "b": 0.6, "c": -0.2}))
    check_alarm(alarm, "reward_component", -0.2, -0.1, 3)
    assert "c" in alarm.message and "against" in alarm.message
    # boundary: "below component_against" (<)
    assert rule.check(Signals(step=4, component_shares={"a": 0.55, "b": 0.55, "c": -0.1})) is None
    assert rule.check(Signals(step=5, component_shares={"a": 0.5, "b": 0.55, "c": -0.05})) is None
    assert rule.check(Signals(step=6)) is None  # one component or a constant total: no shares
    assert history(rule) == {"recent": [[5, ":0.0"]]}  # the last step that had shares, which crossed nothing


# --- FallingSuccess: the mean training success of the last k steps < the best such mean - z SE, SE the larger of
# sqrt(mean squared step-to-step change / k) and hypot of the two windows' binomial SEs ---

# math-tiny with env.reward_weights.correctness=-1 (20 steps, seed 0): successful trajectories of 64 at steps 1-20
FLIPPED = [23, 16, 16, 13, 4, 6, 9, 11, 8, 4, 1, 1, 3, 4, 4, 3, 3, 3, 8, 3]
# the default preset's healthy seed 0 (runs/false_alarms, 100 steps): successful trajectories of 64
HEALTHY = [13, 0, 8, 9, 1, 4, 3, 1, 13, 6, 5, 15, 10, 8, 4, 12, 0, 8, 11, 1, 15, 1, 17, 8, 19, 14, 9, 7, 10, 21, 8, 12,
           13, 15, 10, 15, 18, 13, 11, 7, 9, 12, 19, 17, 2, 27, 11, 6, 14, 17, 18, 14, 12, 1, 24, 4, 6, 8, 18, 11, 13,
           13, 6, 19, 7, 19, 4, 26, 4, 6, 4, 15, 14, 14, 9, 1, 7, 20, 9, 10, 22, 22, 20, 33, 11, 5, 9, 3, 15, 13, 5, 11,
           15, 11, 16, 20, 2, 4, 36, 12]
K2 = dataclasses.replace(CFG, falling_success_steps=2, falling_success_se=2.0)  # hand numbers: 2 steps, 2 SE


def successes(values: list[float], count: int = 100, first: int = 1) -> list[Signals]:
    return [Signals(step=first + i, train_success=v, train_count=count) for i, v in enumerate(values)]


def noisy_success(rng: random.Random, level) -> list[float]:
    """100 steps of 64 trajectories whose prompts' difficulty scales the success level by 0.2-1.8."""
    return [sum(rng.random() < min(1.0, level(s) * rng.uniform(0.2, 1.8)) for _ in range(64)) / 64
            for s in range(100)]


def test_falling_success_fires_on_the_step_to_step_spread():
    rule = FallingSuccess(K2)
    assert feed(rule, successes([0.5, 0.5])) == [None, None]  # the first window: the best (0.5 of 200)
    # changes 0, -0.2: spread sqrt(0.04 / 2 / 2) = 0.1 > the binomial 0.049 -> limit 0.5 - 2 x 0.1 = 0.3
    assert rule.check(successes([0.3], first=3)[0]) is None  # mean 0.4
    # changes 0, -0.2, -0.2: spread sqrt(0.08 / 3 / 2) = 0.1155 -> limit 0.269; mean 0.2
    check_alarm(rule.check(successes([0.1], first=4)[0]), "falling_success", 0.2, 0.5 - 2 * math.sqrt(0.08 / 6),
                3)  # since: the step after the best window


def test_falling_success_standard_error_is_at_least_binomial():
    rule = FallingSuccess(K2)
    assert feed(rule, successes([0.5] * 4 + [0.4])) == [None] * 5  # steady: spread sqrt(0.01 / 4 / 2) = 0.035
    # binomial hypot(sqrt(0.25 / 200), sqrt(0.24 / 200)) = 0.0495 > spread sqrt(0.01 / 5 / 2) = 0.0316
    limit = 0.5 - 2 * math.hypot(math.sqrt(0.25 / 200), math.sqrt(0.24 / 200))  # 0.40101
    check_alarm(rule.check(successes([0.4], first=6)[0]), "falling_success", 0.4, limit, 3)


def test_falling_success_a_new_best_and_missing_steps():
    rule = FallingSuccess(K2)
    assert feed(rule, successes([0.2, 0.2, 0.6, 0.6])) == [None] * 4
    assert history(rule)["best"] == [4, 0.6, 200]  # the window of steps 3-4
    before = history(rule)
    assert rule.check(Signals(step=5)) is None  # no rollout success: nothing changes
    assert history(rule) == before
    assert not FallingSuccess(K2).check(successes([0.0])[0])  # a short run


def test_falling_success_on_the_flipped_reward_run():
    alarms = feed(FallingSuccess(CFG), successes([n / 64 for n in FLIPPED], count=64))
    step, first = next((i + 1, a) for i, a in enumerate(alarms) if a)
    assert (step, first.since, first.value) == (13, 6, (8 + 4 + 1 + 1 + 3) / 320)  # best: steps 1-5, 22.5 %


def test_falling_success_quiet_on_the_healthy_default_run_by_a_margin():
    signals = successes([n / 64 for n in HEALTHY], count=64)
    assert not any(feed(FallingSuccess(CFG), signals))
    # its worst: 13.4 % over steps 85-89 against the best 33.8 % (steps 80-84), 3.0 standard errors
    assert fired_at(FallingSuccess(cfg(falling_success_se=3.0)), signals) == [89]


def test_falling_success_quiet_on_noisy_flat_and_slowly_rising_success():
    rng = random.Random(0)
    for _ in range(10):
        for level in (lambda s: 0.3, lambda s: 0.1 + 0.4 * s / 100):
            assert not any(feed(FallingSuccess(CFG), successes(noisy_success(rng, level), count=64)))


# --- FallingValidation: success < best - 2 hypot(SE_best, SE_now), SE = sqrt(p (1 - p) / n) ---

def val(step, success, count=100, progress=0.0, se=None):
    """A validation of `count` trajectories; `se`: its problem-clustered SE (None: not logged)."""
    clustered = {} if se is None else {"val_se": se}
    return Signals(step=step, val_success=success, val_count=count, progress=progress, **clustered)


def test_falling_validation_fires_two_standard_errors_below_the_best():
    rule = FallingValidation(SE2)
    assert feed(rule, [val(1, 0.6), val(3, 0.8), val(4, 0.8)]) == [None] * 3  # the best: step 3 (ties keep it)
    # SE_best = sqrt(0.8 x 0.2 / 100) = 0.04, SE_now = sqrt(0.6 x 0.4 / 100) = sqrt(0.0024)
    limit = 0.8 - 2 * math.sqrt(0.0016 + 0.0024)  # 0.67351
    check_alarm(rule.check(val(5, 0.6)), "falling_validation", 0.6, limit, 4)  # since: the step after the best


def test_falling_validation_not_within_two_standard_errors():
    rule = FallingValidation(SE2)
    assert feed(rule, [val(1, 0.8), val(2, 0.7)]) == [None, None]  # limit 0.8 - 2 sqrt(0.0016 + 0.0021) = 0.678
    assert rule.check(val(3, 0.9)) is None  # a new best
    assert history(rule)["best"] == [3, 0.9, 100]


def test_falling_validation_boundary():
    # best 0.9 of 100: SE 0.03; now 0.8 of 100: SE 0.04 -> limit 0.9 - 2 x 0.05 = 0.8 (d(now - limit)/d now = 0.88)
    # (the float arithmetic lands on 0.8 exactly too: 0.9 - 2 x hypot(0.03, 0.04) == 0.8)
    rule = FallingValidation(SE2)
    rule.check(val(2, 0.9))
    assert rule.check(val(3, 0.8)) is None  # "more than 2 standard errors below": < limit
    assert rule.check(val(3, 0.8 + 1e-9)) is None
    check_alarm(rule.check(val(4, 0.8 - 1e-9)), "falling_validation", 0.8 - 1e-9, 0.8 - 1.2e-10, 3)


def test_falling_validation_short_run_and_missing():
    rule = FallingValidation(SE2)
    assert rule.check(val(1, 0.0)) is None  # the first validation is the best
    rule = FallingValidation(SE2)
    rule.check(val(1, 0.8))
    before = history(rule)
    assert rule.check(Signals(step=2)) is None
    assert history(rule) == before


def test_a_spike_must_also_be_twenty_times_the_median_by_default():
    rule = GradSpike(CFG)
    rule.check(Signals(step=1, grad_norms=(1.0, 1.1, 0.9, 1.0, 1.2)))  # median 1.0, MAD 0.1: median + 10 MAD = 2
    assert not rule.is_spike(19.9) and rule.is_spike(20.01)
    check_alarm(rule.check(Signals(step=2, grad_norms=(0.0, 17.0, 24.0))), "grad_spike", 24.0, 20.0, 2)
    # the zero norm (no reward variance) and the spike left out; 17 x the median (a healthy run's heavy tail) kept
    assert rule.norms == [1.0, 1.1, 0.9, 1.0, 1.2, 17.0]


def test_falling_validation_by_default_needs_three_standard_errors():
    rule = FallingValidation(ONCE)
    rule.check(val(1, 0.9))
    assert rule.check(val(2, 0.79)) is None  # 2.2 standard errors (0.05 each) below: not enough by default
    check_alarm(rule.check(val(3, 0.7)), "falling_validation", 0.7, 0.9 - 3 * math.hypot(0.03, math.sqrt(0.21 / 100)),
                2)


def test_falling_validation_by_default_needs_two_validations_in_a_row_below():
    # math-tiny seed 2's healthy run (clustered SEs): 77.0 % at step 75, 66.2 % at 100 (3.8 SE below), 85.7 % at 125
    rule = FallingValidation(CFG)
    assert feed(rule, [val(0, 0.533, se=0.022), val(75, 0.770, se=0.019)]) == [None, None]
    assert rule.check(val(100, 0.662, se=0.021)) is None  # one validation below the limit: an oscillation
    assert rule.below == 1
    assert rule.check(val(125, 0.857, se=0.016)) is None and rule.below == 0  # a new best
    # a fall that holds: below at two validations in a row, the second one fires
    rule = FallingValidation(CFG)
    rule.check(val(0, 0.8, se=0.02))  # limit 0.8 - 3 x hypot(0.02, 0.03) = 0.69183
    limit = 0.8 - 3 * math.hypot(0.02, 0.03)
    assert rule.check(val(10, 0.6, se=0.03)) is None
    assert rule.check(val(20, 0.7, se=0.03)) is None and rule.below == 0  # back within: the count starts again
    assert rule.check(val(30, 0.6, se=0.03)) is None
    alarm = rule.check(val(40, 0.6, se=0.03))
    check_alarm(alarm, "falling_validation", 0.6, limit, 1)
    assert "2 validations in a row" in alarm.message
    assert rule.check(val(50, 0.7, se=0.03)) is None  # not below: it stops firing


def test_reward_component_needs_the_same_finding_on_consecutive_steps():
    rule = RewardComponent(CFG)
    over = {"format": 0.97, "success": 0.03}
    assert feed(rule, [Signals(step=s, component_shares=over) for s in range(1, 5)]) == [None] * 4
    check_alarm(rule.check(Signals(step=5, component_shares=over)), "reward_component", 0.97, 0.95, 1)
    rule = RewardComponent(CFG)
    mixed = [over, over, {"format": 0.5, "success": 0.5}, over, over]  # a step without a takeover breaks the run
    assert feed(rule, [Signals(step=s + 1, component_shares=m) for s, m in enumerate(mixed)]) == [None] * 5


# --- NoLearning: at progress >= no_learning_after, success <= first + k hypot(SE_first, SE_now),
# k = 2 here ---

def test_no_learning_fires_past_the_share_of_the_run():
    rule = NoLearning(NL2)
    assert rule.check(val(1, 0.5, progress=0.1)) is None  # the first value
    assert rule.check(val(4, 0.5, progress=0.4)) is None  # too early
    # SE_first = sqrt(0.25 / 100) = 0.05, SE_now = sqrt(0.24 / 100) -> limit 0.5 + 2 sqrt(0.0049) = 0.64
    check_alarm(rule.check(val(6, 0.6, progress=0.6)), "no_learning", 0.6, 0.64, 1)
    # 0.7: limit 0.5 + 2 sqrt(0.0025 + 0.0021) = 0.6356: learnt
    assert rule.check(val(7, 0.7, progress=0.7)) is None


def test_no_learning_progress_boundary():
    rule = NoLearning(NL2)
    rule.check(val(1, 0.5, progress=0.1))
    assert rule.check(val(4, 0.5, progress=0.5 - 1e-9)) is None
    # the code checks from progress == no_learning_after on (step/steps reached the share)
    check_alarm(rule.check(val(5, 0.5, progress=0.5)), "no_learning", 0.5, 0.5 + 2 * math.hypot(0.05, 0.05), 1)


def test_no_learning_value_boundary():
    # first 0.1 of 100: SE 0.03; now 0.2 of 100: SE 0.04 -> limit 0.1 + 2 x 0.05 = 0.2 (d(now - limit)/d now = 0.88)
    # (the float arithmetic lands on 0.2 exactly too: 0.1 + 2 x hypot(0.03, 0.04) == 0.2)
    def after_start(success: float) -> Alarm | None:
        rule = NoLearning(NL2)
        rule.check(val(1, 0.1))
        return rule.check(val(2, success, progress=0.9))

    assert after_start(0.2 + 1e-9) is None  # "2 standard errors above": > limit
    check_alarm(after_start(0.2), "no_learning", 0.2, 0.2, 1)  # at the limit: not above
    check_alarm(after_start(0.2 - 1e-9), "no_learning", 0.2 - 1e-9, 0.2 - 1.2e-10, 1)


def test_no_learning_short_run_and_missing():
    rule = NoLearning(NL2)
    assert rule.check(val(9, 0.0, progress=0.9)) is None  # the first validation, however late
    before = history(rule)
    assert rule.check(Signals(step=10, progress=1.0)) is None
    assert history(rule) == before == {"first": [0.0, 100], "first_se": None, "learned": None}


# --- the validation rules with the problem-clustered standard error (val-env/<env>/success_se) ---

def test_falling_validation_uses_the_problem_clustered_standard_errors():
    # 100 trajectories of 25 problems drawn 4 times: clustered SEs (0.06, 0.08) above the binomial
    rule = FallingValidation(SE2)
    rule.check(val(1, 0.8, se=0.06))
    # limit 0.8 - 2 x hypot(0.06, 0.08) = 0.8 - 2 x 0.1 = 0.6
    # (binomial: 0.8 - 2 x hypot(0.04, 0.0488) = 0.674)
    assert rule.check(val(2, 0.61, se=0.08)) is None
    check_alarm(rule.check(val(3, 0.59, se=0.08)), "falling_validation", 0.59, 0.6, 2)
    assert history(rule)["best_se"] == 0.06


def test_no_learning_uses_the_problem_clustered_standard_errors():
    def after_start(success: float) -> Alarm | None:
        rule = NoLearning(CFG)
        rule.check(val(0, 0.5, se=0.03))  # binomial: 0.05
        return rule.check(val(6, success, se=0.04, progress=0.6))

    # limit 0.5 + 1 x hypot(0.03, 0.04) = 0.55
    # (binomial: 0.5 + hypot(0.05, sqrt(0.56 x 0.44 / 100)) = 0.5705)
    assert after_start(0.56) is None
    check_alarm(after_start(0.54), "no_learning", 0.54, 0.55, 1)
    rule = NoLearning(CFG)
    rule.check(val(0, 0.5))  # a validation without it: binomial, 0.05
    # limit 0.5 + hypot(0.05, 0.04) = 0.5640
    check_alarm(rule.check(val(6, 0.56, se=0.04, progress=0.6)), "no_learning", 0.56,
                0.5 + math.hypot(0.05, 0.04), 1)


# the default run's validations (docs/training.md: 512 puzzles, one sample each: clustered SE
# sqrt(p q / 511))
DEFAULT_RUN = [(0, 0.152), (20, 0.158), (40, 0.168), (60, 0.197), (80, 0.223), (100, 0.246)]
FLAT_RUN = [(0, 0.152), (20, 0.150), (40, 0.160), (60, 0.160), (80, 0.149), (100, 0.158)]


def run_val(step: int, success: float) -> Signals:
    se = math.sqrt(success * (1 - success) / 511)
    return val(step, success, count=512, progress=step / 100, se=se)


def test_no_learning_lets_the_default_runs_slow_learning_pass_and_flags_a_flat_run():
    # step 60: 19.7 % against 15.2 % is 1.9 standard errors of the difference: learning, judged at 1
    rule = NoLearning(CFG)
    assert [rule.check(run_val(s, p)) for s, p in DEFAULT_RUN] == [None] * 6
    flat = NoLearning(CFG)
    fired = [a for a in (flat.check(run_val(s, p)) for s, p in FLAT_RUN) if a is not None]
    assert [a.value for a in fired] == [0.160, 0.149, 0.158]  # from step 60 (past half the run) on


# seed 1 of the default preset: learned by step 20 (+1.7 standard errors), then fell back a little
LEARNED_THEN_FLAT = [(0, 0.166), (20, 0.207), (40, 0.199), (60, 0.197), (80, 0.184), (100, 0.180)]


def test_no_learning_leaves_a_run_that_learned_and_fell_back_to_falling_validation():
    rule = NoLearning(CFG)
    assert [rule.check(run_val(s, p)) for s, p in LEARNED_THEN_FLAT] == [None] * 6
    assert history(rule)["learned"] == 20
    falling = FallingValidation(CFG)  # 20.7 % -> 18.0 %: about 1.1 standard errors, not 2
    assert [falling.check(run_val(s, p)) for s, p in LEARNED_THEN_FLAT] == [None] * 6


# --- TemplateCollapse: MI < drop x its first value while entropy >= 0.8 x its first ---

def test_template_collapse_fires_on_an_mi_drop_with_the_entropy_held():
    rule = TemplateCollapse(CFG)
    assert rule.check(Signals(step=2, mi=0.4, entropy=2.0)) is None  # the first values; limit 0.5 x 0.4 = 0.2
    check_alarm(rule.check(Signals(step=4, mi=0.1, entropy=1.9)), "template_collapse", 0.1, 0.2, 4)
    check_alarm(rule.check(Signals(step=5, mi=0.1, entropy=1.6)), "template_collapse", 0.1, 0.2, 5)  # 0.8 x 2: held
    assert rule.check(Signals(step=6, mi=0.1, entropy=1.5)) is None  # the entropy fell too (< 1.6): not template
    assert rule.check(Signals(step=7, mi=0.2, entropy=2.0)) is None  # boundary: "below" 0.2
    assert rule.check(Signals(step=8, mi=0.3, entropy=2.0)) is None


def test_template_collapse_missing_and_non_positive_first_mi():
    rule = TemplateCollapse(CFG)
    assert rule.check(Signals(step=1, mi=0.4)) is None  # no entropy: not a first value
    assert rule.check(Signals(step=2, entropy=2.0)) is None  # no MI
    assert history(rule) == {"first_mi": None, "first_entropy": None}
    rule.check(Signals(step=3, mi=0.4, entropy=2.0))
    before = history(rule)
    assert rule.check(Signals(step=4, entropy=2.0)) is None
    assert history(rule) == before
    flat = TemplateCollapse(CFG)
    flat.check(Signals(step=1, mi=0.0, entropy=2.0))
    assert flat.check(Signals(step=2, mi=-0.5, entropy=2.0)) is None  # no MI to lose


# --- each rule's state through a checkpoint (JSON) ---

def busy(step: int) -> Signals:
    """A step on which every rule has something to read; from step 7 on each rule fires somewhere."""
    late = step > 6
    entropy = 1.0 if not late else 0.05 if step <= 9 else 2.5
    return Signals(step=step, progress=step / 12, first_step=step % 4 == 0, entropy=entropy,
                   train_success=0.5 if not late else 0.05, train_count=64,
                   zero_variance_share=0.95, grad_norms=(1.0, 1.1) if not late else (1.0, 30.0),
                   first_ppo_kl=0.01, ppo_kl=0.02 * step, clipfrac=0.0, kl_ref=0.01 * 2 ** step,
                   mismatch_kl=0.002 * step, update_kl=0.01 if not late else 0.5,
                   reply_mean=10.0 if not late else 50.0, truncation=step / 12,
                   repetition=step / 12, component_shares={"a": step / 12, "b": 1 - step / 12},
                   mi=0.5 if not late else 0.1, val_success=0.55 + 0.005 * step if not late else 0.2,
                   val_count=100,
                   non_finite_skips=step % 2)


@pytest.mark.parametrize("name", list(RULES))
def test_state_dict_through_json_gives_the_same_decisions(name):
    rule = RULES[name](ONE_STEP)
    feed(rule, [busy(step) for step in range(1, 7)])
    rule.streak_start = 3
    state = json.loads(json.dumps(rule.state_dict()))
    restored, fresh = RULES[name](ONE_STEP), RULES[name](ONE_STEP)
    restored.load_state_dict(state)
    assert restored.streak_start == 3
    later = [busy(step) for step in range(7, 13)]
    want = feed(rule, later)
    assert any(want), f"{name} never fires on the later steps: the comparison would be empty"
    assert feed(restored, later) == want
    if set(vars(fresh)) - {"cfg", "streak_start"} and name != "reward_component":  # a rule with a history (the
        # component rule's is one step long here): without it the decisions differ
        assert feed(fresh, later) != want


# --- the rule table and the config's actions ---

def test_rules_are_the_health_action_keys():
    actions = {key for key, allowed in CHOICES.items() if allowed == HEALTH_ACTIONS}
    assert all(key.startswith("health.") for key in actions)
    assert {key.removeprefix("health.") for key in actions} == set(RULES)
    fields = {f.name for f in dataclasses.fields(HealthConfig) if f.metadata.get("choices") == HEALTH_ACTIONS}
    assert fields == set(RULES)
    assert all(getattr(CFG, name) in HEALTH_ACTIONS for name in RULES)
    assert all(rule.name == name for name, rule in RULES.items())
    assert set(SKIPPABLE) <= actions
    # the rules whose trouble is known before the optimizer step is taken (the guard; a non-finite gradient)
    assert set(SKIPPABLE) == {"health.grad_spike", "health.non_finite"}


def test_health_config_holds_the_monitors_keys_then_each_rules_own_in_table_order():
    """`HealthConfig` is the monitor's keys and every rule's `Config`, each key once (a name two rules declared would
    be one key), in the order of --help-config."""
    sections = [HealthMonitorConfig, *(rule.Config for rule in RULES.values())]
    own = [f.name for section in sections for f in dataclasses.fields(section)]
    assert [f.name for f in dataclasses.fields(HealthConfig)] == own


@pytest.mark.parametrize("name", list(RULES))
def test_each_rules_settings_are_health_keys_with_their_default_check_and_docs(name):
    """A rule's `Config` fields are `health.<field>` keys: its action first, each with its default, a checked value
    (choices or a range) and its --help-config text; a threshold can be set on the command line."""
    own = dataclasses.fields(RULES[name].Config)
    assert own[0].name == name and own[0].metadata["choices"] == HEALTH_ACTIONS
    documented = {key: (default, doc) for key, default, doc in documented_keys(Config())}
    for f in own:
        key = f"health.{f.name}"
        assert documented[key][0] == f.default == getattr(CFG, f.name), key
        assert documented[key][1].strip(), f"{key} has no docstring under its field"
        assert key in CHOICES or key in RANGES, f"{key} has no value check"
    for f in own[1:]:
        low, inclusive, high = RANGES[f"health.{f.name}"]
        value = high if high is not None else low + 1
        assert getattr(make_config(overrides=[f"health.{f.name}={value}"]).health, f.name) == value


@pytest.mark.parametrize("name", list(RULES))
def test_only_skippable_rules_may_skip(name):
    key = f"health.{name}"
    if key in SKIPPABLE:
        assert getattr(make_config(overrides=[f"{key}=skip"]).health, name) == "skip"
        return
    with pytest.raises(ConfigError) as e:
        make_config(overrides=[f"{key}=skip"])
    assert str(e.value).startswith(f"{key}=skip") and "\n" not in str(e.value)
    assert all(skippable in str(e.value) for skippable in SKIPPABLE)  # the message names the keys that may skip
    for action in ("record", "warn", "rollback", "stop"):
        assert getattr(make_config(overrides=[f"{key}={action}"]).health, name) == action


@pytest.mark.parametrize("value", ["5", "0.5", "-1.5"])
def test_component_against_outside_its_share_range_is_refused(value):
    with pytest.raises(ConfigError) as e:
        make_config(overrides=[f"health.component_against={value}"])
    assert str(e.value) == f"health.component_against must be >= -1 and <= 0, got {float(value)}"


@pytest.mark.parametrize("value", [-1.0, -0.1, 0.0])
def test_component_against_inside_its_share_range_is_accepted(value):
    cfg = make_config(overrides=[f"health.component_against={value}"])
    assert cfg.health.component_against == value


# --- the tensor signals ---

def test_token_covariance_equals_a_loop_over_masked_tokens():
    gen = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(3, 7, generator=gen) * 3  # [3, 7]
    advantages = torch.randn(3, 7, generator=gen)  # [3, 7]
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 0, 1]])  # ragged, two turns
    picked = [(logprobs[i, t].item(), advantages[i, t].item()) for i in range(3) for t in range(7) if mask[i, t]]
    mean_lp = sum(lp for lp, _ in picked) / len(picked)
    mean_adv = sum(a for _, a in picked) / len(picked)
    want = sum((lp - mean_lp) * (a - mean_adv) for lp, a in picked) / len(picked)
    assert len(picked) == 11 and abs(want) > 1e-3
    assert token_covariance(logprobs, advantages, mask) == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert token_covariance(logprobs, advantages, mask.float()) == pytest.approx(want, rel=1e-5, abs=1e-7)
    # tokens outside the mask do not count
    noisy = torch.where(mask.bool(), logprobs, torch.full_like(logprobs, 1e6))
    assert token_covariance(noisy, advantages, mask) == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert token_covariance(logprobs, advantages, torch.zeros(3, 7)) == 0.0


@pytest.mark.parametrize("pad", [float("nan"), float("-inf"), float("inf")])
def test_token_covariance_ignores_non_finite_values_in_padded_positions(pad):
    logprobs = torch.tensor([[-0.1, -2.0, pad, pad], [-0.2, -3.0, -1.0, pad]])  # [2, 4]
    advantages = torch.tensor([[1.0, -1.0, pad, 0.0], [1.0, -1.0, 0.5, pad]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    picked = [(-0.1, 1.0), (-2.0, -1.0), (-0.2, 1.0), (-3.0, -1.0), (-1.0, 0.5)]
    mean_lp, mean_adv = sum(p[0] for p in picked) / 5, sum(p[1] for p in picked) / 5
    want = sum((lp - mean_lp) * (a - mean_adv) for lp, a in picked) / 5
    assert token_covariance(logprobs, advantages, mask) == pytest.approx(want, rel=1e-6)


def test_token_covariance_sign():
    logprobs = torch.tensor([[-0.1, -2.0, -0.2, -3.0]])
    mask = torch.ones(1, 4)
    # confident tokens with positive advantage: positive (the entropy falls); reversed: negative
    assert token_covariance(logprobs, torch.tensor([[1.0, -1.0, 1.0, -1.0]]), mask) > 0
    assert token_covariance(logprobs, torch.tensor([[-1.0, 1.0, -1.0, 1.0]]), mask) < 0


def test_reply_lengths_counts_each_turn_of_each_row():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1],  # two turns in a row: 2 and 3 tokens
                         [0, 0, 0, 0, 0, 0, 0, 0],  # no reply
                         [1, 1, 1, 1, 0, 0, 0, 1]])  # a turn at each edge
    assert reply_lengths(mask) == [2, 3, 4, 1]
    assert reply_lengths(torch.zeros(2, 5)) == []


def tokens(text: str) -> list[int]:
    return [ord(c) for c in text.split()]


def test_repetition_rate_judges_long_enough_replies():
    rows = [tokens("a b c d a b c d a b c d"),  # 9 4-grams, 4 distinct: 5/9 repeat -> repeats
            tokens("a b c d e f g h i j k l"),  # 9 distinct 4-grams -> does not
            tokens("a a a a a a a") + [0] * 5]  # 7 < 2 x 4 tokens: not judged, however repetitive
    ids = torch.tensor(rows)  # [3, 12]
    mask = torch.ones(3, 12)
    mask[2, 7:] = 0
    assert repetition_rate(ids, mask) == 0.5
    assert repetition_rate(ids[2:], mask[2:]) == 0.0  # nothing judged
    assert repetition_rate(ids[:1], mask[:1]) == 1.0


def test_repetition_rate_boundary_and_turns():
    # 11 tokens: 8 4-grams, 4 distinct -> exactly half repeat: "at least share" counts it
    row = tokens("a b c d a b c d a b c")
    assert repetition_rate(torch.tensor([row]), torch.ones(1, 11)) == 1.0
    assert repetition_rate(torch.tensor([row]), torch.ones(1, 11), share=0.51) == 0.0
    # each turn of a row is its own reply: two distinct 8-token turns around a 1-token gap repeat nothing within
    turns = tokens("a b c d e f g h x a b c d e f g h")
    mask = torch.ones(1, 17)
    mask[0, 8] = 0
    assert repetition_rate(torch.tensor([turns]), mask) == 0.0
    assert repetition_rate(torch.tensor([turns]), torch.ones(1, 17)) == 0.0  # 14 4-grams, 9 distinct: 5/14 < 1/2


def test_component_shares_by_hand():
    components = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]])  # [4, 2]
    # weighted (1, 0.5): w1 = [1, 0, 1, 0], w2 = [0, 0, 0.5, 0.5], R = [1, 0, 1.5, 0.5], mean 0.75
    # Var(R) = (0.25^2 + 0.75^2 + 0.75^2 + 0.25^2) / 4 = 0.3125
    # Cov(w1, R) = (0.5 x 0.25 + 0.5 x 0.75 + 0.5 x 0.75 + 0.5 x 0.25) / 4 = 0.25 -> 0.8
    # Cov(w2, R) = (-0.25 x 0.25 + 0.25 x 0.75 + 0.25 x 0.75 - 0.25 x 0.25) / 4 = 0.0625 -> 0.2
    shares = component_shares(components, (1.0, 0.5), ("success", "format"))
    assert shares == pytest.approx({"success": 0.8, "format": 0.2}, rel=1e-12)
    assert sum(shares.values()) == pytest.approx(1.0, rel=1e-12)


def test_component_shares_against_one_and_constant():
    r = torch.tensor([0.0, 1.0, 2.0, 3.0])
    # w2 = -0.5 w1: R = 0.5 w1 -> Cov(w1, R) / Var(R) = 0.5 / 0.25 = 2, Cov(w2, R) / Var(R) = -1
    shares = component_shares(torch.stack([r, r], dim=1), (1.0, -0.5), ("a", "b"))
    assert shares == pytest.approx({"a": 2.0, "b": -1.0}, rel=1e-12)
    assert component_shares(r[:, None], (1.0,), ("a",)) == {}
    assert component_shares(None, (), ()) == {}
    assert component_shares(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]), (1.0, 1.0), ("a", "b")) == {}


def test_k3_kl_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.3], [0.9, 0.1, 0.7]]))  # [2, 3]
    rollout = torch.log(torch.tensor([[0.25, 0.5, 0.9], [0.9, 0.8, 0.2]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    ratios = [2.0, 1.0, 1.0, 0.125, 3.5]  # pi_old / pi_rollout on the masked tokens
    want = sum(r - 1 - math.log(r) for r in ratios) / 5
    assert k3_kl(old, rollout, mask) == pytest.approx(want, rel=1e-5)
    assert k3_kl(old, old, mask) == 0.0
    assert k3_kl(old, rollout, torch.zeros(2, 3)) == 0.0


def test_update_kl_fires_above_its_limit_at_the_step_that_made_the_update():
    rule = UpdateKl(CFG)
    assert rule.check(Signals(step=1)) is None  # not measured
    assert rule.check(Signals(step=1, update_kl=0.1)) is None  # "above": not at the limit
    check_alarm(rule.check(Signals(step=2, update_kl=0.1 + 1e-9)), "update_kl", 0.1 + 1e-9, 0.1, 2)
    alarm = rule.check(Signals(step=3, update_kl=2.5))
    check_alarm(alarm, "update_kl", 2.5, 0.1, 3)
    assert "2.5" in alarm.message
    assert rule.check(Signals(step=4)) is None and rule.updates == 3  # a step without a measured update
    assert rule.due() and rule.check(Signals(step=5, update_kl=0.01)) is None  # the 4th
    assert rule.check(Signals(step=6, update_kl=2.5)) is not None and not rule.due()  # the 5th: the last judged
    assert rule.check(Signals(step=7, update_kl=2.5)) is None  # past update_kl_steps (5) updates: not judged
