"""The sampler/trainer mismatch metrics and the TIS / MIS corrections: hand-computed tensors, the HF engine's ~0."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import micro_model_batch
from rldynamics.algo.losses import PolicyLossSettings, policy_loss, rollout_correction_weights
from rldynamics.algo.rollout_corr import mismatch_metrics
from rldynamics.config import make_config
from rldynamics.models.forward import batch_logprobs

# two sequences of two sampled tokens and one pad; the trainer's and the sampler's probabilities of each token
OLD = torch.log(torch.tensor([[0.5, 0.5, 1.0], [0.9, 0.1, 1.0]]))  # [2, 3]
ROLLOUT = torch.log(torch.tensor([[0.25, 0.5, 1.0], [0.9, 0.8, 1.0]]))  # [2, 3]: ratios 2, 1 | 1, 0.125
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # [2, 3]


def test_tis_caps_each_token_ratio():
    weights = rollout_correction_weights(OLD, ROLLOUT, MASK, tis_cap=1.5)
    assert torch.allclose(weights[:, :2], torch.tensor([[1.5, 1.0], [1.0, 0.125]]))


def test_mis_masks_sequences_whose_geometric_mean_ratio_leaves_the_band():
    # row 0: sqrt(2 * 1) = 1.41 inside [0.5, 2]; row 1: sqrt(1 * 0.125) = 0.35 below 0.5
    weights = rollout_correction_weights(OLD, ROLLOUT, MASK, mis_band=2.0)
    assert torch.allclose(weights[:, :2], torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    both = rollout_correction_weights(OLD, ROLLOUT, MASK, tis_cap=1.5, mis_band=2.0)
    assert torch.allclose(both[:, :2], torch.tensor([[1.5, 1.0], [0.0, 0.0]]))


def test_corrections_off_weigh_nothing_and_bad_values_are_refused():
    assert torch.equal(rollout_correction_weights(OLD, ROLLOUT, MASK), torch.ones(2, 3))
    with pytest.raises(ValueError, match="tis_cap"):
        rollout_correction_weights(OLD, ROLLOUT, MASK, tis_cap=0.0)
    with pytest.raises(ValueError, match="mis_band"):
        rollout_correction_weights(OLD, ROLLOUT, MASK, mis_band=1.0)


def test_policy_loss_weighs_each_token_by_the_correction():
    # ratio 1 and advantage 1: every token's ppo loss is -1; token-mean over the 4 sampled tokens
    weights = rollout_correction_weights(OLD, ROLLOUT, MASK, tis_cap=1.5, mis_band=2.0)
    loss, _ = policy_loss(OLD, OLD, torch.ones(2, 3), MASK, PolicyLossSettings(), token_weights=weights)
    assert loss.item() == pytest.approx(-(1.5 + 1.0 + 0.0 + 0.0) / 4)
    plain, _ = policy_loss(OLD, OLD, torch.ones(2, 3), MASK, PolicyLossSettings())
    assert plain.item() == pytest.approx(-1.0)


def test_mismatch_metrics_by_hand():
    m = mismatch_metrics(OLD, ROLLOUT, MASK, band=1.5, tis_cap=1.5, mis=True)
    ratios = [2.0, 1.0, 1.0, 0.125]
    assert m["rollout/corr/rollout_is_mean"] == pytest.approx(sum(ratios) / 4)
    assert m["rollout/corr/rollout_is_min"] == pytest.approx(0.125)
    assert m["rollout/corr/rollout_is_max"] == pytest.approx(2.0)
    assert m["rollout/corr/kl"] == pytest.approx(sum(-math.log(r) for r in ratios) / 4, abs=1e-6)
    assert m["rollout/corr/k3_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / 4, abs=1e-6)
    assert m["rollout/corr/rollout_is_ratio_fraction_high"] == 0.25  # the 2 above 1.5
    assert m["rollout/corr/rollout_is_ratio_fraction_low"] == 0.25  # the 0.125 below 1/1.5
    assert m["rollout/corr/token_fraction_outside"] == 0.5
    assert m["rollout/corr/rollout_is_seq_fraction_high"] == 0.0  # arithmetic means: row 0 1.5, row 1 0.5625
    assert m["rollout/corr/rollout_is_seq_fraction_low"] == 0.5
    assert m["rollout/corr/seq_geo_fraction_high"] == 0.0  # geometric means: row 0 1.41 inside
    assert m["rollout/corr/seq_geo_fraction_low"] == 0.5  # row 1: 0.35
    assert m["rollout/corr/seq_geo_fraction_outside"] == 0.5
    assert m["rollout/corr/rollout_is_truncated_fraction"] == 0.25
    assert m["rollout/corr/rollout_rs_masked_fraction"] == 0.5  # row 1's 2 of 4 tokens
    assert m["rollout/corr/rollout_rs_seq_masked_fraction"] == 0.5


def test_metrics_under_verls_names_are_verls_quantities():
    """Where the definitions part: a long row whose arithmetic mean leaves the band while its geometric mean stays
    inside, a one-token row MIS masks, and a row without sampled tokens."""
    ratios = torch.tensor([[6.0, 1.0, 1.0], [0.2, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])  # [4, 3]
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])  # [4, 3]: row 2 empty
    rollout = torch.full((4, 3), math.log(0.1))
    m = mismatch_metrics(rollout + ratios.log(), rollout, mask, band=2.0, mis=True)
    assert m["rollout/corr/rollout_is_seq_fraction_high"] == 0.25  # verl: row 0's mean 8/3 > 2, over all 4 rows
    assert m["rollout/corr/rollout_is_seq_fraction_low"] == 0.5  # row 1 (0.2) and the empty row (mean 0)
    assert m["rollout/corr/seq_geo_fraction_high"] == 0.0  # ours: 6^(1/3) = 1.82 inside, over the 3 rows with tokens
    assert m["rollout/corr/seq_geo_fraction_low"] == pytest.approx(1 / 3)
    assert m["rollout/corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 7)  # verl: token-weighted, 1 of 7 tokens
    assert m["rollout/corr/rollout_rs_seq_masked_fraction"] == 0.25  # 1 masked row of 4


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hf_engine_mismatch_is_zero(tiny_cache, temperature):
    """The HF engine samples from the trainer's own model: its recorded log-probs are the trainer's old ones."""
    model, _, batch = micro_model_batch(tiny_cache, group_size=3)
    if temperature != 1.0:
        from rldynamics.rollout.agent import rollout

        cfg = make_config(overrides=["env.max_new_tokens=6", "env.max_turns=2"])
        torch.manual_seed(1)
        batch = rollout(model, _, [1, 2], 3, cfg.env, temperature=temperature)
    old, _ = batch_logprobs(model, batch.input_ids, batch.attention_mask, micro_batch_size=2,
                            temperature=temperature, positions=batch.response_mask)  # [N, L]
    mask = batch.response_mask.bool()
    assert mask.sum() > 10 and (batch.rollout_logprobs[mask] < 0).all() and (batch.rollout_logprobs[~mask] == 0).all()
    m = mismatch_metrics(old, batch.rollout_logprobs, batch.response_mask)
    assert abs(m["rollout/corr/kl"]) < 1e-5 and m["rollout/corr/k3_kl"] < 1e-8
    assert m["rollout/corr/rollout_is_min"] > 1 - 1e-4 and m["rollout/corr/rollout_is_max"] < 1 + 1e-4
    assert m["rollout/corr/token_fraction_outside"] == 0.0 and m["rollout/corr/seq_geo_fraction_outside"] == 0.0


def test_training_logs_the_mismatch_and_runs_the_corrections(fast_overrides):
    """Every step's row has the rollout/corr family (~0 on the HF engine); TIS and MIS train without error."""
    from rldynamics.train.trainer import train

    run = train(make_config(overrides=[*fast_overrides, "train.steps=1", "algo.tis_cap=2", "algo.mis=true",
                                       "analysis.enabled=true", "log.name=corr"]))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r.get("step") == 1)
    per_bucket = [k for k in step if k.startswith("grad_norm/bucket_") and k.endswith("/rollout/corr/k3_kl")]
    assert per_bucket and all(abs(step[k]) < 1e-6 for k in per_bucket)  # the analysis sees it per bucket too
    assert abs(step["rollout/corr/kl"]) < 1e-4 and step["rollout/corr/rollout_rs_masked_fraction"] == 0.0
    assert step["rollout/corr/rollout_is_truncated_fraction"] == 0.0


