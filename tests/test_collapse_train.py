"""The collapse diagnostics inside training: RAGEN's schedule, RAGEN's key, and read-only (bit-identical runs)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rldynamics.config import make_config
from rldynamics.tracking.run_dir import read_metrics
from rldynamics.train.diagnostics.collapse import collapse_due
from rldynamics.train.trainer import train


def _run(overrides: list[str]):
    """Train from the same global RNG states; returns (run dir, the global RNG states after the run)."""
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    run = train(make_config(overrides=overrides))
    return run, (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tolist())


def test_schedule_is_ragens():
    cfg = make_config(overrides=["collapse_detection.compute_freq=5"])
    assert [s for s in range(0, 21) if collapse_due(cfg, s)] == [1, 5, 10, 15, 20]
    assert not any(collapse_due(make_config(), s) for s in range(0, 21))


@pytest.mark.slow
def test_diagnostics_leave_training_bit_identical(fast_overrides):
    steps = ["train.steps=3", "val.every=0"]
    on, on_rng = _run([*fast_overrides, *steps, "log.name=on", "collapse_detection.compute_freq=1",
                       "collapse.num_samples=3", "collapse.bootstrap_resamples=20"])
    off, off_rng = _run([*fast_overrides, *steps, "log.name=off"])
    a = load_file(str(on / "checkpoints" / "step_3" / "actor" / "model.safetensors"))
    b = load_file(str(off / "checkpoints" / "step_3" / "actor" / "model.safetensors"))
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    assert bool((on_rng[0] == off_rng[0]).all()) and on_rng[1:] == off_rng[1:]
    rows_on, rows_off = read_metrics(on), read_metrics(off)
    # what reads the diagnostics' output differs (the health monitor's template-collapse rule sees an MI only with
    # them on, and the step recorder keeps the step where it starts firing); everything the update produced is the same
    own = ("collapse", "timing_s/", "health/template_collapse", "record/")
    for r_on, r_off in zip(rows_on, rows_off, strict=True):
        kept = {k: v for k, v in r_on.items() if not k.startswith(own)}
        assert kept == {k: v for k, v in r_off.items() if not k.startswith(own)}
    for row in rows_on[1:]:
        assert row["collapse/first_turn_num_total"] == 4.0 and row["collapse_first_turn_sample/num_samples"] == 3.0
        for key in ("mi_estimate", "mi_seq_estimate", "mi_mixture_estimate", "retrieval_accuracy@2",
                    "mi_zscore_ema", "mi_estimate/ci_low"):
            assert f"collapse_first_turn_sample/{key}" in row, key
        assert "collapse_trajectory_sample/mi_estimate" in row and "timing_s/collapse_multi_turn_step" in row


def test_valid_thinking_rate_counts_turns_with_reasoning():
    from types import SimpleNamespace

    from rldynamics.rollout.batch import RolloutBatch
    from rldynamics.train.diagnostics.collapse import valid_thinking_rate

    texts = {1: "plan</think><answer>Up</answer>", 2: " </think><answer>Up</answer>", 3: "<answer>Up</answer>"}
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "".join(texts[int(i)] for i in ids))
    ids = torch.tensor([[0, 1, 0, 2], [0, 3, 0, 1]])
    mask = torch.tensor([[0.0, 1, 0, 1], [0, 1, 0, 1]])
    batch = RolloutBatch(ids, torch.ones_like(ids), mask, scores=torch.zeros(2), group_ids=torch.arange(2))
    assert valid_thinking_rate(batch, tokenizer) == 0.5  # 4 turns: "plan" twice; blank and missing think text


@pytest.mark.slow
def test_a_resumed_run_continues_the_ema_of_the_uninterrupted_one(fast_overrides):
    common = [*fast_overrides, "train.steps=3", "val.every=0", "collapse_detection.compute_freq=1",
              "collapse.bootstrap_resamples=0", "checkpoint.every=1", "collapse.multi_turn_enabled=false"]
    whole = train(make_config(overrides=[*common, "log.name=whole"]))
    train(make_config(overrides=[*common, "log.name=cut", "train.steps=2"]))
    resumed = train(make_config(overrides=[*common, "log.name=cut", "checkpoint.resume=latest"]))
    head = "collapse_first_turn_sample"
    a, b = read_metrics(whole)[-1], read_metrics(resumed)[-1]
    assert a["step"] == b["step"] == 3 and a[f"{head}/marginal_std"] != a[f"{head}/marginal_std_ema"]  # an EMA
    for key in ("marginal_std_ema", "mi_zscore_ema", "marginal_std_ema_seq"):
        assert b[f"{head}/{key}"] == a[f"{head}/{key}"], key
