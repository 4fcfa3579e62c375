"""Reward-variance bucketing (docs/reference/ragen_behaviour.md §3.4)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rldynamics.analysis.buckets import ZERO_RV_TOL, assign_buckets
from rldynamics.metric_names import bucket_label, bucket_name, fixed_rv_interval


def buckets(scores, **kwargs) -> list[list[int]]:
    return assign_buckets(torch.tensor(scores, dtype=torch.float32), **kwargs)


def test_quantile_remainder_goes_to_highest_bucket():
    scores = [0.8, 0.1, 0.5, 0.3, 0.9, 0.2, 0.7, 0.4]  # ascending order: 1, 5, 3, 7, 2, 6, 0, 4
    assert buckets(scores, num_buckets=3) == [[1, 5], [3, 7], [0, 2, 4, 6]]  # 8 // 3 = 2, remainder 2
    assert buckets(scores, num_buckets=1) == [list(range(8))]
    assert buckets(scores, num_buckets=8) == [[1], [5], [3], [7], [2], [6], [0], [4]]


def test_quantile_fewer_groups_than_buckets():
    assert buckets([2.0, 0.0, 1.0]) == [[1], [2], [0]]  # B = min(6, 3)


def test_quantile_ties_break_by_lower_index():
    assert buckets([0.0] * 5, num_buckets=2) == [[0, 1], [2, 3, 4]]
    assert buckets([1.0, 0.0, 1.0, 0.0], num_buckets=2) == [[1, 3], [0, 2]]
    assert buckets([1.0, 1.0, 1.0, 0.0], num_buckets=3) == [[3], [0], [1, 2]]


def test_fixed_rv_edges():
    scores = [0.0, 0.999, 1.0, 2.5, 4.99, 5.0, 7.3]
    # [0,1) -> {0, 1}; [1,2) -> {2}; [2,3) -> {3}; [3,4) empty but kept in place; [4,5) -> {4}; [5, inf) -> {5, 6}
    assert buckets(scores, mode="fixed_rv") == [[0, 1], [2], [3], [], [4], [5, 6]]
    assert buckets([7.3, 1.0], mode="fixed_rv", num_buckets=2) == [[], [1], [], [], [], [0]]  # num_buckets ignored


def test_fixed_rv_positions_name_intervals_when_lower_ones_are_empty():
    out = buckets([2.5, 2.0, 5.1], mode="fixed_rv")
    assert out == [[], [], [0, 1], [], [], [2]]  # position 2 (bucket_3) is [2, 3) although [0,1), [1,2) are empty
    assert [bucket_name(k) for k, b in enumerate(out) if b] == ["bucket_3", "bucket_6"]
    assert fixed_rv_interval("bucket_3") == (2.0, 3.0) and fixed_rv_interval("bucket_6") == (5.0, math.inf)
    assert fixed_rv_interval("bucket_7") is None and fixed_rv_interval("all") is None
    assert bucket_label("bucket_3", "fixed_rv") == "[2, 3)" and bucket_label("bucket_6", "fixed_rv") == "[5, ∞)"
    assert bucket_label("bucket_3", "quantile") == "Q3" and bucket_label("all", "fixed_rv") == "all"


def test_zero_bucket_holds_the_zero_variance_groups_first():
    scores = [0.0, 0.5, 0.0, 1e-7, 0.3, 0.7]
    # zero: 0, 2, 3 (1e-7 is within the float tolerance); the rest ascending 4 (0.3), 1 (0.5), 5 (0.7)
    assert buckets(scores, num_buckets=2, zero_bucket=True) == [[0, 2, 3], [4], [1, 5]]
    assert buckets(scores, num_buckets=2) == [[0, 2, 3], [1, 4, 5]]  # RAGEN's plain quantiles: 6 // 2 = 3 each
    assert buckets([0.4, 0.2], zero_bucket=True) == [[], [1], [0]]  # no zero groups: an empty bucket_0
    assert buckets([0.0, 0.0], zero_bucket=True) == [[0, 1]]  # nothing above zero
    assert buckets([0.0, 0.5, 1.5, 0.9], mode="fixed_rv", zero_bucket=True) == [[0], [1, 3], [2], [], [], [], []]
    assert [bucket_name(k, zero_bucket=True) for k in range(3)] == ["bucket_0", "bucket_1", "bucket_2"]
    assert bucket_label("bucket_0") == "RV=0" and bucket_label("bucket_0", "fixed_rv") == "RV=0"
    assert bucket_label("bucket_1", "fixed_rv", zero_bucket=True) == "(0, 1)"
    assert bucket_label("bucket_1", "fixed_rv") == "[0, 1)" and bucket_label("bucket_1", zero_bucket=True) == "Q1"


def test_zero_tolerance_boundary():
    scores = torch.tensor([ZERO_RV_TOL, 2 * ZERO_RV_TOL, 0.0], dtype=torch.float64)
    assert assign_buckets(scores, num_buckets=1, zero_bucket=True) == [[0, 2], [1]]


def test_tied_scores_share_a_quantile_bucket():
    # 6 non-zero groups, 3 buckets of 2: the cut at 2 splits the run of 0.5s [0, 3) and moves to its nearer end (3);
    # the cut at 4 lies in the middle of the run of 1.0s [3, 5) and moves to its upper end (5): ties join the lower
    assert buckets([0.5, 1.0, 0.5, 2.0, 1.0, 0.5], num_buckets=3, zero_bucket=True) == [[], [0, 2, 5], [1, 4], [3]]
    # the cut at 4 is nearer the lower end of the run of 0.3s [2, 8): it moves down
    scores = [0.3, 0.1, 0.3, 0.3, 0.2, 0.3, 0.3, 0.3]
    assert buckets(scores, num_buckets=2, zero_bucket=True) == [[], [1, 4], [0, 2, 3, 5, 6, 7]]
    assert buckets([0.5] * 6, num_buckets=3, zero_bucket=True) == [[], list(range(6))]  # cuts merge: one bucket
    # without the zero bucket, RAGEN's split cuts through ties (by group index)
    assert buckets([0.5, 1.0, 0.5, 2.0, 1.0, 0.5], num_buckets=3) == [[0, 2], [1, 5], [3, 4]]


def test_bad_arguments():
    with pytest.raises(ValueError, match="quantile"):
        buckets([1.0], mode="equal")
    with pytest.raises(ValueError, match="num_buckets"):
        buckets([1.0], num_buckets=0)
    with pytest.raises(ValueError, match="non-negative"):
        buckets([1.0, -0.5], mode="fixed_rv")
    with pytest.raises(ValueError, match=r"\[G\]"):
        assign_buckets(torch.zeros(2, 2))
    assert assign_buckets(torch.zeros(0)) == []


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 3.2, 4.0, 5.0, 6.5]) | st.floats(0, 8), max_size=30),
    st.sampled_from(["quantile", "fixed_rv"]),
    st.integers(1, 10),
)
def test_buckets_partition_and_order(scores, mode, num_buckets):
    out = buckets(scores, mode=mode, num_buckets=num_buckets)
    flat = [g for bucket in out for g in bucket]
    assert sorted(flat) == list(range(len(scores)))  # a partition of the groups
    assert all((bucket or mode == "fixed_rv") and bucket == sorted(bucket) for bucket in out)
    scored = [[torch.tensor(scores[g], dtype=torch.float32).item() for g in bucket] for bucket in out if bucket]
    assert all(max(lo) <= min(hi) for lo, hi in zip(scored, scored[1:], strict=False))  # lowest scores first
    if mode == "fixed_rv" and scores:
        assert len(out) == 6
        for k, bucket in enumerate(out):
            low, high = fixed_rv_interval(bucket_name(k))
            assert all(low <= torch.tensor(scores[g], dtype=torch.float32).item() < high for g in bucket)
    if mode == "quantile" and scores:
        num_b = min(num_buckets, len(scores))
        size = len(scores) // num_b
        assert [len(b) for b in out] == [size] * (num_b - 1) + [size + len(scores) % num_b]


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.sampled_from([0.0, 0.0, 1e-7, 0.5, 1.0, 1.5, 2.0, 3.2]) | st.floats(0, 8), max_size=30),
    st.sampled_from(["quantile", "fixed_rv"]),
    st.integers(1, 10),
)
def test_zero_bucket_partition_ties_and_order(scores, mode, num_buckets):
    t = torch.tensor(scores, dtype=torch.float64)
    out = assign_buckets(t, mode=mode, num_buckets=num_buckets, zero_bucket=True)
    if not scores:
        assert out == []
        return
    assert sorted(g for bucket in out for g in bucket) == list(range(len(scores)))
    assert out[0] == [g for g, s in enumerate(scores) if s <= ZERO_RV_TOL]
    where = {g: k for k, bucket in enumerate(out) for g in bucket}
    for i, a in enumerate(scores):
        for j, b in enumerate(scores):
            if a == b:
                assert where[i] == where[j]  # equal scores are never split
    scored = [[scores[g] for g in bucket] for bucket in out if bucket]
    assert all(max(lo) <= min(hi) for lo, hi in zip(scored, scored[1:], strict=False))
    if mode == "quantile":
        assert all(out[1:]) and len(out) - 1 <= num_buckets
