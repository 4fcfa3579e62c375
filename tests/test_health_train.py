"""The health monitor's actions end to end on the embedded tiny model: a skipped optimizer step leaves the weights
bit-identical, a stop is an early stop with the rule as its reason, a rollback is an exact resume from the last
checkpoint before the trouble (new sampling seeds) with every step once in the run directory and the undone steps
kept under rolled_back/, and a learning rate 100 x the preset's trips the spike rule."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from rldynamics import metric_names as names
from rldynamics.config import make_config
from rldynamics.tracking.run_dir import read_metrics
from rldynamics.train.checkpoint import checkpoint_step, checkpoints
from rldynamics.train.trainer import train

TIMING = "timing_s/"
PRESET = "math-tiny"  # one-turn arithmetic replies whose length component varies: rewards vary from step 1
VARIED = ["train.group_size=3", "env.max_new_tokens=40", "env.max_turns=1", "env.math.length_target=20",
          "val.env_groups=2", "train.mini_batch_size=64", "train.ppo_epochs=1"]  # one optimizer step per step


def _actor(run, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step}" / "actor" / "model.safetensors"))


def _events(run) -> list[dict]:
    file = run / "events.jsonl"
    return [json.loads(line) for line in file.read_text().splitlines()] if file.exists() else []


def _plain(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING)}


def test_a_spike_skip_leaves_the_weights_bit_identical(fast_overrides):
    """grad_spike_k tiny: after the baseline steps every gradient above the median is a spike, refused before the
    optimizer step; the refused step's checkpoint holds exactly the previous step's weights."""
    run = train(make_config(PRESET, overrides=[*fast_overrides, *VARIED, "log.name=skip", "train.steps=8",
                                               "checkpoint.every=1", "val.every=0", "health.baseline_steps=2",
                                               "health.grad_spike_k=1e-6", "health.grad_spike_factor=1",
                                               "health.grad_spike=skip"]))
    rows = {r["step"]: r for r in read_metrics(run)}
    skipped = [s for s in range(2, 9) if rows[s]["actor/skipped_steps"] == 1.0]
    taken = [s for s in range(2, 9) if rows[s]["actor/skipped_steps"] == 0.0]
    assert skipped and taken
    for step in skipped:
        before, after = _actor(run, step - 1), _actor(run, step)
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert rows[step]["health/grad_spike"] == 1.0
    for step in taken:
        before, after = _actor(run, step - 1), _actor(run, step)
        assert not all(torch.equal(before[k], after[k]) for k in before)
    events = [e for e in _events(run) if e["rule"] == "grad_spike"]
    assert events and all(e["action"] == "skip" for e in events) and events[0]["step"] == skipped[0]


def _first_firing(fast_overrides, rule_keys: list[str], rule: str, name: str) -> int:
    run = train(make_config(PRESET, overrides=[*fast_overrides, *VARIED, f"log.name={name}", *rule_keys,
                                               f"health.{rule}=record"]))
    fired = [r["step"] for r in read_metrics(run) if r.get(f"health/{rule}") == 1.0]
    assert fired, f"{rule} never fired in {name}"
    return fired[0]


DIP = ["train.steps=6", "checkpoint.every=1", "val.every=0", "health.baseline_steps=1",
       "health.entropy_collapse_ratio=1.0"]  # fires at the first step whose entropy is below step 1's


def test_a_stop_rule_ends_the_run_as_an_early_stop(fast_overrides):
    k = _first_firing(fast_overrides, DIP, "entropy_collapse", "probe_stop")
    run = train(make_config(PRESET, overrides=[*fast_overrides, *VARIED, "log.name=stop", *DIP,
                                               "health.entropy_collapse=stop"]))
    rows = read_metrics(run)
    assert rows[-1]["step"] == k and rows[-1]["early_stopped/health_entropy_collapse"] == 1.0
    assert (run / "checkpoints" / f"step_{k}").is_dir()
    assert [e["action"] for e in _events(run) if e["rule"] == "entropy_collapse"] == ["stop"]


def test_a_rollback_is_an_exact_resume_with_new_seeds(fast_overrides, tmp_path):
    """Run A rolls back when the rule fires at step k (to checkpoint k-1), re-runs step k with the next attempt's
    sampling seeds, and stops when the rule fires again with no rollback left, its last checkpoint the state of
    step k-1. Run B reaches checkpoint k-1 alone and is resumed as attempt 1: its step k is A's second step k, bit
    for bit."""
    k = _first_firing(fast_overrides, DIP, "entropy_collapse", "probe_back")
    assert k >= 2
    back = [*DIP, "health.entropy_collapse=rollback", "health.max_rollbacks=1"]
    a = train(make_config(PRESET, overrides=[*fast_overrides, *VARIED, "log.name=a", *back]))
    rows = read_metrics(a)
    assert [r["step"] for r in rows] == list(range(0, k + 1)) if rows[0]["step"] == 0 else list(range(1, k + 1))
    undone = [json.loads(line) for line in (a / "rolled_back" / "attempt_1" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in undone] == [k] and undone[0]["health/entropy_collapse"] == 1.0
    assert _plain(undone[0]) != _plain(rows[-1])  # step k again, with new samples
    rollback = [e for e in _events(a) if e["rule"] == "rollback"]
    assert rollback == [{"step": k - 1, "rule": "rollback", "action": "rollback", "from_step": k,
                         "archive": "attempt_1", "message": f"step {k} rolled back"}]
    assert rows[-1]["early_stopped/health_entropy_collapse"] == 1.0  # fired again, no rollback left

    b = train(make_config(PRESET, overrides=[*fast_overrides, *VARIED, "log.name=b", *back, f"train.steps={k - 1}"]))
    shutil.copytree(a / "rolled_back", b / "rolled_back")  # B is now a run that rolled back once
    train(make_config(PRESET, overrides=[*fast_overrides, *VARIED, "log.name=b", *back, "checkpoint.resume=latest"]))
    assert _plain(read_metrics(b)[-1]) == _plain(rows[-1])
    # with no rollback left each run ends with the state from before the trouble as its last checkpoint
    assert [max(checkpoint_step(p) for p in checkpoints(r)) for r in (a, b)] == [k - 1, k - 1]
    wa, wb = _actor(a, k - 1), _actor(b, k - 1)
    assert all(torch.equal(wa[key], wb[key]) for key in wa)


@pytest.mark.slow
def test_a_learning_rate_100_times_the_presets_is_caught_and_stopped(fast_overrides, tmp_path):
    """The default preset with lr 3e-2 (its 3e-4 x 100): the first update moves the policy far off (its KL on its
    own batch and the PPO KL in the second epoch far above their limits: update_kl and policy-drift at step 1);
    with `health.policy_drift=stop` the run ends there as an early stop with that reason. (Left to run, the broken
    policy's entropy collapses or runs up to the uniform one's, depending on the sampled replies.)"""
    run = train(make_config(overrides=[f"log.run_dir={tmp_path}", "log.name=lr100", "log.progress=false",
                                       "log.report=false", "train.lr=3e-2", "train.steps=12", "val.every=0",
                                       "val.before_train=false", "train.env_groups=4", "env.max_new_tokens=24",
                                       "health.policy_drift=stop"]))  # broken replies run to the cap: keep it short
    rows = read_metrics(run)
    events = _events(run)
    assert [(e["rule"], e["step"], e["action"]) for e in events[:2]] == [("update_kl", 1, "warn"),
                                                                         ("policy_drift", 1, "stop")]
    assert rows[-1]["early_stopped/health_policy_drift"] == 1.0 and rows[-1]["step"] == 1


@pytest.mark.slow
def test_the_default_preset_raises_nothing_above_record(fast_overrides, tmp_path):
    """Six steps of the default preset as shipped (its packaged warm start), two validations; too short to learn,
    so the no-learning verdict is only recorded."""
    run = train(make_config(overrides=[f"log.run_dir={tmp_path}", "log.name=healthy", "log.progress=false",
                                       "log.report=false", "train.steps=6", "val.every=3", "val.env_groups=16",
                                       "health.no_learning=record"]))
    assert [e for e in _events(run) if e["action"] != "record"] == []


def test_the_same_batch_entropy_change_is_read_only_and_zero_without_an_update(fast_overrides):
    """`health.entropy_after_update`: one more forward after the update; with lr 0 the weights do not move, so the
    batch's entropy after equals its entropy before exactly; with lr > 0 the run ends with the weights of the run
    without the measurement."""
    common = [*fast_overrides, *VARIED, "train.steps=3", "checkpoint.every=3", "val.every=0"]
    still = train(make_config(PRESET, overrides=[*common, "log.name=still", "train.lr=0",
                                                 "health.entropy_after_update=true"]))
    assert [r["actor/entropy_change_same_batch"] for r in read_metrics(still)[1:]] == [0.0, 0.0, 0.0]
    on = train(make_config(PRESET, overrides=[*common, "log.name=on", "health.entropy_after_update=true"]))
    off = train(make_config(PRESET, overrides=[*common, "log.name=off"]))
    moved = [r["actor/entropy_change_same_batch"] for r in read_metrics(on)[1:]]
    # a step whose groups carry no reward signal moves the weights by weight decay alone, which can leave the
    # entropy unchanged to float resolution; the steps with a signal move it
    assert any(v != 0.0 for v in moved)
    a, b = _actor(on, 3), _actor(off, 3)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_validation_rules_start_from_the_validation_before_training(fast_overrides):
    """`no_learning` compares each validation with the one before step 1 (not with the first one during training):
    its threshold is that start plus 1 standard error of the difference, each validation's clustered
    by problem (`val-env/<env>/success_se`, logged with the validation)."""
    run = train(make_config(PRESET, overrides=[*fast_overrides, *VARIED, "log.name=start", "val.env_groups=32",
                                               "train.steps=2", "val.every=1", "health.no_learning_after=0.5",
                                               "model.warm_start_episodes=512", "model.warm_start_epochs=2",
                                               "seed=2"]))  # a seed whose first validations differ
    success = names.val_success("math")
    se_key = names.env_metric("math", names.SUCCESS_SE, validation=True)
    val = {r["step"]: (r[success], r[se_key]) for r in read_metrics(run) if success in r}
    assert sorted(val) == [0, 1, 2]
    fired = [e for e in _events(run) if e["rule"] == "no_learning"]
    assert val[0][0] != val[1][0]  # a start the first validation in training could not stand in for
    limit = val[0][0] + (val[0][1] ** 2 + val[1][1] ** 2) ** 0.5  # at step 1 (progress 0.5)
    assert val[1][0] <= limit and fired and fired[0]["step"] == 1  # (6.2 % before, 3.1 % at step 1)
    assert fired[0]["threshold"] == pytest.approx(limit, abs=1e-5)
