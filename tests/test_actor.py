"""Actor update: exact aggregation whatever the micro-batch size, direction of the update, non-finite skip."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import micro_model_batch
from rldynamics import metric_names as names
from rldynamics.algo.losses import aggregate, term_coefs, weighted_total
from rldynamics.algo.rollout_corr import batch_mismatch
from rldynamics.algo.shares import sub_batch_share
from rldynamics.analysis.objective import ActorInputs
from rldynamics.config import make_config
from rldynamics.models.forward import batch_logprobs
from rldynamics.train.actor import rows_after_first_step, update_actor, update_mini_batches
from rldynamics.train.early_stop import EarlyStopper


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model, _, batch = micro_model_batch(tmp_path_factory.mktemp("cache"), 3)
    old, _ = batch_logprobs(model, batch.input_ids, batch.attention_mask, micro_batch_size=6)
    advantages = torch.linspace(-1, 1, len(batch))[:, None] * batch.response_mask  # [N, L]
    return model, batch, ActorInputs(old_logprobs=old, advantages=advantages)


def _update(model, batch, inputs, overrides):
    """The model after one update by SGD with lr 1 (its change is the clipped gradient itself: AdamW would magnify
    the float rounding of gradients near 0 into changes of up to its lr) and the update's metrics."""
    cfg = make_config(overrides=["train.mini_batch_size=6", *overrides])
    model = copy.deepcopy(model)
    metrics = update_actor(model, torch.optim.SGD(model.parameters(), lr=1.0), batch, inputs, cfg.algo,
                           cfg.train).metrics
    return model, metrics


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_update_does_not_depend_on_micro_batch_size(setup, mode):
    model, batch, inputs = setup
    results = [_update(model, batch, inputs, [f"train.micro_batch_size={m}", f"algo.loss_agg_mode={mode}"])
               for m in (1, 4, 6)]
    ref = torch.cat([p.flatten() for p in results[-1][0].parameters()])
    for m, metrics in results[:-1]:
        flat = torch.cat([p.flatten() for p in m.parameters()])
        assert torch.allclose(flat, ref, atol=1e-5)
        assert metrics[names.ACTOR_GRAD_NORM] == pytest.approx(results[-1][1][names.ACTOR_GRAD_NORM], rel=1e-4)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_update_statistics_do_not_depend_on_micro_batch_size(setup, mode):
    """Loss values are weighted like the loss, token-level means (clip fractions, ppo_kl) by tokens: the statistics
    of one optimizer step are those of the whole mini-batch, however it is cut (micro-batches, ranks)."""
    model, batch, inputs = setup
    gen = torch.Generator().manual_seed(3)
    off = ActorInputs(old_logprobs=inputs.old_logprobs + 0.3 * torch.randn(inputs.old_logprobs.shape, generator=gen),
                      advantages=inputs.advantages)  # ratios away from 1: clipping happens
    keys = tuple(names.actor(k) for k in ("pg_loss", "entropy_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"))
    results = [_update(model, batch, off, [f"train.micro_batch_size={m}", f"algo.loss_agg_mode={mode}",
                                           "train.ppo_epochs=1"])[1] for m in (1, 4, 6)]
    assert results[-1][names.PG_CLIPFRAC] > 0 and results[-1][names.actor("ppo_kl")] != 0
    for metrics in results[:-1]:
        for key in keys:
            assert metrics[key] == pytest.approx(results[-1][key], rel=1e-5, abs=1e-7), key


def test_cispo_weight_has_no_lower_bound_unless_configured(setup):
    """algo.cispo_clip_low reaches the actor's loss: without it only ratios above 1 + clip_high are clipped."""
    model, batch, inputs = setup
    gen = torch.Generator().manual_seed(3)
    off = ActorInputs(old_logprobs=inputs.old_logprobs + 0.3 * torch.randn(inputs.old_logprobs.shape, generator=gen),
                      advantages=inputs.advantages)
    ratio = torch.exp(inputs.old_logprobs - off.old_logprobs)[batch.response_mask > 0]  # the first update's ratios
    for extra, clipped in (([], ratio > 1.28), (["algo.cispo_clip_low=0.2"], (ratio > 1.28) | (ratio < 0.8))):
        metrics = _update(model, batch, off, ["algo.policy_loss=cispo", "train.micro_batch_size=6",
                                              "train.ppo_epochs=1", *extra])[1]
        assert metrics[names.PG_CLIPFRAC] == pytest.approx(clipped.float().mean().item(), abs=1.5 / len(ratio))
    assert ((ratio < 0.8).float().mean() * len(ratio)) >= 3  # the two cases differ by more than the tolerance


def test_sub_batch_shares_sum_to_one():
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        chunks = [torch.tensor([0, 1]), torch.tensor([2]), torch.tensor([3])]
        shares = [sub_batch_share(mask, c, mode) for c in chunks]
        assert sum(shares) == pytest.approx(1.0) and shares[1] == 0.0
    # token-mean: 3 of 7 tokens in rows 0-1
    assert sub_batch_share(mask, torch.tensor([0, 1]), "token-mean") == pytest.approx(3 / 7)


