"""`rldyn eval`: the trainer's validation of a checkpoint or a model, in a run directory of its own."""

from __future__ import annotations

import json

import pytest

from rldynamics.cli import main
from rldynamics.tracking.run_dir import read_metrics


def test_eval_of_a_checkpoint_reproduces_the_validation_its_run_logged(fast_overrides, tmp_path, capsys):
    assert main(["train", *fast_overrides, "log.name=run"]) == 0
    run = tmp_path / "runs" / "run"
    logged = read_metrics(run)[-1]
    assert logged["step"] == 2
    capsys.readouterr()

    assert main(["eval", str(run / "checkpoints" / "step_2")]) == 0
    out = capsys.readouterr().out
    evaluated = tmp_path / "runs" / "eval_run_step_2"
    [row] = read_metrics(evaluated)
    assert row["step"] == 2  # logged at the checkpoint's step
    for key in ("val-env/sokoban/success", "val-env/sokoban/pass@1", "val-env/sokoban/reward",
                "val-env/sokoban/response_length", "val-reward/box/mean", "val-reward/format_penalty/mean",
                "val-reward/format_penalty/std"):
        assert row[key] == logged[key], key  # the same validation: same seeds, same sampling stream, same weights
    config = (evaluated / "config.yaml").read_text()
    assert str(run / "checkpoints" / "step_2" / "actor") in config
    assert "max_turns: 2" in config  # the run's env settings, not the preset's (5 turns)
    assert "success" in out and "pass@1" in out and "reward component box (mean)" in out
    assert f"run directory: {evaluated}" in out
    assert not (evaluated / "checkpoints").exists()


def test_eval_of_a_model_uses_the_preset_and_overrides_and_never_overwrites(fast_overrides, tmp_path, capsys):
    args = ["eval", "tiny", *fast_overrides, "val.env_groups=2", "val.group_size=2", "log.name=e"]
    assert main(args) == 0
    [row] = read_metrics(tmp_path / "runs" / "e")
    assert row["step"] == 0 and 0.0 <= row["val-env/sokoban/pass@2"] <= 1.0
    assert "val-reward/box/mean" in row and "val-reward/format_penalty/mean" in row
    capsys.readouterr()
    assert main(args) == 2  # the run directory holds a run: one line, nothing written
    assert "already holds a run" in capsys.readouterr().err
    assert len((tmp_path / "runs" / "e" / "metrics.jsonl").read_text().splitlines()) == 1


def test_eval_of_a_checkpoint_without_its_run_config_asks_for_a_preset(fast_overrides, tmp_path, capsys):
    assert main(["train", *fast_overrides, "train.steps=1", "val.every=0", "log.name=r"]) == 0
    (tmp_path / "runs" / "r" / "config.yaml").unlink()
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "runs" / "r" / "checkpoints" / "step_1")]) == 2
    err = capsys.readouterr().err
    assert "config.yaml" in err and "--preset" in err and len(err.strip().splitlines()) == 1


def _trained_checkpoint(fast_overrides, tmp_path, capsys):
    assert main(["train", *fast_overrides, "train.steps=1", "val.every=0", "log.name=r"]) == 0
    capsys.readouterr()
    return tmp_path / "runs" / "r" / "checkpoints" / "step_1"


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_eval_refuses_a_damaged_checkpoint_as_probe_does(fast_overrides, tmp_path, capsys):
    checkpoint = _trained_checkpoint(fast_overrides, tmp_path, capsys)
    weights = checkpoint / "actor" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4000:] = bytes(255 - b for b in data[-4000:])  # flipped bytes, same size, manifest unchanged
    weights.write_bytes(bytes(data))
    assert main(["eval", str(checkpoint)]) == 2
    err = _one_error_line(capsys)
    assert "checksum mismatch" in err and str(weights) in err
    weights.write_bytes(bytes(data[:len(data) // 2]))  # truncated: one line, not a SafetensorError traceback
    assert main(["eval", str(checkpoint)]) == 2
    assert "truncated" in _one_error_line(capsys)
    assert main(["probe", str(checkpoint)]) == 2 and "truncated" in capsys.readouterr().err
    assert not list((tmp_path / "runs").glob("eval_*"))


def test_eval_of_a_run_directory_or_a_missing_checkpoint_says_which_checkpoint_to_give(fast_overrides, tmp_path,
                                                                                      capsys):
    checkpoint = _trained_checkpoint(fast_overrides, tmp_path, capsys)
    assert main(["eval", str(checkpoint.parent.parent)]) == 2  # not "Unrecognized model ... model_type"
    err = _one_error_line(capsys)
    assert "is a run directory" in err and str(checkpoint) in err
    assert main(["eval", str(tmp_path / "runs" / "sokoban-tiny" / "checkpoints" / "step_100")]) == 2
    err = _one_error_line(capsys)
    assert "no checkpoint" in err and "ls runs/" in err and "hub" not in err


def test_ctrl_c_during_eval_is_one_line_and_writes_nothing(fast_overrides, tmp_path, capsys, monkeypatch):
    from rldynamics.train import step

    def interrupted(session):
        raise KeyboardInterrupt

    monkeypatch.setattr(step, "validate", interrupted)
    assert main(["eval", "tiny", *fast_overrides, "log.name=e"]) == 130
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "stopped by Ctrl-C" in err and "nothing was written" in err
    assert not (tmp_path / "runs" / "e" / "metrics.jsonl").exists()
