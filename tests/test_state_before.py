"""The state before a recorded step, kept beside its record (`records/step_<N>.before/`): a replay starts from it
instead of training the run again, bit-identically; it is written only where the run keeps no checkpoint of the
step before; it costs what `state_bytes` says; pruning, resumes and rollbacks treat it like the record."""

from __future__ import annotations

import json

import pytest

from rldynamics.config import make_config
from rldynamics.models.loading import load_model_and_tokenizer
from rldynamics.tracking.step_records import prune_records, read_record, record_path, state_before_path
from rldynamics.train.checkpoint import read_trainer_state, state_bytes, verify_checkpoint
from rldynamics.train.replay import replay_command
from rldynamics.train.trainer import train

PRESET = "math-tiny"
SMALL = ["train.group_size=3", "env.max_new_tokens=40", "env.max_turns=1", "env.math.length_target=20",
         "val.env_groups=2", "val.every=0", "train.mini_batch_size=64", "train.ppo_epochs=1"]


def _run(fast_overrides, name: str, *keys: str):
    return train(make_config(PRESET, overrides=[*fast_overrides, *SMALL, f"log.name={name}", *keys]))


def test_a_replay_starts_from_the_state_kept_beside_the_record(fast_overrides):
    run = _run(fast_overrides, "kept", "train.steps=4", "record.every=0", "record.steps=[3]")
    state = state_before_path(run, 3)
    assert verify_checkpoint(state)["step"] == 2  # a whole checkpoint of the step before
    assert read_record(record_path(run, 3))[1]["state_before"] is True
    out = replay_command(run, 3, [])
    summary = json.loads((out / "replay.json").read_text())
    assert summary["start"] == str(state)
    assert summary["weights_identical"] is True and summary["metrics_identical"] is True
    assert not (run / "replays" / "roll_forward").exists()  # nothing trained again


def test_no_state_is_kept_where_a_checkpoint_holds_it_or_the_limit_rules_it_out(fast_overrides):
    run = _run(fast_overrides, "ckpt", "train.steps=3", "record.every=0", "record.steps=[3]", "checkpoint.every=1")
    assert not state_before_path(run, 3).exists()
    assert read_record(record_path(run, 3))[1]["state_before"] is False
    run = _run(fast_overrides, "off", "train.steps=3", "record.every=0", "record.steps=[3]",
               "record.state_before_mb=0.001")
    assert not state_before_path(run, 3).exists()
    run = _run(fast_overrides, "first", "train.steps=1", "record.every=1")
    assert not state_before_path(run, 1).exists()  # step 1 starts from the base model


def test_the_state_costs_what_state_bytes_says(fast_overrides):
    run = _run(fast_overrides, "size", "train.steps=3", "record.every=0", "record.steps=[3]")
    written = sum(p.stat().st_size for p in state_before_path(run, 3).rglob("*.safetensors"))
    written += (state_before_path(run, 3) / "optimizer.pt").stat().st_size
    model, _ = load_model_and_tokenizer(str(state_before_path(run, 3) / "actor"), device="cpu")
    # weights (float32) + two AdamW moments per trained parameter, within the files' headers and configs
    assert written == pytest.approx(state_bytes(model), rel=0.05)


def test_pruning_and_resumes_remove_the_state_with_its_record(fast_overrides):
    run = _run(fast_overrides, "prune", "train.steps=4", "record.every=2", "checkpoint.every=0")
    assert state_before_path(run, 2).is_dir() and state_before_path(run, 4).is_dir()
    prune_records(run, keep_last=1)
    assert not state_before_path(run, 2).exists() and state_before_path(run, 4).is_dir()
    again = _run(fast_overrides, "resumed", "train.steps=4", "record.every=2", "checkpoint.every=2")
    assert state_before_path(again, 2).is_dir() and state_before_path(again, 4).is_dir()
    # resumed from step 2 without records: what was written for steps 3-4 is dropped, step 2's stays
    train(make_config(PRESET, overrides=[*fast_overrides, *SMALL, "log.name=resumed", "train.steps=4",
                                         "record.every=0", "record.on_alarm=false", "checkpoint.every=2",
                                         f"checkpoint.resume={again / 'checkpoints' / 'step_2'}"]))
    assert read_trainer_state(again / "checkpoints" / "step_4")["step"] == 4
    assert state_before_path(again, 2).is_dir() and not state_before_path(again, 4).exists()