def test_weighted_total_combines_terms_with_their_coefficients():
    pg, ent, kl = (torch.tensor(v, requires_grad=True) for v in (2.0, 3.0, 4.0))
    total = weighted_total({"pg": pg, "entropy": ent, "kl": kl}, term_coefs(0.01, 0.5))
    assert total.item() == pytest.approx(2.0 - 0.01 * 3.0 + 0.5 * 4.0)
    total.backward()
    assert (pg.grad.item(), ent.grad.item(), kl.grad.item()) == pytest.approx((1.0, -0.01, 0.5))


def test_weighted_total_leaves_out_zero_coefficient_terms():
    pg = torch.tensor(2.0, requires_grad=True)
    ent = torch.tensor(float("nan"), requires_grad=True)  # 0 * nan would poison the loss
    total = weighted_total({"pg": pg, "entropy": ent}, term_coefs(0.0, 0.0))
    total.backward()
    assert total.item() == 2.0 and pg.grad.item() == 1.0 and ent.grad is None


def test_update_follows_the_advantages(setup):
    model, batch, inputs = setup
    updated, _ = _update(model, batch, inputs, ["train.micro_batch_size=2", "algo.entropy_coef=0"])
    new, _ = batch_logprobs(updated, batch.input_ids, batch.attention_mask, micro_batch_size=6)
    delta = ((new - inputs.old_logprobs) * batch.response_mask).sum(1)  # [N]
    assert delta[-1] > 0 > delta[0]  # the highest-advantage row gained probability, the lowest lost it


def test_non_finite_gradient_skips_the_step(setup):
    model, batch, inputs = setup
    bad = ActorInputs(old_logprobs=inputs.old_logprobs, advantages=inputs.advantages.clone())
    bad.advantages[0, batch.response_mask[0].nonzero()[0]] = float("nan")
    updated, metrics = _update(model, batch, bad, ["train.micro_batch_size=6"])
    assert metrics[names.SKIPPED_STEPS] == metrics[names.actor("num_updates")] >= 1  # every update saw the NaN row
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), updated.parameters(), strict=True))


def test_early_stopping_rules():
    cfg = make_config().early_stop
    rv = EarlyStopper(cfg, empty_stop_steps=3)
    reasons = [rv.after_rollout(1.0, empty=False) for _ in range(10)]
    reasons += [rv.after_rollout(0.05, empty=False) for _ in range(10)]
    assert reasons[:19] == [None] * 19 and reasons[19] == "reward_variance_collapse"  # earliest possible: step 20
    empty = EarlyStopper(cfg, empty_stop_steps=3)
    assert [empty.after_rollout(0.0, empty=True) for _ in range(3)] == [None, None, "empty_filtered_steps"]
    val = EarlyStopper(cfg, empty_stop_steps=3)
    assert [val.after_validation(0.0) for _ in range(5)][-1] == "low_validation_success"
    val.load_state_dict(EarlyStopper(cfg, 3).state_dict())
    assert val.after_validation(0.0) is None  # counter restored to zero


@pytest.mark.parametrize("policy_loss", ["ppo", "cispo"])
def test_on_policy_update_without_old_pass_matches_the_old_pass(setup, policy_loss):
    """One epoch, one mini-batch: the update's own detached log-probs stand in for the old-log-prob pass."""
    model, batch, inputs = setup
    overrides = ["train.micro_batch_size=4", "algo.loss_agg_mode=seq-mean-token-mean", "algo.entropy_coef=0.01",
                 f"algo.policy_loss={policy_loss}"]
    cfg = make_config(overrides=["train.mini_batch_size=6", "train.ppo_epochs=1", *overrides])
    own = ActorInputs(old_logprobs=None, advantages=inputs.advantages)
    results = []
    for inp in (inputs, own):  # SGD with lr 1: the parameter change is the clipped gradient itself
        m = copy.deepcopy(model)
        metrics = update_actor(m, torch.optim.SGD(m.parameters(), lr=1.0), batch, inp, cfg.algo, cfg.train).metrics
        results.append((m, metrics))
    (with_pass, m_pass), (without, m_own) = results
    for p, q in zip(with_pass.parameters(), without.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7)
    for key in (names.PG_LOSS, names.actor("entropy_loss"), names.ACTOR_GRAD_NORM):
        assert m_own[key] == pytest.approx(m_pass[key], rel=1e-5, abs=1e-7)
    assert m_own[names.actor("ppo_kl")] == 0.0 and m_own[names.PG_CLIPFRAC] == 0.0  # ratio exactly 1


