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
    from rldynamics.train import stages

    def interrupted(session):
        raise KeyboardInterrupt

    monkeypatch.setattr(stages, "validate", interrupted)
    assert main(["eval", "tiny", *fast_overrides, "log.name=e"]) == 130
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "stopped by Ctrl-C" in err and "nothing was written" in err
    assert not (tmp_path / "runs" / "e" / "metrics.jsonl").exists()


DEFAULT_MODEL_RUN = [  # the default's env and warm start (shipped with the package), a short run
    "train.steps=2", "train.env_groups=2", "train.group_size=2", "train.mini_batch_size=2",
    "train.micro_batch_size=1", "val.env_groups=32", "val.every=2", "val.before_train=false",
    "log.progress=false", "log.samples_per_step=1", "log.report=false", "analysis.enabled=false",
]


def test_eval_of_a_tiny_checkpoint_computes_as_its_run_where_bfloat16_is_fast(
        fast_overrides, tmp_path, capsys, monkeypatch):
    """`model.dtype=auto` knows the tiny model in its checkpoints too: on a device fast in bfloat16
    the run computes in float32, and so does the eval of its checkpoint, which reproduces the run's
    validation exactly."""
    from rldynamics.models.hardware import Bf16Speed
    from rldynamics.train import setup

    fast = Bf16Speed("cpu", "AMX", fast=True, factor=2.5)
    monkeypatch.setattr(setup, "bf16_speed", lambda *a, **k: fast)
    run_dir = [o for o in fast_overrides if o.startswith("log.run_dir=")]
    assert main(["train", *run_dir, *DEFAULT_MODEL_RUN, "log.name=run"]) == 0
    run = tmp_path / "runs" / "run"
    logged = read_metrics(run)[-1]
    capsys.readouterr()
    assert main(["eval", str(run / "checkpoints" / "step_2")]) == 0
    assert "compute float32" in capsys.readouterr().out
    [row] = read_metrics(tmp_path / "runs" / "eval_run_step_2")
    keys = [k for k in logged if k.startswith(("val-env/", "val-reward/"))]
    assert "val-env/sokoban/success" in keys
    assert {k: row[k] for k in keys} == {k: logged[k] for k in keys}


def _fake_checkpoint(root, adapter: bool):
    """A run directory with config.yaml and a checkpoint whose actor is a whole model or a LoRA
    adapter (only what `rldyn eval` reads before loading anything)."""
    from rldynamics.config import make_config, save_config

    run = root / "runs" / "r"
    checkpoint = run / "checkpoints" / "step_12"
    (checkpoint / "actor").mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 12}))
    (checkpoint / "actor" / ("adapter_config.json" if adapter else "config.json")).write_text("{}")
    lora = ["model.lora.rank=4"] if adapter else []
    save_config(make_config(overrides=lora), run / "config.yaml")
    return checkpoint


@pytest.mark.parametrize("adapter", [False, True])
def test_eval_of_a_checkpoint_refuses_another_model_path(tmp_path, capsys, adapter):
    """`model.path=tiny` on a checkpoint would evaluate the base model under the checkpoint's name:
    refused in one line; the checkpoint's own actor given again is fine."""
    from rldynamics.config import ConfigError
    from rldynamics.train.evaluate import eval_config

    checkpoint = _fake_checkpoint(tmp_path, adapter)
    assert main(["eval", str(checkpoint), "model.path=tiny", f"log.run_dir={tmp_path}"]) == 2
    err = _one_error_line(capsys)
    assert "model.path=tiny" in err and str(checkpoint) in err and "rldyn eval tiny" in err
    with pytest.raises(ConfigError, match="tiny.hidden_size"):
        eval_config(str(checkpoint), None, ["tiny.hidden_size=32"], "sokoban-tiny")
    actor = f"model.path={checkpoint / 'actor'}"
    cfg, step = eval_config(str(checkpoint), None, [actor], "sokoban-tiny")
    assert step == 12 and cfg.model.path == str(checkpoint.resolve() / "actor")


def test_eval_of_a_file_says_it_is_not_a_model(tmp_path, capsys):
    text = tmp_path / "one.jsonl"
    text.write_text('{"prompt": "hi"}\n')
    assert main(["eval", str(text), f"log.run_dir={tmp_path}"]) == 2
    err = _one_error_line(capsys)
    assert "not a model directory, a checkpoint or a .gguf file" in err and str(text) in err
    assert "Repo id" not in err


def test_the_eval_table_says_the_problems_are_distinct():
    from rldynamics.train.evaluate import metrics_table

    metrics = {"val-env/countdown/success": 0.5, "val-env/countdown/problems": 502.0}
    table = metrics_table(metrics, "countdown")
    assert "distinct problems" in table and "502" in table
