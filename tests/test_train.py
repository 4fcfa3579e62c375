"""End-to-end training on the embedded tiny model: run directory, determinism, resume."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from rldynamics import metric_names as names
from rldynamics.config import make_config
from rldynamics.tracking.run_dir import read_metrics
from rldynamics.train.trainer import train


def _metrics_without_timing(run_dir):
    return [{k: v for k, v in row.items() if not k.startswith("timing_s/")} for row in read_metrics(run_dir)]


def _weights(run_dir, step):
    return load_file(str(run_dir / "checkpoints" / f"step_{step}" / "actor" / "model.safetensors"))


def test_run_directory_contents(fast_overrides):
    run = train(make_config(overrides=[*fast_overrides, "log.name=a", "algo.adv_estimator=gae", "log.report=true"]))
    assert (run / "config.yaml").is_file()
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "train/sokoban/success",
                "val-env/sokoban/success", "rollout/filter_kept_ratio", "timing_s/gen", "actor/entropy"):
        assert key in rows[1], key
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and "<|im_start|>assistant" in samples[0]["text"]
    assert (run / "report.html").is_file() and (run / "plots" / "training_curves.png").is_file()
    ckpt = run / "checkpoints" / "step_2"
    assert (ckpt / "actor" / "model.safetensors").is_file() and (ckpt / "critic" / "value_head.safetensors").is_file()


def test_same_seed_same_metrics(fast_overrides):
    a = train(make_config(overrides=[*fast_overrides, "log.name=a", "algo.adv_estimator=grpo"]))
    b = train(make_config(overrides=[*fast_overrides, "log.name=b", "algo.adv_estimator=grpo"]))
    assert _metrics_without_timing(a) == _metrics_without_timing(b)


def test_resume_gives_identical_weights(fast_overrides):
    common = [*fast_overrides, "algo.kl_coef=0.01", "algo.adv_estimator=gae"]  # reference model and critic too
    straight = train(make_config(overrides=[*common, "log.name=straight", "train.steps=4"]))
    train(make_config(overrides=[*common, "log.name=split"]))
    resumed = train(make_config(overrides=[*common, "log.name=split", "train.steps=4", "checkpoint.resume=latest"]))
    a, b = _weights(straight, 4), _weights(resumed, 4)
    assert a.keys() == b.keys()
    assert all((a[k] == b[k]).all() for k in a)
    assert [r["step"] for r in read_metrics(resumed)] == [0, 1, 2, 3, 4]
    assert _metrics_without_timing(straight)[-1] == _metrics_without_timing(resumed)[-1]


def test_on_policy_update_skips_the_old_log_prob_pass(fast_overrides):
    """One epoch over one mini-batch: no old-log-prob forward, and the same weights as a run that does it.

    The run with the gradient analysis at every step keeps the pass (the probe needs the old log-probs);
    the analysis is read-only, so its weights are those the pass gives.
    """
    common = [*fast_overrides, "algo.adv_estimator=grpo", "train.ppo_epochs=1", "train.mini_batch_size=4",
              "train.micro_batch_size=3", "val.every=0", "val.before_train=false"]
    own = train(make_config(overrides=[*common, "log.name=own"]))
    kept = train(make_config(overrides=[*common, "log.name=kept", "analysis.enabled=true", "analysis.every=1"]))
    own_rows, kept_rows = read_metrics(own), read_metrics(kept)
    assert all("timing_s/old_log_prob" not in r for r in own_rows)
    assert all("timing_s/old_log_prob" in r for r in kept_rows)
    a, b = _weights(own, 2), _weights(kept, 2)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    for r, q in zip(own_rows, kept_rows, strict=True):
        assert r["actor/entropy"] == pytest.approx(q["actor/entropy"], rel=1e-5)
        assert r["actor/pg_loss"] == pytest.approx(q["actor/pg_loss"], abs=1e-6)
        assert r["actor/ppo_kl"] == 0.0


def test_reference_pass_only_where_something_reads_it(fast_overrides):
    """With KL off, the reference log-probs are computed only at analysis steps (the probe measures the KL gradient
    there); with KL on, at every step."""
    common = [*fast_overrides, "val.every=0", "val.before_train=false", "analysis.enabled=true", "analysis.every=2"]
    off = train(make_config(overrides=[*common, "log.name=off", "algo.kl_coef=0"]))
    assert ["timing_s/ref" in r for r in read_metrics(off)] == [True, False]  # analysis at step 1 only
    on = train(make_config(overrides=[*common, "log.name=on", "algo.kl_coef=0.001"]))
    assert all("timing_s/ref" in r for r in read_metrics(on))


def test_trains_another_architecture_from_a_local_path(fast_overrides, tmp_path):
    """`model.path=DIR` takes any causal LM saved with save_pretrained: here a Llama, with critic and reference."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from rldynamics.models.loading import load_model_and_tokenizer
    from rldynamics.train.setup import base_model_path

    _, tokenizer = load_model_and_tokenizer(base_model_path(make_config(overrides=fast_overrides)))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")

    run = train(make_config(overrides=[*fast_overrides, "log.name=llama", f"model.path={tmp_path / 'llama'}",
                                       "algo.adv_estimator=gae", "algo.kl_coef=0.01"]))
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(math.isfinite(rows[-1][k]) for k in ("actor/pg_loss", "actor/kl_loss", "critic/vf_loss"))
    actor = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_2" / "actor")
    assert isinstance(actor, LlamaForCausalLM)
    before = LlamaForCausalLM.from_pretrained(tmp_path / "llama").state_dict()
    assert any(not torch.equal(before[k], v) for k, v in actor.state_dict().items())  # it was trained