def test_mismatch_per_bucket_is_that_of_the_buckets_rows():
    from types import SimpleNamespace

    from rldynamics.analysis.objective import ActorInputs
    from rldynamics.train.diagnostics.gradient_analysis import bucket_mismatch

    cfg = make_config(overrides=["algo.mismatch_band=1.5"])
    batch = SimpleNamespace(group_ids=torch.tensor([7, 3]), rollout_logprobs=ROLLOUT, response_mask=MASK)
    inputs = ActorInputs(old_logprobs=OLD, advantages=torch.zeros(2, 3))
    out = bucket_mismatch(cfg, batch, inputs, [("bucket_1", 3, 0.1), ("bucket_2", 7, 0.5)], "grad_norm")
    assert out["grad_norm/bucket_1/rollout/corr/rollout_is_mean"] == pytest.approx((1 + 0.125) / 2)  # row 1
    assert out["grad_norm/bucket_2/rollout/corr/rollout_is_mean"] == pytest.approx((2 + 1) / 2)  # row 0
    assert out["grad_norm/bucket_2/rollout/corr/rollout_is_max"] == pytest.approx(2.0)
    assert out["grad_norm/bucket_1/rollout/corr/token_fraction_outside"] == 0.5
    both = bucket_mismatch(cfg, batch, inputs, [("bucket_1", 3, 0.1), ("bucket_1", 7, 0.1)], "grad_norm")
    whole = mismatch_metrics(OLD, ROLLOUT, MASK, band=1.5)
    assert both == {f"grad_norm/bucket_1/{k}": pytest.approx(v) for k, v in whole.items()}
    assert bucket_mismatch(cfg, batch, ActorInputs(old_logprobs=None, advantages=torch.zeros(2, 3)),
                           [("bucket_1", 3, 0.1)], "grad_norm") == {}
