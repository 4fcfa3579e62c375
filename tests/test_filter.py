"""Rollout filter: group statistics, RAGEN selection semantics (docs/reference/ragen_behaviour.md §2.4) and metrics."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rldynamics.algo.filter import filter_metrics, group_scores, group_stats, loss_scale, select_groups


def kept(scores, **kwargs) -> list[int]:
    out = select_groups(torch.tensor(scores, dtype=torch.float32), **kwargs)
    assert out.dtype == torch.long
    return out.tolist()


# --- statistics ------------------------------------------------------------------------------


def test_group_stats_hand_case():
    stats = group_stats(torch.tensor([[1.0, 2.0, 3.0], [4.0, 4.0, 4.0]]))
    torch.testing.assert_close(stats["std"], torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(stats["mean"], torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(stats["max"], torch.tensor([3.0, 4.0]))
    torch.testing.assert_close(stats["sum"], torch.tensor([6.0, 12.0]))
    single = group_stats(torch.tensor([[5.0], [-1.0]]))
    torch.testing.assert_close(single["std"], torch.tensor([0.0, 0.0]))
    with pytest.raises(ValueError, match=r"\[G, n\]"):
        group_stats(torch.zeros(4))


@pytest.mark.parametrize(
    ("metric", "expected"),
    [
        ("reward_std", [1.0, 0.0]),
        ("reward_variance", [1.0, 0.0]),
        ("Reward_Variance", [1.0, 0.0]),
        ("reward", [2.0, 4.0]),
        ("reward_mean", [2.0, 4.0]),
        ("reward_sum", [6.0, 12.0]),
        ("reward_max", [3.0, 4.0]),
    ],
)
def test_group_scores(metric, expected):
    scores = group_scores(torch.tensor([[1.0, 2.0, 3.0], [4.0, 4.0, 4.0]]), metric)
    torch.testing.assert_close(scores, torch.tensor(expected))


def test_group_scores_unknown_metric():
    with pytest.raises(ValueError, match="reward_variance"):
        group_scores(torch.zeros(2, 2), "entropy")


# --- top_p -----------------------------------------------------------------------------------


def test_top_p_linear_reference_examples():
    assert kept([4.0, 3.0, 2.0, 1.0], strategy="top_p", value=0.6) == [0, 1]  # threshold 5.99
    assert kept([3.0, 1.0, 1.0, 0.0], strategy="top_p", value=0.9, include_zero=False) == [0, 1, 2]


def test_top_p_linear_order_and_zero_scores():
    assert kept([1.0, 4.0, 2.0, 3.0], strategy="top_p", value=0.6) == [1, 3]
    assert kept([3.0, 0.0, 2.0], strategy="top_p", value=0.99) == [0, 2]  # zero-score groups never chosen
    assert kept([0.0, 0.0, 0.0], strategy="top_p", value=0.5) == []  # all zero -> empty
    assert kept([1.0, 2.0, 3.0], strategy="top_p", value=0.5, keep="smallest") == [0, 1]  # threshold 2.99
    # smallest: a non-positive score at the front stops the walk before the threshold -> empty (quirk)
    assert kept([0.0, 1.0, 2.0], strategy="top_p", value=0.5, keep="smallest") == []
    assert kept([-1.0, 2.0, 3.0], strategy="top_p", value=0.5, keep="smallest") == []
    assert kept([2.0, 1.0, 1.0], strategy="top_p", value=0.0) == []  # threshold -eps is met at once
    assert kept([1.0, 1.0, 1.0, 1.0], strategy="top_p", value=0.5, eps=0.0) == [0, 1]  # ties: lower index


def test_top_p_no_op_when_value_at_least_one():
    scores = [0.0, 2.0, 0.0, 1.0]
    for mode in ("linear", "softmax"):
        assert kept(scores, strategy="top_p", value=1.0, prob_mode=mode) == [0, 1, 2, 3]
        assert kept(scores, strategy="top_p", value=3.0, prob_mode=mode, keep="smallest") == [0, 1, 2, 3]
        assert kept(scores, strategy="top_p", value=1.0, prob_mode=mode, include_zero=False) == [1, 3]


def test_top_p_softmax():
    assert kept([1.0, 1.0, 1.0, 1.0], strategy="top_p", value=0.5, prob_mode="softmax") == [0, 1]
    assert kept([1.0, 1.0, 1.0, 1.0], strategy="top_p", value=0.51, prob_mode="softmax") == [0, 1, 2]
    assert kept([0.0, 0.0, 0.0], strategy="top_p", value=0.3, prob_mode="softmax") == [0]  # always >= 1 group
    assert kept([0.0, 5.0, 0.0, 0.0], strategy="top_p", value=0.9, prob_mode="softmax") == [1]
    # ties behind the leader: [2, 1, 1, 1]: p = [e, 1, 1, 1] / (e + 3)
    p0 = math.e / (math.e + 3)
    assert kept([1.0, 2.0, 1.0, 1.0], strategy="top_p", value=p0 + 0.01, prob_mode="softmax") == [0, 1]
    all_zero = kept([0.0, 0.0], strategy="top_p", value=0.5, prob_mode="softmax", include_zero=False)
    assert all_zero == []


def test_top_p_softmax_smallest_exact():
    # logits = -score = [-3, 0, -2, 0] -> p ≈ [0.0228, 0.4576, 0.0619, 0.4576]; ranking 1, 3 (tie: lower
    # index first), 2, 0; cumulative mass ≈ 0.4576, 0.9153, 0.9772, 1
    scores = [3.0, 0.0, 2.0, 0.0]
    args = {"strategy": "top_p", "prob_mode": "softmax", "keep": "smallest"}
    assert kept(scores, value=0.4, **args) == [1]
    assert kept(scores, value=0.9, **args) == [1, 3]
    assert kept(scores, value=0.95, **args) == [1, 2, 3]


def test_top_p_exact_mass_boundaries_use_ragens_float32_arithmetic():
    # softmax: 10 equal scores give p = float32(0.1) each; the float32 mass of 9 groups is 0.90000004 >= 0.9
    # (RAGEN keeps 9), whereas float64 arithmetic (0.8999999999999999) would need all 10
    mass32 = np.cumsum(np.full(10, np.float32(0.1)), dtype=np.float32)
    assert mass32[8] >= np.float32(0.9) and sum([0.1] * 9) < 0.9
    assert len(kept([1.0] * 10, strategy="top_p", value=0.9, prob_mode="softmax")) == 9
    assert len(kept([1.0] * 10, strategy="top_p", value=0.9, prob_mode="softmax", keep="smallest")) == 9
    # linear: threshold 0.7 * (3 x 0.1f) - 0.01 is float32(0.2), which the running sum of two groups reaches in
    # float32; in float64 (0.2000000031 vs 0.2000000030) a third group would be added
    f32 = [float(np.float32(0.1))] * 3
    assert f32[0] + f32[1] < 0.7 * sum(f32) - 0.01
    assert kept([0.1] * 3, strategy="top_p", value=0.7) == [0, 1]


# --- top_k / top_k_abs / min_p ---------------------------------------------------------------


def test_top_k_sizes():
    scores = [float(s) for s in (5, 1, 9, 3, 7, 0, 2, 8, 4, 6)]
    assert kept(scores, strategy="top_k", value=0.25) == [2, 7]  # int(2.5) = 2
    assert kept(scores, strategy="top_k", value=0.01) == [2]  # int(0.1) = 0 -> at least 1
    assert kept(scores, strategy="top_k", value=0.3, keep="smallest") == [1, 5, 6]
    assert len(kept(scores, strategy="top_k", value=5.0)) == 10  # clamped to #candidates
    # k uses the total group count (4 * 0.75 = 3), then clamps to the single non-zero candidate
    assert kept([5.0, 0.0, 0.0, 0.0], strategy="top_k", value=0.75, include_zero=False) == [0]
    assert kept([1.0, 1.0, 1.0, 1.0], strategy="top_k", value=0.5) == [0, 1]  # ties: lower index first
    assert kept([1.0, 1.0, 1.0, 1.0], strategy="top_k", value=0.5, keep="smallest") == [0, 1]


def test_top_k_abs_sizes():
    scores = [3.0, 1.0, 2.0, 0.0]
    assert kept(scores, strategy="top_k_abs", value=2.9) == [0, 2]
    assert kept(scores, strategy="top_k_abs", value=0) == [0]
    assert kept(scores, strategy="top_k_abs", value=100) == [0, 1, 2, 3]
    assert kept(scores, strategy="top_k_abs", value=2, keep="smallest", include_zero=False) == [1, 2]


def test_min_p():
    assert kept([4.0, 2.0, 1.0, 0.0], strategy="min_p", value=0.5) == [0, 1]  # score >= 2
    assert kept([4.0, 2.0, 1.0, 3.0], strategy="min_p", value=0.5, keep="smallest") == [1, 2]  # score <= 2
    assert kept([4.0, 2.0, 1.0, 0.0], strategy="min_p", value=0.0) == [0, 1, 2, 3]
    assert kept([0.0, 0.0], strategy="min_p", value=0.5, include_zero=False) == []


def test_min_p_float64_scores_keep_what_ragens_float32_arithmetic_keeps():
    # smallest at value 1: RAGEN keeps score <= min / (1 + 1e-10) + 1e-10, which is min itself in float32; float64
    # arithmetic (2.54375 / 1.0000000001 + 1e-10 < 2.54375) would keep nothing
    scores = torch.tensor([3.1125, 2.54375], dtype=torch.float64)
    assert select_groups(scores, strategy="min_p", value=1.0, keep="smallest").tolist() == [1]


_VALUE = st.one_of(st.just(1.0), st.floats(0, 1))  # value 1 (keep only the best) is where min_p's rounding decides


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0, 6, allow_subnormal=False), min_size=1, max_size=16),
    st.sampled_from(["top_p", "top_k", "top_k_abs", "min_p"]),
    _VALUE,
    st.sampled_from(["largest", "smallest"]),
    st.sampled_from(["linear", "softmax"]),
    st.booleans(),
)
def test_selection_does_not_depend_on_the_score_dtype(scores, strategy, value, keep, prob_mode, include_zero):
    """float64 scores select what their float32 values select (RAGEN's scores are float32)."""
    args = dict(strategy=strategy, value=value, keep=keep, prob_mode=prob_mode, include_zero=include_zero)
    assert select_groups(torch.tensor(scores, dtype=torch.float64), **args).tolist() == kept(scores, **args)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 6, allow_subnormal=False), min_size=1, max_size=16), _VALUE,
       st.sampled_from(["largest", "smallest"]), st.sampled_from([torch.float32, torch.float64]))