def test_exploding_training_ends_early_with_a_named_reason(fast_overrides):
    """`train.lr=1e6`: the policy's logits overflow after the first update. The run ends with rc 0 and the reason
    logged, saves no non-finite checkpoint, and its report is written (a `$` in the name is drawn literally)."""
    run = train(make_config(overrides=[*fast_overrides, "log.name=$x^_{$", "train.lr=1e6", "train.steps=5",
                                       "checkpoint.every=1", "algo.adv_estimator=grpo", "log.report=true"]))
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(len(rows))) and len(rows) < 6
    assert rows[-1].get("early_stopped/non_finite_logits") == 1.0 and rows[-1]["rollout/non_finite_logits"] == 1.0
    for ckpt in (run / "checkpoints").glob("step_*"):
        assert all(torch.isfinite(t).all() for t in load_file(str(ckpt / "actor" / "model.safetensors")).values())
    assert not (run / "checkpoints" / f"step_{rows[-1]['step']}").exists()
    assert (run / "report.html").is_file() and (run / "plots" / "training_curves.png").is_file()


def test_optimizer_overflow_ends_the_run_without_saving_it(fast_overrides):
    run = train(make_config(overrides=[*fast_overrides, "log.name=overflow", "train.lr=1e308",
                                       "algo.adv_estimator=grpo"]))
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1]["actor/non_finite_parameters"] == 1.0 and rows[1]["early_stopped/non_finite_parameters"] == 1.0
    assert not (run / "checkpoints").exists()


def test_validation_with_overflowing_temperature_is_skipped_and_logged(fast_overrides):
    run = train(make_config(overrides=[*fast_overrides, "log.name=coldval", "val.temperature=1e-308",
                                       "train.steps=1", "algo.adv_estimator=grpo"]))
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["val-env/sokoban/non_finite_logits"] == 1.0 for r in rows)
    assert "actor/pg_loss" in rows[1] and (run / "checkpoints" / "step_1").is_dir()  # training went on


def test_metric_names_mean_what_ragen_means(fast_overrides):
    run = train(make_config(overrides=[*fast_overrides, "log.name=names", "train.steps=1", "train.ppo_epochs=2",
                                       "val.every=0", "val.before_train=false",
                                       "algo.entropy_coef=0.01", "algo.kl_coef=0.02", "analysis.enabled=true",
                                       "analysis.every=1"]))
    for row in read_metrics(run):
        # actor/entropy is the rollout policy's entropy (old-log-prob pass): the analysis, run on the same batch with
        # the same weights before the update, measures it through its entropy loss term (-coef * H)
        assert row["actor/entropy"] == pytest.approx(-row["grad_norm/all/loss/entropy"] / 0.01, rel=1e-5)
        assert row["actor/entropy_loss"] != row["actor/entropy"]  # the update's mean (two epochs) is its own key
        assert row["actor/kl_coef"] == 0.02
        assert row["rollout/empty_after_filter"] == 0.0 and row["rollout/consecutive_empty_after_filter_steps"] == 0.0
    # min_p at 2 x the best score without zero-score groups keeps nothing: every step is empty; an analysis of its
    # own batch (analysed at steps 1 and 3) still runs and is logged in the empty step's row
    empty = train(make_config(overrides=[*fast_overrides, "log.name=empty", "train.steps=3", "filter.strategy=min_p",
                                         "filter.value=2", "filter.include_zero=false", "val.every=0",
                                         "val.before_train=false", "analysis.enabled=true", "analysis.every=2",
                                         "analysis.env_groups=3"]))
    rows = read_metrics(empty)
    assert [r["rollout/empty_after_filter"] for r in rows] == [1.0, 1.0, 1.0]
    assert [r["rollout/consecutive_empty_after_filter_steps"] for r in rows] == [1.0, 2.0, 3.0]
    assert [r.get("grad_analysis/source_batch_size") for r in rows] == [6.0, None, 6.0]
    assert all(r["trainer/gradient_analysis_only"] == 0.0 for r in rows)


def test_explained_variance_and_its_terms_by_hand():
    from rldynamics.rollout.batch import RolloutBatch
    from rldynamics.train.batch_ops import data_metrics

    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])  # [2, 3]: three response tokens
    ids = torch.zeros(2, 3, dtype=torch.long)
    batch = RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=mask,
                         scores=torch.tensor([4.0, 1.0]), group_ids=torch.tensor([0, 0]))
    returns = torch.tensor([[0.0, 4.0, 4.0], [0.0, 1.0, 0.0]])  # masked: 4, 4, 1 (mean 3, variance 2)
    values = torch.tensor([[9.0, 3.0, 2.0], [9.0, 1.0, 9.0]])  # residuals 1, 2, 0 (mean 1, variance 2/3)
    m = data_metrics(batch, torch.zeros(2, 3), returns, values)
    assert m[names.RETURNS_VAR] == pytest.approx(2.0)
    assert m[names.VF_RESIDUAL_VAR] == pytest.approx(2.0 / 3.0)
    assert m[names.VF_EXPLAINED_VAR] == pytest.approx(1.0 - (2.0 / 3.0) / 2.0)
