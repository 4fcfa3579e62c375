"""Step records and `rldyn replay` on the embedded tiny model: a recorded step replayed from the checkpoint before it
ends with bit-identical weights and the same loss and gradient norm (also when the run has to be rolled forward to
the step before, and when the health monitor refused an optimizer step); a what-if replay with a tenth of the
learning rate makes a tenth of the update in the same direction; records hold what the step trained on; damaged or
missing records are one clear line; resumes drop and pruning removes records like the other per-step files."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rldynamics.algo.advantages import grpo_advantages
from rldynamics.cli import main
from rldynamics.config import make_config
from rldynamics.models.loading import load_model_and_tokenizer
from rldynamics.tracking.run_dir import RunWriter, read_rewards
from rldynamics.tracking.step_records import (
    RecordError,
    prune_records,
    read_record,
    record_path,
    record_step,
    records,
    write_record,
)
from rldynamics.train.record_io import weights_digest
from rldynamics.train.replay import replay_command
from rldynamics.train.trainer import train

PRESET = "math-tiny"  # one-turn arithmetic whose length component varies: rewards vary from step 1
VARIED = ["train.group_size=3", "env.max_new_tokens=40", "env.max_turns=1", "env.math.length_target=20",
          "val.env_groups=2", "val.every=0"]
ONE_STEP = ["train.mini_batch_size=64", "train.ppo_epochs=1"]  # one optimizer step per step, on the rollout policy
SEVERAL = ["train.mini_batch_size=2", "train.ppo_epochs=2"]  # several optimizer steps, old-log-prob pass


def _run(fast_overrides, name: str, *keys: str):
    return train(make_config(PRESET, overrides=[*fast_overrides, *VARIED, f"log.name={name}", *keys]))


def _replayed(run, step: int, *overrides: str, attribute: bool = False) -> dict:
    out = replay_command(run, step, list(overrides), attribute=attribute)
    return json.loads((out / "replay.json").read_text())


@pytest.mark.parametrize("update", [ONE_STEP, SEVERAL], ids=["one_step", "several_steps"])
def test_a_recorded_step_replays_to_bit_identical_weights(fast_overrides, update):
    run = _run(fast_overrides, "exact", *update, "train.steps=3", "checkpoint.every=1", "record.every=1")
    assert [record_step(p) for p in records(run)] == [1, 2, 3]
    summary = _replayed(run, 3)
    assert summary["start"].endswith("checkpoints/step_2")
    assert summary["weights_identical"] is True and summary["metrics_identical"] is True
    assert summary["kept_rows_identical"] is True
    # the record's digest is that of the weights the run saved after the step (independent of the replay)
    _, meta = read_record(record_path(run, 3))
    model, _ = load_model_and_tokenizer(str(run / "checkpoints" / "step_3" / "actor"), device="cpu")
    assert weights_digest(model) == meta["weights_after"] == summary["weights_after"]


def test_a_step_the_gradient_analysis_ran_on_replays_its_kl_with_the_term_off(fast_overrides):
    """With the KL term off the analysis still loads the reference (it measures the KL gradient), so the step
    logged the KL to it (k1: k3 rounds to 0 in float32 this close to the reference); the replay loads the reference
    for that pass too and logs the same KL, not 0."""
    run = _run(fast_overrides, "analysed", *ONE_STEP, "train.steps=2", "checkpoint.every=1", "record.every=1",
               "algo.kl_coef=0", "algo.kl_type=k1", "analysis.enabled=true", "analysis.every=1",
               "analysis.num_buckets=1")
    summary = _replayed(run, 2)
    assert summary["metrics"]["actor/kl_loss"]["recorded"] != 0
    assert summary["weights_identical"] is True and summary["metrics_identical"] is True, summary["metrics"]


def test_a_step_without_a_checkpoint_before_it_is_reached_by_rolling_forward(fast_overrides):
    run = _run(fast_overrides, "roll", *ONE_STEP, "train.steps=3", "record.steps=[3]", "record.every=0",
               "record.state_before_mb=0")  # no state kept beside the record
    assert not (run / "checkpoints" / "step_2").exists()
    summary = _replayed(run, 3)
    assert "roll_forward" in summary["start"]
    assert summary["weights_identical"] is True and summary["metrics_identical"] is True
    summary = _replayed(run, 3)  # the rolled-forward checkpoint is reused
    assert summary["weights_identical"] is True


def test_a_what_if_with_a_tenth_of_the_learning_rate_makes_a_tenth_of_the_update(fast_overrides):
    run = _run(fast_overrides, "whatif", *ONE_STEP, "train.steps=2", "checkpoint.every=1", "record.every=1")
    lr = make_config(PRESET).train.lr
    summary = _replayed(run, 2, f"train.lr={lr / 10}")
    what_if = summary["what_if"]
    norms = what_if["update_norm"]
    # Adam from the same moments: the step is proportional to the learning rate (weight decay too)
    assert norms["what_if"] == pytest.approx(norms["as_recorded"] / 10, rel=1e-4)
    assert what_if["update_cosine"] == pytest.approx(1.0, abs=1e-5)
    grad = what_if["metrics"]["actor/grad_norm"]
    assert grad["what_if"] == grad["as_recorded"]  # the same gradient, a smaller step
    assert summary["weights_identical"] is True
    kept = _replayed(run, 2, "filter.strategy=top_k_abs", "filter.value=1")["what_if"]["kept_rows"]
    assert kept == {"as_recorded": 6, "what_if": 3}  # 2 groups of 3; the what-if's filter keeps one group


def test_a_refused_spike_is_refused_again_in_the_replay(fast_overrides):
    run = _run(fast_overrides, "spike", *ONE_STEP, "train.steps=8", "checkpoint.every=1", "record.every=0",
               "health.baseline_steps=2", "health.grad_spike_k=1e-6", "health.grad_spike_factor=1",
               "health.grad_spike=skip")
    alarmed = {record_step(p): read_record(p)[1] for p in records(run)}
    spikes = [n for n, meta in alarmed.items() if "alarm:grad_spike" in meta["reasons"]]
    assert spikes, "the spike rule recorded no step"
    step = spikes[0]
    assert alarmed[step]["update"]["steps"][0]["refused"] is True
    summary = _replayed(run, step)
    assert summary["weights_identical"] is True  # the refused step changed nothing, in the run and in the replay
    before, _ = load_model_and_tokenizer(str(run / "checkpoints" / f"step_{step - 1}" / "actor"), device="cpu")
    assert summary["weights_after"] == weights_digest(before)


def test_a_record_holds_what_the_step_trained_on(fast_overrides):
    run = _run(fast_overrides, "contents", *ONE_STEP, "train.steps=2", "record.every=2")
    tensors, meta = read_record(record_path(run, 2))
    n = len(meta["env_seeds"])
    totals = [r["total"] for r in read_rewards(run) if r["step"] == 2]
    assert np.allclose(tensors["scores"], totals) and tensors["scores"].shape == (n,)
    assert meta["reasons"] == ["every"] and meta["reward_names"] and len(meta["env_metrics"]) == n
    mask = tensors["response_mask"].astype(bool)
    kept = tensors["kept_rows"]
    assert kept.tolist() == list(range(n))  # the preset's filter keeps every group
    assert not tensors["rollout_logprobs"][~mask].any() and (tensors["rollout_logprobs"][mask] < 0).all()
    expected = grpo_advantages(torch.from_numpy(tensors["scores"]), torch.from_numpy(tensors["group_ids"]),
                               torch.from_numpy(mask[kept].astype(np.float32)), norm_by_std=True)
    assert np.allclose(tensors["advantages"], expected.numpy(), atol=1e-6)
    for name in ("trainer_logprobs", "entropy"):  # the single-pass update's own forward, kept
        assert tensors[name].shape == mask[kept].shape and tensors[name][mask[kept]].any()
    # the sampler and the trainer compute in float32 on one machine: their log-probs agree
    assert np.abs(tensors["trainer_logprobs"] - tensors["rollout_logprobs"][kept]).max() < 1e-3
    assert set(meta["pieces"]) == {str(t) for t in np.unique(tensors["input_ids"][tensors["attention_mask"] > 0])}


def test_a_damaged_or_missing_record_is_one_line(fast_overrides, capsys):
    run = _run(fast_overrides, "damaged", *ONE_STEP, "train.steps=2", "record.every=1", "checkpoint.every=1")
    path = record_path(run, 2)
    path.write_bytes(path.read_bytes()[:100])
    assert main(["replay", str(run), "--step", "2"]) == 2
    err = capsys.readouterr()
    line = (err.out + err.err).strip().splitlines()[-1]
    assert "step_2.safetensors" in line and "not a readable step record" in line
    assert main(["replay", str(run), "--step", "5"]) == 2
    err = capsys.readouterr()
    assert "no such step record" in (err.out + err.err)
    with pytest.raises(RecordError):
        read_record(path)


def test_a_resume_drops_and_pruning_removes_records(tmp_path):
    run = tmp_path / "run"
    tiny = {"input_ids": np.zeros((1, 2), np.int32), "attention_mask": np.ones((1, 2), np.uint8),
            "response_mask": np.array([[0, 1]], np.uint8), "scores": np.zeros(1, np.float32),
            "group_ids": np.zeros(1, np.int64), "kept_rows": np.zeros(1, np.int64),
            "advantages": np.array([[0.0, 2.5]], np.float32)}
    for step in range(1, 6):
        write_record(run, step, tiny, {"reasons": ["every"]})
    tensors, _ = read_record(record_path(run, 3))
    assert tensors["advantages"].tolist() == [[0.0, 2.5]]  # packed on the response mask and unpacked
    RunWriter(run).truncate_after(4)
    assert [record_step(p) for p in records(run)] == [1, 2, 3, 4]
    gone = prune_records(run, keep_last=2, keep={1})
    assert [record_step(p) for p in gone] == [2] and [record_step(p) for p in records(run)] == [1, 3, 4]


def test_a_planted_outlier_reads_first_in_the_attribution(fast_overrides, capsys):
    """One reply's reward made huge in the record, every other reply's 0: its advantage dominates (twice each of
    its group mates', the other group none), and the attribution puts that reply first among the replies and its
    group first among the groups; the shares add up to the whole gradient."""
    run = _run(fast_overrides, "outlier", *ONE_STEP, "train.steps=2", "checkpoint.every=1", "record.every=1")
    tensors, meta = read_record(record_path(run, 2))
    planted = 4
    tensors["scores"][:] = 0.0
    tensors["scores"][planted] = 50.0
    write_record(run, 2, tensors, {k: v for k, v in meta.items() if k not in ("format", "step")})
    assert main(["replay", str(run), "--step", "2", "--attribute"]) == 0
    assert f"row {planted} (group" in capsys.readouterr().out.split("attribution of step 2")[1].splitlines()[1]
    data = json.loads((run / "replays" / "step_2" / "attribution.json").read_text())
    rows = sorted(data["rows"], key=lambda r: -r["share"])
    assert rows[0]["row"] == planted
    group = int(tensors["group_ids"][planted])
    assert max(data["groups"], key=lambda g: g["share"])["group"] == group
    assert sum(r["share"] for r in data["rows"]) == pytest.approx(1.0, abs=1e-5)
    assert data["tokens"][str(planted)] and all(tensors["response_mask"][planted, p] for p, _ in
                                                 data["tokens"][str(planted)])
    replay_command(run, 2, ["train.lr=1e-6"])  # a later replay without --attribute keeps the attribution
    assert json.loads((run / "replays" / "step_2" / "attribution.json").read_text()) == data


def _last_line(capsys) -> str:
    err = capsys.readouterr()
    return (err.out + err.err).strip().splitlines()[-1]


def _without_run(path) -> None:
    """Rewrite the record at `path` as one written before records named their run."""
    tensors, meta = read_record(path)
    kept = {k: v for k, v in meta.items() if k not in ("format", "step", "run")}
    write_record(path.parent.parent, record_step(path), tensors, kept)


def test_a_record_of_another_run_is_refused_naming_both(fast_overrides, capsys):
    """A seed-1 twin's record (same shapes) is refused by the run identity; one written without it,
    by its sampling seed; a record of a run with another group size written without it, by the shape
    of the rollout; the run's own record without it still replays."""
    keys = [*ONE_STEP, "train.steps=2", "checkpoint.every=1", "record.every=1"]
    run = _run(fast_overrides, "mine", *keys)
    twin = _run(fast_overrides, "twin", *keys, "seed=1")
    (run / "records" / "step_2.safetensors").write_bytes(record_path(twin, 2).read_bytes())
    assert main(["replay", str(run), "--step", "2"]) == 2
    line = _last_line(capsys)
    assert "another run" in line and "'twin'" in line and "'mine'" in line
    assert not (run / "replays").exists()
    wide = _run(fast_overrides, "wide", *keys, "train.group_size=4")
    (run / "records" / "step_2.safetensors").write_bytes(record_path(wide, 2).read_bytes())
    _without_run(record_path(run, 2))
    assert main(["replay", str(run), "--step", "2"]) == 2
    line = _last_line(capsys)
    assert "8 trajectories" in line and "6 (train.env_groups 2 x train.group_size 3)" in line
    (run / "records" / "step_2.safetensors").write_bytes(record_path(twin, 2).read_bytes())
    _without_run(record_path(run, 2))
    assert main(["replay", str(run), "--step", "2"]) == 2
    assert "sampling seed" in _last_line(capsys)
    own = _run(fast_overrides, "own", *keys)
    _without_run(record_path(own, 2))
    assert _replayed(own, 2)["weights_identical"] is True


def test_a_resumed_run_keeps_its_run_id(fast_overrides):
    keys = [*ONE_STEP, "checkpoint.every=1", "record.every=1"]
    run = _run(fast_overrides, "kept", *keys, "train.steps=2")
    _run(fast_overrides, "kept", *keys, "train.steps=3", "checkpoint.resume=latest")
    ids = {read_record(p)[1]["run"]["id"] for p in records(run)}
    assert len(records(run)) == 3 and ids == {(run / "run_id").read_text().strip()}
    assert _replayed(run, 3)["weights_identical"] is True


def test_a_what_if_that_cannot_apply_is_refused_before_any_work(fast_overrides, capsys):
    run = _run(fast_overrides, "refused", *ONE_STEP, "train.steps=2", "record.every=1")
    for item in ("train.group_size=4", "train.env_groups=3", "model.lora.rank=4",
                 "env.max_new_tokens=10", "seed=1", "train.temperature=0.5", "val.every=5"):
        assert main(["replay", str(run), "--step", "2", item]) == 2, item
        line = _last_line(capsys)
        assert f"what-if {item}" in line and "train.lr" in line and "filter." in line, line
    assert main(["replay", str(run), "--step", "2", "algo.adv_estimator=gae"]) == 2
    assert "cannot add a critic the run did not train" in _last_line(capsys)
    assert not (run / "replays").exists()  # nothing rolled forward, nothing replayed


def test_an_interrupted_replay_keeps_the_earlier_results(fast_overrides, capsys, monkeypatch):
    from rldynamics.train import replay

    run = _run(fast_overrides, "ctrlc", *ONE_STEP, "train.steps=2", "checkpoint.every=1",
               "record.every=1")
    replay_command(run, 2, [], attribute=True)
    out = run / "replays" / "step_2"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "attribution.json" in before and "replay.json" in before

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(replay.stages, "actor_update", interrupted)
    capsys.readouterr()
    assert main(["replay", str(run), "--step", "2"]) == 130
    line = _last_line(capsys)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert "nothing was written" not in line and "complete" in line
    assert [p.name for p in (run / "replays").iterdir()] == ["step_2"]  # no partial directory left


@pytest.mark.parametrize("update", [ONE_STEP, SEVERAL], ids=["one_step", "several_steps"])
def test_the_attribution_says_how_its_gradient_relates_to_the_recorded_norm(fast_overrides, capsys,
                                                                            update):
    run = _run(fast_overrides, "norms", *update, "train.steps=2", "checkpoint.every=1",
               "record.every=1")
    capsys.readouterr()
    assert main(["replay", str(run), "--step", "2", "--attribute"]) == 0
    text = capsys.readouterr().out
    attribution = run / "replays" / "step_2" / "attribution.json"
    attributed = json.loads(attribution.read_text())["grad_norm"]
    _, meta = read_record(record_path(run, 2))
    steps = meta["update"]["steps"]
    if update is ONE_STEP:
        assert len(steps) == 1 and attributed == pytest.approx(steps[0]["grad_norm"], rel=1e-5)
        assert "one optimizer step over the whole batch" in text and "float32 rounding" in text
    else:
        assert len(steps) == 6  # 2 epochs x 3 mini-batches of 2 of the 6 replies
        assert "6 optimizer steps (2 epochs x 3 mini-batches of at most 2 replies)" in text
        assert "mean of their pre-clip norms" in text


def test_a_replay_with_attribute_rewrites_the_runs_report(fast_overrides):
    run = _run(fast_overrides, "report", *ONE_STEP, "train.steps=2", "checkpoint.every=1",
               "record.every=1", "log.report=true")
    marker = "Gradient attribution (replays/step_2/attribution.json"
    assert marker not in (run / "report.html").read_text()
    replay_command(run, 2, [], attribute=True)
    assert marker in (run / "report.html").read_text()
