"""Off-policy rollouts (`rollout.staleness`, `rollout.overlap`, `train/lagged.py`): step t's batch is sampled with
the weights after step t - 1 - N, checked against the checkpoints by an independent forward; a rollout generated in
a second thread during the update gives the run its sequential control makes, bit for bit; a run stopped and
resumed samples what an uninterrupted one does; the settings that cannot go together are refused."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import FAST
from rldynamics.analysis.health_rules import Mismatch, Signals
from rldynamics.config import ConfigError, HealthConfig, make_config
from rldynamics.models.precision import compute_in, enable_checkpointing
from rldynamics.tracking.run_dir import read_metrics
from rldynamics.tracking.step_records import RecordedStep, record_path
from rldynamics.train.lagged import LaggedPolicy, version_of
from rldynamics.train.replay import replay_command
from rldynamics.train.setup import check_world
from rldynamics.train.trainer import train

LAG = ["rollout.staleness=1", "train.row_seeded_sampling=true", "train.steps=4", "val.every=2", "checkpoint.every=1",
       "record.every=1", "train.lr=1e-2"]


def _plain(rows: list[dict]) -> list[dict]:
    """The rows without timings and the record's size (a record names its run directory)."""
    return [{k: v for k, v in r.items() if not k.startswith("timing_s/") and k != "record/bytes"} for r in rows]


def _lines(file: Path) -> list[dict]:
    return [json.loads(line) for line in file.read_text().splitlines()]


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / f"checkpoints/step_{step}/actor/model.safetensors"))


def test_version_of_lags_by_the_staleness_and_starts_at_the_first_weights():
    assert [version_of(t, 0) for t in range(1, 5)] == [0, 1, 2, 3]
    assert [version_of(t, 1) for t in range(1, 5)] == [0, 0, 1, 2]
    assert [version_of(t, 3) for t in range(1, 7)] == [0, 0, 0, 0, 1, 2]


def test_the_sampler_holds_the_lagged_version_and_keeps_only_what_later_steps_need():
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    lagged = LaggedPolicy(2, model, start=0)
    for step in (1, 2, 3):
        assert torch.equal(lagged.model_for(step).weight, torch.zeros(1, 2))  # version 0 until step 4
        with torch.no_grad():
            model.weight.fill_(float(step))  # "the update" of step
        lagged.keep(step, model)
    assert sorted(lagged.versions) == [1, 2, 3]  # step 4 samples version 1, later steps 2 and 3
    assert torch.equal(lagged.model_for(4).weight, torch.full((1, 2), 1.0))
    assert sorted(lagged.saved(3)) == [1, 2] and model.weight.requires_grad
    assert not lagged.sampler.weight.requires_grad
    with pytest.raises(ValueError, match=r"versions \[3\] are not kept"):
        LaggedPolicy(2, model, start=5, history={4: lagged.versions[2]})


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x, **kwargs):  # a transformer block's cache keywords
        return self.linear(x)


class _Net(torch.nn.Module):
    _no_split_modules = ["_Block"]

    def __init__(self):
        super().__init__()
        self.block = _Block()

    def forward(self, x):
        return self.block(x)


def test_the_sampler_of_a_mixed_precision_checkpointed_model_computes_with_its_own_weights():
    # the wrappers that compute_in and enable_checkpointing put on `forward` must follow a deep copy: closures over
    # the original's bound methods made a bfloat16 sampler compute with the trainer's current weights
    model = enable_checkpointing(compute_in(_Net(), "bfloat16"))
    lagged = LaggedPolicy(1, model, start=0)
    x = torch.ones(2, 4)
    before = lagged.model_for(1)(x)
    with torch.no_grad():
        model.block.linear.weight.add_(1.0)  # the trainer's update
    assert torch.equal(lagged.model_for(2)(x), before)  # step 2 still samples version 0
    assert not torch.equal(model(x), before)
    assert model(x).dtype == torch.bfloat16 and lagged.sampler(x).dtype == torch.bfloat16


@pytest.fixture(scope="module")
def lagged_runs(tmp_path_factory, tiny_cache):
    """The default (multi-turn) preset 4 steps at staleness 1, sequential and with the rollouts overlapped."""
    mp = pytest.MonkeyPatch()
    mp.setenv("RLDYN_CACHE", tiny_cache)
    runs = tmp_path_factory.mktemp("lagged")
    out = {name: train(make_config(overrides=[*FAST, f"log.run_dir={runs}", *LAG, f"rollout.overlap={overlap}",
                                              f"log.name={name}"]))
           for name, overlap in (("sequential", "false"), ("overlapped", "true"))}
    mp.undo()
    return out