def test_min_p_keeps_the_best_group_of_non_negative_scores(scores, value, keep, dtype):
    """min_p at a value <= 1 keeps the best group (the largest, or the smallest) of non-negative scores."""
    out = select_groups(torch.tensor(scores, dtype=dtype), strategy="min_p", value=value, keep=keep).tolist()
    best = (max if keep == "largest" else min)(np.float32(s) for s in scores)
    assert any(np.float32(scores[g]) == best for g in out)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"strategy": "top_q", "value": 0.5}, "strategy"),
        ({"strategy": "top_p", "value": 0.5, "keep": "middle"}, "keep"),
        ({"strategy": "top_p", "value": 0.5, "prob_mode": "uniform"}, "prob_mode"),
        ({"strategy": "top_k", "value": -0.1}, "value"),
    ],
)
def test_select_groups_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        select_groups(torch.ones(3), **kwargs)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0, 6, allow_subnormal=False), min_size=1, max_size=16),
    st.sampled_from(["top_p", "top_k", "top_k_abs", "min_p"]),
    st.floats(0, 1.5),
    st.sampled_from(["largest", "smallest"]),
    st.sampled_from(["linear", "softmax"]),
    st.booleans(),
)
def test_selection_properties(scores, strategy, value, keep, prob_mode, include_zero):
    if strategy == "top_k_abs":
        value *= 10
    scores = torch.tensor(scores, dtype=torch.float32).tolist()  # compare in the float32 the filter works in
    args = dict(strategy=strategy, value=value, keep=keep, prob_mode=prob_mode, include_zero=include_zero)
    out = kept(scores, **args)
    assert out == sorted(set(out)) and all(0 <= g < len(scores) for g in out)
    assert out == kept(scores, **args)  # deterministic
    if not include_zero:
        assert all(abs(scores[g]) > 1e-10 for g in out)
    # zero test in float32, as the filter (and RAGEN) does it: a score of 1e-10 is float32(1e-10), not above it
    candidates = [g for g in range(len(scores)) if include_zero or abs(np.float32(scores[g])) > np.float32(1e-10)]
    if strategy in ("top_k", "top_k_abs") and candidates:
        k = int(value * len(scores)) if strategy == "top_k" else int(value)
        assert len(out) == max(1, min(k, len(candidates)))
    if strategy != "min_p" and out:  # prefix strategies keep the best-ranked candidates
        worst_kept = min(scores[g] for g in out) if keep == "largest" else -max(scores[g] for g in out)
        dropped = [scores[g] if keep == "largest" else -scores[g] for g in candidates if g not in out]
        assert all(d <= worst_kept for d in dropped)


