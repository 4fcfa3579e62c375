"""Losses, aggregation and KL / entropy helpers pinned to hand-computed values."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rldynamics.algo.logprobs import selected_logprobs
from rldynamics.algo.losses import (
    AGG_MODES,
    POLICY_LOSSES,
    PolicyLossSettings,
    aggregate,
    aggregation_weights,
    entropy_from_logprobs,
    kl_penalty,
    loss_terms,
    masked_mean,
    policy_loss,
    value_loss,
)

INF = float("inf")

# --- masked_mean / aggregate -----------------------------------------------------------------


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, INF], [4.0, float("nan"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 1]], dtype=torch.float32)
    torch.testing.assert_close(masked_mean(x, mask), torch.tensor(3.0))
    torch.testing.assert_close(masked_mean(x, mask.bool(), dim=1), torch.tensor([1.5, 6.0]))
    assert float(masked_mean(x, torch.zeros(2, 3))) == 0.0


# rows: 2 tokens, none (all masked), 3 tokens; masked-out slots hold inf / nan and must not leak
AGG_VALUES = torch.tensor([[1.0, 2.0, INF], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
AGG_VALUES[1, 0] = float("nan")
AGG_MASK = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.float32)
AGG_EXPECTED = {
    "token-mean": 27 / 5,
    "seq-mean-token-mean": (1.5 + 8.0) / 2,
    "seq-mean-token-sum": (3.0 + 24.0) / 2,
    "seq-mean-token-sum-norm": 27 / 3,
}


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_by_hand(mode):
    assert set(AGG_EXPECTED) == set(AGG_MODES)
    out = aggregate(AGG_VALUES, AGG_MASK, mode)
    assert out.shape == ()
    assert out.item() == pytest.approx(AGG_EXPECTED[mode], rel=1e-6)
    assert aggregate(AGG_VALUES, AGG_MASK.bool(), mode).item() == pytest.approx(AGG_EXPECTED[mode], rel=1e-6)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_all_masked_is_zero(mode):
    assert aggregate(torch.ones(2, 3), torch.zeros(2, 3), mode).item() == 0.0


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(AGG_MODES))
def test_aggregation_weights_identity(seed, mode):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    mask = torch.rand(5, 7, generator=gen) < 0.5
    weights = aggregation_weights(mask, mode)
    assert weights.shape == mask.shape
    assert torch.all(weights[~mask] == 0)
    torch.testing.assert_close(aggregate(values, mask, mode), (values * weights.double()).sum())
    # linearity: splitting the tokens into two disjoint parts adds up
    part = torch.rand(5, 7, generator=gen) < 0.5
    split = (values * part * weights).sum() + (values * ~part * weights).sum()
    torch.testing.assert_close(split, aggregate(values, mask, mode))


def test_aggregate_low_precision_input_reduces_in_float32():
    values = torch.full((1, 3000), 1.0, dtype=torch.bfloat16)
    out = aggregate(values, torch.ones(1, 3000), "token-mean")
    assert out.dtype == torch.float32
    assert out.item() == pytest.approx(1.0, rel=1e-6)


def test_aggregate_bad_arguments():
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(torch.ones(2, 2), torch.ones(2, 2), "sum")
    with pytest.raises(ValueError, match="shape"):
        aggregate(torch.ones(2, 2), torch.ones(2, 3), "token-mean")


def test_seq_mean_token_sum_norm_is_batch_size_times_trls_dr_grpo():
    """docs/differences-from-ragen.md: Σ(l·m) / T here, Σ(l·m) / (B·T) in TRL's `dr_grpo` (B sequences, T tokens)."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(5, 7, generator=gen)
    mask = torch.rand(5, 7, generator=gen) < 0.6
    trl_dr_grpo = (values * mask).sum() / (values.shape[0] * values.shape[1])
    torch.testing.assert_close(aggregate(values, mask, "seq-mean-token-sum-norm"), 5 * trl_dr_grpo)


# --- PPO -------------------------------------------------------------------------------------

PPO_ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0, 50.0]])
PPO_RATIO = torch.tensor([[1.5, 0.5, 0.5, 1.1, 5.0, 9.0]])
PPO_MASK = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.float32)


def ppo_case(**settings):
    logp = PPO_RATIO.log().clone().requires_grad_(True)
    loss, metrics = policy_loss(logp, torch.zeros_like(logp), PPO_ADV, PPO_MASK, PolicyLossSettings(**settings))
    loss.backward()
    return loss, metrics, logp.grad