def test_a_recording_update_gives_the_old_pass_log_probs_and_mismatch(setup):
    """`record`: the single-pass update's own forward yields the rollout policy's log-probs, so the mismatch
    metrics need no old-log-prob pass; recording leaves the update itself unchanged."""
    model, batch, inputs = setup
    cfg = make_config(overrides=[f"train.mini_batch_size={len(batch)}", "train.ppo_epochs=1",
                                 "train.micro_batch_size=4", "algo.tis_cap=2.0"])
    assert len(update_mini_batches(cfg.train, len(batch), None)) == 1  # one pass on the rollout policy
    own = ActorInputs(old_logprobs=None, advantages=inputs.advantages)
    updates, models = [], []
    for record in (False, True):
        m = copy.deepcopy(model)
        updates.append(update_actor(m, torch.optim.SGD(m.parameters(), lr=1.0), batch, own, cfg.algo, cfg.train,
                                    record=record))
        models.append(m)
    assert updates[0].logprobs is None and updates[1].metrics == updates[0].metrics
    assert all(torch.equal(p, q) for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True))
    mask = batch.response_mask.bool()  # [N, L]
    torch.testing.assert_close(updates[1].logprobs[mask], inputs.old_logprobs[mask], rtol=1e-5, atol=1e-6)
    assert (updates[1].logprobs[~mask] == 0).all()
    sampler = inputs.old_logprobs + 0.1 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    batch.rollout_logprobs, saved = sampler, batch.rollout_logprobs
    try:
        got, want = (batch_mismatch(cfg, batch, old) for old in (updates[1].logprobs, inputs.old_logprobs))
    finally:
        batch.rollout_logprobs = saved
    assert got.keys() == want.keys() and "rollout/corr/k3_kl" in got
    assert got == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_only_the_rows_after_the_first_optimizer_step_need_an_old_log_prob_pass():
    def later(overrides: list[str], rows: int, seed: int | None = None) -> list[int]:
        train = make_config(overrides=overrides).train
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        return rows_after_first_step(update_mini_batches(train, rows, gen), rows).tolist()

    in_order = ["train.shuffle=false", "train.mini_batch_size=8"]
    assert later([*in_order, "train.ppo_epochs=1"], 8) == []  # one pass on the rollout policy
    assert later([*in_order, "train.ppo_epochs=3"], 8) == []  # each epoch one step over every row
    assert later([*in_order, "train.ppo_epochs=1"], 11) == [8, 9, 10]
    shuffled = ["train.shuffle=true", "train.mini_batch_size=4", "train.ppo_epochs=2"]
    first = update_mini_batches(make_config(overrides=shuffled).train, 8, torch.Generator().manual_seed(5))[0]
    assert later(shuffled, 8, seed=5) == sorted(set(range(8)) - set(first.tolist())) and len(first) == 4


@pytest.mark.parametrize("policy_loss", ["ppo", "cispo"])
def test_an_update_that_takes_its_first_steps_old_log_probs_matches_the_old_pass(setup, policy_loss):
    """Two epochs of two mini-batches: the first optimizer step's own log-probs stand in for the old-log-prob pass
    over its rows and a pass over the other rows alone gives the rest. Same parameters and statistics as with the
    whole pass (float rounding apart), the merged log-probs and entropies are the pass's, and so is the entropy."""
    model, batch, inputs = setup
    cfg = make_config(overrides=["train.mini_batch_size=4", "train.ppo_epochs=2", "train.micro_batch_size=3",
                                 "algo.loss_agg_mode=seq-mean-token-mean", "algo.entropy_coef=0.01",
                                 f"algo.policy_loss={policy_loss}"])
    old, entropy = batch_logprobs(model, batch.input_ids, batch.attention_mask, micro_batch_size=6,
                                  with_entropy=True, positions=batch.response_mask)  # [N, L] each
    minis = update_mini_batches(cfg.train, len(batch), torch.Generator().manual_seed(9))
    later = rows_after_first_step(minis, len(batch))  # [K]
    assert len(minis) == 4 and 0 < len(later) < len(batch)
    rest = torch.zeros(len(batch), dtype=torch.bool)  # [N]
    rest[later] = True
    later_old = (old * rest[:, None], entropy * rest[:, None])  # [N, L] each: the rest's pass, 0 at the first rows
    updates, models = [], []
    for inp, given in ((ActorInputs(old, inputs.advantages), None), (ActorInputs(None, inputs.advantages), later_old)):
        m = copy.deepcopy(model)
        updates.append(update_actor(m, torch.optim.SGD(m.parameters(), lr=1.0), batch, inp, cfg.algo, cfg.train,
                                    torch.Generator().manual_seed(9), later_old=given))
        models.append(m)
    with_pass, merged = updates
    for p, q in zip(*(m.parameters() for m in models), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7)
    for key in (names.PG_LOSS, names.actor("entropy_loss"), names.ACTOR_GRAD_NORM, names.actor("ppo_kl")):
        assert merged.metrics[key] == pytest.approx(with_pass.metrics[key], rel=1e-4, abs=1e-7)
    assert with_pass.logprobs is None and with_pass.rollout_entropy is None
    mask = batch.response_mask.bool()  # [N, L]
    torch.testing.assert_close(merged.logprobs[mask], old[mask], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged.token_entropy[mask], entropy[mask], rtol=1e-5, atol=1e-6)
    want = aggregate(entropy, batch.response_mask, cfg.algo.loss_agg_mode).item()
    assert merged.rollout_entropy == pytest.approx(want, rel=1e-5)
    assert merged.steps[0].stats["ppo_kl"] == 0.0  # the first step: ratio exactly 1