# --- metrics and loss scale ------------------------------------------------------------------


def test_filter_metrics_hand_case():
    values = torch.tensor([[0.0, 2.0], [1.0, 1.0], [0.0, 4.0]])
    scores = group_stats(values)["std"]  # [√2, 0, 2√2]
    m = filter_metrics(values, torch.tensor([0, 2]), scores)
    r2 = math.sqrt(2)
    assert m["rollout/in_group_reward_std"] == pytest.approx(r2)
    assert m["rollout/in_group_reward_mean"] == pytest.approx(4 / 3)
    assert m["rollout/in_group_reward_max"] == pytest.approx(7 / 3)
    assert m["rollout/in_group_reward_sum"] == pytest.approx(8 / 3)
    assert m["rollout/chosen_in_group_reward_std"] == pytest.approx(1.5 * r2)
    assert m["rollout/chosen_in_group_reward_mean"] == pytest.approx(1.5)
    assert m["rollout/chosen_in_group_reward_max"] == pytest.approx(3.0)
    assert m["rollout/chosen_in_group_reward_sum"] == pytest.approx(3.0)
    for name in ("std", "max", "mean"):
        assert m[f"rollout/in_group_{name}"] == m[f"rollout/in_group_reward_{name}"]
        assert m[f"rollout/chosen_in_group_{name}"] == m[f"rollout/chosen_in_group_reward_{name}"]
    assert m["rollout/filter_kept_count"] == 2
    assert m["rollout/filter_kept_ratio"] == pytest.approx(2 / 3)
    assert m["rollout/filter_zero_count"] == 1
    assert all(isinstance(v, float) for v in m.values())
    empty = filter_metrics(values, torch.tensor([], dtype=torch.long), scores)
    assert empty["rollout/chosen_in_group_reward_std"] == 0.0 and empty["rollout/filter_kept_ratio"] == 0.0
    with pytest.raises(ValueError, match="scores"):
        filter_metrics(values, torch.tensor([0]), torch.zeros(2))


def test_loss_scale():
    assert loss_scale(0.25, "none") == 1.0
    assert loss_scale(0.25, "linear") == 0.25
    assert loss_scale(0.25, "sqrt") == 0.5
    with pytest.raises(ValueError, match="sqrt"):
        loss_scale(0.5, "log")
    with pytest.raises(ValueError, match="kept_ratio"):
        loss_scale(1.5, "linear")