def test_ppo_dual_clip_hand_case():
    # per token: clipped high (-1.28), unclipped (-0.5), clipped low (0.8), unclipped (1.1), dual-clipped (3.0)
    loss, metrics, grad = ppo_case()
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 1.1 + 3.0) / 5, rel=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1 / 5)
    log_r = [math.log(r) for r in (1.5, 0.5, 0.5, 1.1, 5.0)]
    assert metrics["ppo_kl"] == pytest.approx(-sum(log_r) / 5, rel=1e-6)
    assert all(isinstance(v, float) for v in metrics.values())
    # d(-A·r)/dlogp = -A·r on unclipped tokens only; clipped and dual-clipped tokens have no gradient
    expected = torch.tensor([[0.0, -0.5, 0.0, 1.1, 0.0, 0.0]]) / 5
    torch.testing.assert_close(grad, expected)


def test_ppo_without_dual_clip():
    loss, metrics, _ = ppo_case(clip_c=None)
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 1.1 + 5.0) / 5, rel=1e-6)
    assert metrics["pg_clipfrac_lower"] == 0.0


def test_ppo_symmetric_clip_and_agg():
    loss, _, _ = ppo_case(clip_high=0.2, agg="seq-mean-token-sum")
    assert loss.item() == pytest.approx(-1.2 - 0.5 + 0.8 + 1.1 + 3.0, rel=1e-6)


def test_policy_loss_bad_arguments():
    with pytest.raises(ValueError, match="clip_c"):
        PolicyLossSettings(clip_c=1.0)
    with pytest.raises(ValueError, match="ppo"):
        PolicyLossSettings(kind="gspo")
    with pytest.raises(ValueError, match="clip_low"):
        PolicyLossSettings(clip_low=1.0)
    with pytest.raises(ValueError, match="cispo_clip_low"):
        PolicyLossSettings(kind="cispo", cispo_clip_low=1.5)
    x = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="shape"):
        policy_loss(x, x, torch.zeros(1, 2), x, PolicyLossSettings())


def test_every_policy_loss_choice_has_its_function():
    from rldynamics.config import CHOICES

    assert set(POLICY_LOSSES) == set(CHOICES["algo.policy_loss"])


def test_settings_from_the_config_are_its_values():
    from rldynamics.analysis.objective import policy_loss_settings
    from rldynamics.config import AlgoConfig

    assert policy_loss_settings(AlgoConfig()) == PolicyLossSettings()  # the defaults are the config's
    cfg = AlgoConfig(policy_loss="cispo", clip_high=0.3, cispo_clip_low=0.1, loss_agg_mode="seq-mean-token-sum",
                     kl_type="k2", kl_coef=0.2, entropy_coef=0.0, tis_cap=2.0, mismatch_band=1.5)
    settings = policy_loss_settings(cfg)
    assert (settings.kind, settings.clip_high, settings.cispo_clip_low, settings.agg, settings.kl_type) == (
        "cispo", 0.3, 0.1, "seq-mean-token-sum", "k2")
    assert settings.coefs == {"pg": 1.0, "entropy": -0.0, "kl": 0.2}
    assert (settings.tis_cap, settings.mis_band) == (2.0, None)  # MIS off: no band
    assert policy_loss_settings(AlgoConfig(mis=True, mismatch_band=1.5)).mis_band == 1.5


# --- CISPO -----------------------------------------------------------------------------------


def test_cispo_is_the_published_formula_hand_case():
    """MiniMax-M1's CISPO (and TRL's): loss = -sg(min(r, 1 + clip_high))·A·logπ, the IS weight bounded only from
    above (clip_low is PPO's and does not apply)."""
    ratio = torch.tensor([[0.5, 1.0, 1.5, 0.1]])
    adv = torch.tensor([[1.0, -2.0, 2.0, 3.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    logp = (old + ratio.log()).requires_grad_(True)
    settings = PolicyLossSettings(kind="cispo", clip_low=0.2, clip_high=0.28)
    loss, metrics = policy_loss(logp, old, adv, torch.ones(1, 4), settings)
    loss.backward()
    # IS weights 0.5, 1.0, 1.28 (capped), 0.1; d loss / d logπ = -w·A / 4 tokens
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.125, 0.5, -0.64, -0.075]]))
    logp_values = [-1.0 + math.log(0.5), -2.0, -0.5 + math.log(1.5), -3.0 + math.log(0.1)]
    weights, advs = (0.5, 1.0, 1.28, 0.1), (1.0, -2.0, 2.0, 3.0)
    expected = sum(-w * a * lp for w, a, lp in zip(weights, advs, logp_values, strict=True)) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(1 / 4)
    # the lower bound is an option: weights 0.8, 1.0, 1.28, 0.8
    logp.grad = None
    loss, metrics = policy_loss(logp, old, adv, torch.ones(1, 4),
                                PolicyLossSettings(kind="cispo", clip_high=0.28, cispo_clip_low=0.2))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.2, 0.5, -0.64, -0.6]]))
    assert metrics["pg_clipfrac"] == pytest.approx(3 / 4)