def test_an_overlapped_run_equals_its_sequential_control_bit_for_bit(lagged_runs):
    seq, ov = lagged_runs["sequential"], lagged_runs["overlapped"]
    assert _plain(read_metrics(ov)) == _plain(read_metrics(seq))
    assert _lines(ov / "rewards.jsonl") == _lines(seq / "rewards.jsonl")
    a, b = _weights(seq, 4), _weights(ov, 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = {r["step"]: r for r in read_metrics(ov)}
    assert [rows[t]["rollout/policy_version"] for t in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert [rows[t]["rollout/staleness"] for t in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert all("timing_s/gen_wait" in rows[t] for t in (2, 3, 4)) and "timing_s/gen_wait" not in rows[1]
    assert {r["policy_version"] for r in _lines(ov / "rewards.jsonl") if r["step"] == 3} == {1}
    assert (ov / "checkpoints/step_3/sampler.pt").is_file()


def _sampled_logprobs(model_dir: Path, record: RecordedStep) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probs [tokens] of the record's sampled tokens under the weights in `model_dir` (a plain forward, no
    trainer code) beside the ones the rollout sampled them with."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.as_tensor(record.input_ids).long()
    attention = torch.as_tensor(record.attention_mask).long()
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits.float()
    mine = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]  # [N, L - 1]
    wanted = torch.as_tensor(record.response_mask)[:, 1:].bool()
    return mine[wanted], torch.as_tensor(record.rollout_logprobs)[:, 1:][wanted]


def test_step_3_at_staleness_1_is_sampled_by_the_weights_after_step_1(lagged_runs):
    run = lagged_runs["overlapped"]
    record = RecordedStep.read(record_path(run, 3))
    assert record.policy_version == 1
    after_1, sampled = _sampled_logprobs(run / "checkpoints/step_1/actor", record)
    after_2, _ = _sampled_logprobs(run / "checkpoints/step_2/actor", record)
    assert (after_1 - sampled).abs().max() < 1e-5
    assert (after_2 - sampled).abs().max() > 1e-4  # the trainer's weights at the update are not the sampler's


def test_a_killed_run_resumes_sampling_what_an_uninterrupted_one_does(fast_overrides):
    lag = [*LAG, "rollout.staleness=2", "rollout.overlap=true", "train.steps=5", "model.threads=1"]
    straight = train(make_config(overrides=[*fast_overrides, *lag, "log.name=straight"]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLDYN_CRASH_AT": "logged:4"}  # killed after step 4's row
    args = [sys.executable, "-m", "rldynamics.cli", "train", *fast_overrides, *lag, "log.name=resumed"]
    assert subprocess.run(args, env=env, capture_output=True, timeout=600).returncode == -signal.SIGKILL
    resumed = straight.parent / "resumed"
    assert sorted(torch.load(resumed / "checkpoints/step_3/sampler.pt")) == [1, 2]
    train(make_config(overrides=[*fast_overrides, *lag, "log.name=resumed", "checkpoint.resume=latest"]))
    assert [r["step"] for r in read_metrics(resumed)] == [0, 1, 2, 3, 4, 5]
    assert _plain(read_metrics(resumed)) == _plain(read_metrics(straight))
    a, b = _weights(straight, 5), _weights(resumed, 5)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_step_of_a_lagged_run_replays_to_bit_identical_weights_and_rolls_forward(lagged_runs, tmp_path):
    run = shutil.copytree(lagged_runs["sequential"], tmp_path / "sequential")
    for step in (3, 4):
        summary = json.loads((replay_command(run, step, []) / "replay.json").read_text())
        assert summary["weights_identical"] is True and summary["metrics_identical"] is True
    shutil.rmtree(run / "checkpoints/step_2")  # step 3 then starts from a retraining of step 2
    summary = json.loads((replay_command(run, 3, []) / "replay.json").read_text())
    assert summary["weights_identical"] is True
    assert (run / "replays/roll_forward/checkpoints/step_2/sampler.pt").is_file()  # it sampled with the lag too


@pytest.mark.parametrize(("overrides", "says"), [
    (["rollout.overlap=true", "train.row_seeded_sampling=true"], "needs rollout.staleness >= 1"),
    (["rollout.overlap=true", "rollout.staleness=1"], "needs train.row_seeded_sampling=true"),
    (["rollout.staleness=1", "rollout.sync_every=2"], "give one of them"),
    (["rollout.staleness=9"], "rollout.staleness must be >= 0 and <= 8"),
])
def test_settings_that_cannot_go_together_are_refused(overrides, says):
    with pytest.raises(ConfigError, match=says):
        make_config(overrides=overrides)


def test_staleness_is_refused_on_several_ranks():
    with pytest.raises(ConfigError, match="runs in one process"):
        check_world(make_config(overrides=["rollout.staleness=1"]), ranks=2)


def test_the_mismatch_rule_says_the_sampler_is_behind():
    rule = Mismatch(HealthConfig())
    alarm = rule.check(Signals(step=3, progress=0.5, mismatch_kl=0.05, staleness=2))
    assert "2 updates behind" in alarm.message and "algo.tis_cap" in alarm.message
    assert "behind" not in rule.check(Signals(step=3, progress=0.5, mismatch_kl=0.05)).message
