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