def test_cispo_value_and_stop_gradient():
    ratio = torch.tensor([[1.5, 0.5, 1.1, 2.0], [0.9, 1.0, 0.1, 3.0]])
    adv = torch.tensor([[1.0, -2.0, 0.5, 3.0], [-1.0, 2.0, 1.0, -4.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]], dtype=torch.float32)
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.2, -1.0, -4.0, -2.0]])
    logp = (old + ratio.log()).requires_grad_(True)
    loss, metrics = policy_loss(logp, old, adv, mask,
                                PolicyLossSettings(kind="cispo", agg="seq-mean-token-mean", cispo_clip_low=0.2))
    loss.backward()
    clipped = ratio.clamp(0.8, 1.28)
    weights = aggregation_weights(mask, "seq-mean-token-mean")
    torch.testing.assert_close(loss, (-clipped * adv * logp.detach() * weights).sum())
    torch.testing.assert_close(logp.grad, -clipped * adv * weights)  # no gradient through the ratio
    # masked tokens: 1.5, 0.5, 1.1 | 0.9, 0.1, 3.0 -> clipped: 1.5, 0.5, 0.1, 3.0
    assert metrics["pg_clipfrac"] == pytest.approx(4 / 6)
    assert metrics["pg_clipfrac_lower"] == 0.0


# --- KL --------------------------------------------------------------------------------------

LOGP = torch.tensor([[-1.0, -2.0, -30.0]])
REF = torch.tensor([[-1.5, -1.0, -1.0]])
DIFF = LOGP - REF  # [0.5, -1.0, -29.0]
K3 = torch.tensor([[math.exp(-0.5) + 0.5 - 1, math.e - 2, 10.0]])  # d = 29 is clamped to 20, value to 10
EXPECTED_KL = {
    "k1": DIFF,
    "kl": DIFF,
    "abs": DIFF.abs(),
    "k2": 0.5 * DIFF**2,
    "mse": 0.5 * DIFF**2,
    "k3": K3,
    "low_var_kl": K3,
}


@pytest.mark.parametrize("kind", list(EXPECTED_KL))
def test_kl_values(kind):
    torch.testing.assert_close(kl_penalty(LOGP, REF, kind), EXPECTED_KL[kind])


@pytest.mark.parametrize("kind", list(EXPECTED_KL))
def test_kl_straight_through_variants(kind):
    logp = LOGP.clone().requires_grad_(True)
    value = kl_penalty(logp, REF, kind + "+")
    torch.testing.assert_close(value.detach(), EXPECTED_KL[kind])
    value.sum().backward()
    torch.testing.assert_close(logp.grad, DIFF)  # gradient of ½(logp - ref)²


def test_k3_gradient():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    kl_penalty(logp, REF[:, :2], "k3").sum().backward()
    d = REF[:, :2] - logp.detach()
    torch.testing.assert_close(logp.grad, 1 - torch.exp(d))


@pytest.mark.parametrize("kind", ["full", "low-var-kl", "k3++", "K1"])
def test_kl_unknown_kind(kind):
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(LOGP, REF, kind)


# --- entropy ---------------------------------------------------------------------------------


def entropy_of(logits: torch.Tensor) -> torch.Tensor:
    """Each row's entropy as the trainer takes it (`algo.logprobs.selected_logprobs`, `entropy_from_logprobs`)."""
    return selected_logprobs(logits, torch.zeros(logits.shape[0], dtype=torch.long), with_entropy=True)[1]


def test_entropy_manual_values():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [math.log(0.5), math.log(0.25), math.log(0.125), math.log(0.125)]])
    out = entropy_of(logits + 3.0)  # shift invariant
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([math.log(4), 1.75 * math.log(2)]))
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(3, 11, generator=gen, dtype=torch.float64)
    p = torch.softmax(z, -1)
    torch.testing.assert_close(entropy_of(z.float()), (-(p * p.log()).sum(-1)).float())


