"""Advantage estimators against hand-computed tensors and slow per-sequence / per-group loops."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rldynamics.algo.advantages import (
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    whiten,
)

# --- slow references -------------------------------------------------------------------------


def ref_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    picked = [float(x[i, t]) for i in range(x.shape[0]) for t in range(x.shape[1]) if mask[i, t]]
    n = len(picked)
    mean = sum(picked) / n
    var = sum((p - mean) ** 2 for p in picked) / (n - 1)
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for t in range(x.shape[1]):
            if mask[i, t]:
                out[i, t] = (float(x[i, t]) - mean) / math.sqrt(var + 1e-8)
    return out


def ref_gae(rewards, values, mask, gamma, lam):
    """Per sequence: compress to response positions, run the textbook recursion, scatter back."""
    adv = torch.zeros_like(values)
    for i in range(values.shape[0]):
        pos = [t for t in range(values.shape[1]) if mask[i, t]]
        next_adv = 0.0
        for k in reversed(range(len(pos))):
            t = pos[k]
            next_v = float(values[i, pos[k + 1]]) if k + 1 < len(pos) else 0.0
            delta = float(rewards[i, t]) + gamma * next_v - float(values[i, t])
            next_adv = delta + gamma * lam * next_adv
            adv[i, t] = next_adv
    returns = torch.where(mask.bool(), adv + values, torch.zeros_like(adv))
    return adv, returns


def ref_discounted(rewards, mask, gamma):
    out = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        running = 0.0
        for t in reversed(range(rewards.shape[1])):
            if mask[i, t]:
                running = float(rewards[i, t]) + gamma * running
                out[i, t] = running
    return out


def ref_group_adv(scores, group_ids, kind, eps=1e-6):
    out = []
    for i in range(len(scores)):
        members = [float(scores[j]) for j in range(len(scores)) if int(group_ids[j]) == int(group_ids[i])]
        n = len(members)
        s = float(scores[i])
        if kind == "rloo":
            out.append(0.0 if n == 1 else s - (sum(members) - s) / (n - 1))
            continue
        mean = sum(members) / n if n > 1 else 0.0
        std = math.sqrt(sum((m - mean) ** 2 for m in members) / (n - 1)) if n > 1 else 1.0
        out.append((s - mean) / (std + eps) if kind == "grpo" else s - mean)
    return torch.tensor(out, dtype=torch.float64)


def random_batch(seed: int, n: int = 4, t: int = 9):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(n, t, generator=gen, dtype=torch.float64)
    values = torch.randn(n, t, generator=gen, dtype=torch.float64)
    mask = torch.rand(n, t, generator=gen) < 0.6
    mask[0, 0] = True
    mask[0, 1] = True  # at least two tokens so the unbiased variance is defined
    return rewards, values, mask


# --- whiten ----------------------------------------------------------------------------------


def test_whiten_hand_case():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, -7.0, -7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    expected = torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]) / math.sqrt(1.0 + 1e-8)
    torch.testing.assert_close(whiten(x, mask), expected)


def test_whiten_keep_mean():
    x = torch.tensor([[1.0, 2.0, 3.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    out = whiten(x, mask, shift_mean=False)
    torch.testing.assert_close(out, torch.tensor([[1.0, 2.0, 3.0]]), atol=1e-6, rtol=0)
    wide = whiten(x * 10, mask, shift_mean=False)
    torch.testing.assert_close(wide, torch.tensor([[19.0, 20.0, 21.0]]), atol=1e-5, rtol=0)


def test_whiten_degenerate_masks():
    x = torch.tensor([[5.0, 6.0]])
    assert torch.equal(whiten(x, torch.tensor([[True, False]])), torch.zeros(1, 2))
    assert torch.equal(whiten(x, torch.zeros(1, 2, dtype=torch.bool)), torch.zeros(1, 2))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000))
def test_whiten_matches_reference(seed):
    x, _, mask = random_batch(seed)
    torch.testing.assert_close(whiten(x, mask), ref_whiten(x, mask))


# --- GAE -------------------------------------------------------------------------------------


def test_gae_gamma_one_is_return_minus_value_across_observation_gap():
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]], dtype=torch.float32)
    rewards = torch.tensor([[0.0, 0.0, 7.0, 7.0, 0.0, 1.0]])  # rewards on observation tokens are ignored
    values = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.3, 0.4]])
    adv, ret = gae_advantages(rewards, values, mask, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.9, 0.8, 0.0, 0.0, 0.7, 0.6]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]]))


def test_gae_hand_case_discounted():
    # response tokens at 0, 1, 3; gamma 0.5, lam 0.5
    mask = torch.tensor([[True, True, False, True]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.25, 3.0, 0.5]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.5, lam=0.5, whiten=False)
    a3 = 1.0 - 0.5  # delta at the last token
    a1 = (0.0 + 0.5 * 0.5 - 0.25) + 0.25 * a3  # V_next skips the observation at t=2
    a0 = (0.0 + 0.5 * 0.25 - 0.5) + 0.25 * a1
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, 0.0, a3]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, a1 + 0.25, 0.0, a3 + 0.5]]))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([1.0, 0.9]), st.sampled_from([1.0, 0.95, 0.0]))
def test_gae_matches_per_sequence_loop(seed, gamma, lam):
    rewards, values, mask = random_batch(seed)
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam, whiten=False)
    ref_adv, ref_ret = ref_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    white, ret_w = gae_advantages(rewards, values, mask.float(), gamma=gamma, lam=lam, whiten=True)
    torch.testing.assert_close(white, ref_whiten(ref_adv, mask))
    torch.testing.assert_close(ret_w, ref_ret)  # returns are taken before whitening


def test_gae_bad_arguments():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="shape"):
        gae_advantages(x, torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="gamma"):
        gae_advantages(x, x, torch.ones(2, 3), gamma=1.5)
    with pytest.raises(ValueError, match="lam"):
        gae_advantages(x, x, torch.ones(2, 3), lam=-0.1)


# --- REINFORCE++ -----------------------------------------------------------------------------


def test_reinforce_pp_hand_case():
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 0]], dtype=torch.float32)
    rewards = torch.tensor([[0.0, 0.0, 5.0, 1.0], [9.0, 0.0, 2.0, 0.0]])
    # row 0: G = [0.25, 0.5, -, 1] (the 5 sits on an observation token); row 1: G = [-, 1, 2, -]
    raw = torch.tensor([[0.25, 0.5, 0.0, 1.0], [0.0, 1.0, 2.0, 0.0]])
    out = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    torch.testing.assert_close(out, ref_whiten(raw, mask))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([1.0, 0.7]))
def test_reinforce_pp_matches_loop(seed, gamma):
    rewards, _, mask = random_batch(seed)
    out = reinforce_pp_advantages(rewards, mask, gamma=gamma)
    torch.testing.assert_close(out, ref_whiten(ref_discounted(rewards, mask, gamma), mask))


# --- GRPO / RLOO -----------------------------------------------------------------------------


def test_grpo_hand_case():
    scores = torch.tensor([1.0, 2.0, 3.0, 5.0, 4.0, 4.0])
    group_ids = torch.tensor([0, 0, 0, 7, 3, 3])  # group 7 is a singleton, group 3 has zero variance
    mask = torch.tensor([[1, 1, 0]] * 6, dtype=torch.float32)
    out = grpo_advantages(scores, group_ids, mask)
    per_seq = torch.tensor([-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6), 5 / (1 + 1e-6), 0.0, 0.0])
    torch.testing.assert_close(out, per_seq[:, None] * mask)
    dr = grpo_advantages(scores, group_ids, mask, norm_by_std=False)
    torch.testing.assert_close(dr, torch.tensor([-1.0, 0.0, 1.0, 5.0, 0.0, 0.0])[:, None] * mask)


def test_rloo_hand_case():
    scores = torch.tensor([1.0, 2.0, 3.0, 5.0])
    group_ids = torch.tensor([4, 4, 4, 9])
    mask = torch.tensor([[True, False], [True, True], [False, True], [True, True]])
    out = rloo_advantages(scores, group_ids, mask)
    torch.testing.assert_close(out, torch.tensor([[-1.5, 0.0], [0.0, 0.0], [0.0, 1.5], [0.0, 0.0]]))


@pytest.mark.parametrize("value", [-0.7, 0.1, 1 / 3])
def test_a_group_of_equal_rewards_gets_exactly_zero_advantage(value):
    """Summing 8 x -0.7 in float32 rounds; GRPO divided that rounding by std + eps and gave every row -0.056."""
    scores = torch.tensor([value] * 8 + [0.0, 1.0], dtype=torch.float32)
    group_ids = torch.tensor([2] * 8 + [5, 5])
    mask = torch.ones(10, 2)
    for fn in (grpo_advantages, rloo_advantages, lambda *a: grpo_advantages(*a, norm_by_std=False)):
        out = fn(scores, group_ids, mask)
        assert torch.equal(out[:8], torch.zeros(8, 2)) and out[8:].abs().min() > 0.4


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.floats(-5, 5)), min_size=1, max_size=12))
def test_group_estimators_match_loop(rows):
    group_ids = torch.tensor([g for g, _ in rows])
    scores = torch.tensor([s for _, s in rows], dtype=torch.float64)
    mask = torch.ones(len(rows), 3, dtype=torch.bool)
    mask[:, 2] = False
    for kind, fn in (("grpo", grpo_advantages), ("dr", lambda *a: grpo_advantages(*a, norm_by_std=False))):
        expected = ref_group_adv(scores, group_ids, kind)
        torch.testing.assert_close(fn(scores, group_ids, mask), expected[:, None] * mask)
    expected = ref_group_adv(scores, group_ids, "rloo")
    torch.testing.assert_close(rloo_advantages(scores, group_ids, mask), expected[:, None] * mask)


def test_group_estimators_bad_shapes():
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long), torch.ones(3, 2))
    with pytest.raises(ValueError, match="rows"):
        rloo_advantages(torch.zeros(3), torch.zeros(3, dtype=torch.long), torch.ones(2, 2))


def test_every_estimator_choice_has_its_functions_and_only_gae_a_critic():
    from rldynamics.config import CHOICES, AlgoConfig
    from rldynamics.train.batch_ops import ESTIMATORS

    assert set(ESTIMATORS) == set(CHOICES["algo.adv_estimator"])
    assert [name for name in ESTIMATORS if AlgoConfig(adv_estimator=name).has_critic] == ["gae"]
