"""Tests for rldynamics.analysis.bootstrap: resampling weights, Gram-matrix norms, intervals."""

from __future__ import annotations

import math

import pytest
import torch

from rldynamics.analysis import bootstrap
from rldynamics.analysis.gram import group_gram


def test_combined_norms_equal_the_norm_of_the_weighted_sum():
    gen = torch.Generator().manual_seed(0)
    vecs = torch.randn(2, 5, 40, generator=gen, dtype=torch.float64)  # [K, m, P]
    gram = torch.einsum("cjp,dkp->cdjk", vecs, vecs)  # [K, K, m, m]
    weights = torch.rand(7, 5, generator=gen, dtype=torch.float64)  # [R, m]
    coefs = torch.tensor([0.3, -2.0], dtype=torch.float64)
    got = bootstrap.combined_norms(weights, gram, coefs)  # [R]
    direct = torch.stack([(coefs[:, None] * (w[None, :, None] * vecs).sum(1)).sum(0).norm() for w in weights])
    torch.testing.assert_close(got, direct)


def test_resample_weights_by_hand():
    counts = torch.tensor([[2.0, 0.0, 1.0], [0.0, 0.0, 0.0]])  # [R, m]; the second resample drew nothing
    shares = torch.tensor([0.5, 0.25, 0.25])
    norm = bootstrap.resample_weights(shares, counts, normalised=True)
    torch.testing.assert_close(norm, torch.tensor([[0.8, 0.0, 0.2], [0.0, 0.0, 0.0]], dtype=torch.float64))
    raw = bootstrap.resample_weights(shares, counts, normalised=False)
    torch.testing.assert_close(raw, torch.tensor([[1.0, 0.0, 0.25], [0.0, 0.0, 0.0]], dtype=torch.float64))
    counts = bootstrap.resample_counts(4, 300, torch.Generator().manual_seed(1))
    assert counts.shape == (300, 4) and torch.all(counts.sum(1) == 4)


def test_normal_interval():
    samples = torch.tensor([1.0, 3.0, float("nan")])  # std of [1, 3] = sqrt(2)
    half = bootstrap.Z_95 * math.sqrt(2.0)
    assert bootstrap.normal_interval(2.0, samples) == pytest.approx((max(0.0, 2.0 - half), 2.0 + half))
    assert bootstrap.normal_interval(0.5, samples, high=1.0) == pytest.approx((0.0, 1.0))
    assert all(math.isnan(v) for v in bootstrap.normal_interval(math.nan, samples))


def synthetic_bucket(num_groups: int, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    """Groups whose task gradients share a direction plus noise, and unrelated entropy gradients."""
    gen = torch.Generator().manual_seed(seed)
    direction = torch.ones(64, dtype=torch.float64) / 8.0  # unit vector [P]
    pg = direction[None, :] + 0.5 * torch.randn(num_groups, 64, generator=gen, dtype=torch.float64)  # [m, P]
    entropy = torch.randn(num_groups, 64, generator=gen, dtype=torch.float64)  # [m, P]
    shares = torch.full((num_groups,), 1.0 / num_groups, dtype=torch.float64)  # [m]
    task = float((shares[:, None] * pg).sum(0).norm())
    raw_h = float((shares[:, None] * entropy).sum(0).norm())
    point = {"task": task, "entropy": 0.1 * raw_h, "raw/entropy": raw_h, "regularizer": 0.1 * raw_h}
    point["reg_share"] = point["regularizer"] / (task + point["regularizer"])
    return shares, {"pg": pg, "entropy": entropy}, point


def _gram(grads: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[str]]:
    """The per-group Gram matrix [K, K, m, m] of the terms' [m, P] gradients, and the term names."""
    return group_gram(list(grads.values())), list(grads)


@pytest.mark.parametrize("num_groups", [3, 12, 48])
def test_intervals_contain_the_point_estimate(num_groups):
    shares, grads, point = synthetic_bucket(num_groups, seed=num_groups)
    out = bootstrap.bucket_intervals(shares, *_gram(grads), {"pg": 1.0, "entropy": 0.1}, point, normalised=True,
                                     resamples=400, seed=0)
    for key, value in point.items():
        assert out[f"{key}/ci_low"] <= value <= out[f"{key}/ci_high"], key
        assert out[f"{key}/ci_low"] >= 0.0
    assert out["reg_share/ci_high"] <= 1.0


def test_intervals_shrink_with_more_groups():
    widths = []
    for num_groups in (4, 16, 64):
        shares, grads, point = synthetic_bucket(num_groups, seed=7)
        out = bootstrap.bucket_intervals(shares, *_gram(grads), {"pg": 1.0, "entropy": 0.1}, point, normalised=True,
                                         resamples=400, seed=0)
        widths.append(out["task/ci_high"] - out["task/ci_low"])
    assert widths[0] > 1.5 * widths[1] > 1.5 * 1.5 * widths[2]  # SE ~ 1/sqrt(m): about halves per 4x groups


def test_single_group_gives_no_interval():
    shares, grads, point = synthetic_bucket(1, seed=0)
    out = bootstrap.bucket_intervals(shares, *_gram(grads), {"pg": 1.0, "entropy": 0.1}, point, normalised=True,
                                     resamples=50, seed=0)
    assert math.isnan(out["task/ci_low"]) and math.isnan(out["task/ci_high"])