def test_entropy_of_a_peaked_distribution_keeps_its_digits():
    """One logit 20 above 999 others: H is about 4.3e-5. In float32, logsumexp(z) - sum(p z) subtracts two numbers
    near 20 (float32's spacing there is 1.9e-6) and is 7 % off; -sum(p log p) adds small positive terms (0.4 % off:
    the float32 log-softmax of the top entry sets that)."""
    z = torch.zeros(1, 1000, dtype=torch.float64)
    z[0, 0] = 20.0
    p = torch.softmax(z, -1)
    exact = -(p * p.log()).sum(-1)  # [1] float64
    assert float(exact) == pytest.approx(4.3e-5, rel=0.05)
    torch.testing.assert_close(entropy_of(z.float()).double(), exact, rtol=1e-2, atol=0)
    logp = torch.log_softmax(z.float(), -1)
    torch.testing.assert_close(entropy_from_logprobs(logp).double(), exact, rtol=1e-2, atol=0)


def test_entropy_gradient_of_a_uniform_distribution_is_zero():
    logits = torch.zeros(2, 3, requires_grad=True)
    entropy_of(logits).sum().backward()
    torch.testing.assert_close(logits.grad, torch.zeros(2, 3))  # uniform is a maximum


# --- value loss ------------------------------------------------------------------------------


def test_value_loss_hand_case():
    values = torch.tensor([[1.0, 2.0, 100.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[1.5, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    # token 0: v_clip 0.5 -> clipped term 1.0 > 0.25; token 1: v_clip 0.5 -> 0.25 < 4.0
    loss, metrics = value_loss(values, old, returns, mask)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 4.0) / 2)
    assert metrics == {"vf_clipfrac": pytest.approx(0.5), "vpred_mean": pytest.approx(1.5)}
    loss.backward()
    # token 0's loss comes from the clipped branch (constant in v); token 1: d ½·½(v-R)² = ½(v-R)
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 1.0, 0.0]]))
    with pytest.raises(ValueError, match="clip_range"):
        value_loss(values, old, returns, mask, clip_range=0.0)


def test_unclipped_importance_sampling_is_minus_ratio_times_advantage_with_no_bound():
    logp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)  # [1, 3]
    old = torch.tensor([[-3.0, -1.0, 0.0]])  # ratios e^3, 1, e^-2: far outside any clip range
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    mask = torch.ones(1, 3)
    settings = PolicyLossSettings(kind="is", agg="token-mean")
    loss, metrics = policy_loss(logp, old, adv, mask, settings)
    ratio = [math.exp(3.0), 1.0, math.exp(-2.0)]
    assert loss.item() == pytest.approx(-(ratio[0] * 1.0 - 2.0 * ratio[1] + 0.5 * ratio[2]) / 3, rel=1e-6)
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-ratio[0] / 3, 2.0 / 3, -0.5 * ratio[2] / 3], rel=1e-6)
    assert metrics["pg_clipfrac"] == 0.0


def test_old_from_the_sampler_puts_the_rollout_log_probs_in_the_ratio():
    logp = torch.tensor([[-0.5, -1.0]], requires_grad=True)  # [1, 2]
    trainer = torch.tensor([[-0.5, -1.0]])  # the trainer's own: ratio 1
    sampler = torch.tensor([[-1.5, -0.2]])  # a lagged sampler's
    adv, mask, ent = torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), torch.zeros(1, 2)
    plain = PolicyLossSettings(kind="is", agg="token-mean", entropy_coef=0.0)
    lagged = PolicyLossSettings(kind="is", agg="token-mean", entropy_coef=0.0, old_from="sampler")
    on_trainer, _ = loss_terms(logp, ent, trainer, adv, mask, plain, rollout_logprobs=sampler)
    on_sampler, _ = loss_terms(logp, ent, trainer, adv, mask, lagged, rollout_logprobs=sampler)
    assert on_trainer["pg"].item() == pytest.approx(-1.0)
    assert on_sampler["pg"].item() == pytest.approx(-(math.exp(1.0) + math.exp(-0.8)) / 2, rel=1e-6)
    with pytest.raises(ValueError, match="needs the rollout's sampling log-probs"):
        loss_terms(logp, ent, trainer, adv, mask, lagged)
