"""The optional metric mirrors: W&B (offline) and TensorBoard receive every numeric metric of metrics.jsonl."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rldynamics.config import make_config
from rldynamics.tracking.run_dir import read_metrics
from rldynamics.train.trainer import train


def _numeric(rows):
    """(step, key, value) of every numeric metric in the run's rows."""
    return [(r["step"], k, v) for r in rows for k, v in r.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)]


def test_tensorboard_mirrors_every_numeric_metric(fast_overrides):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = train(make_config(overrides=[*fast_overrides, "log.name=tb", "log.tensorboard=true"]))
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    logged = {(e.step, tag): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    expected = _numeric(read_metrics(run))
    assert len(expected) > 50 and len(logged) == len(expected)
    for step, key, value in expected:
        assert logged[(step, key)] == np.float32(value), (step, key)  # TensorBoard stores float32


def test_wandb_offline_run_holds_every_numeric_metric(fast_overrides, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = train(make_config(overrides=[*fast_overrides, "log.name=wb", "log.wandb=true"]))
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    # The run file is a record log of protobuf messages: keys are stored as text, values as their JSON text
    # (integral floats without ".0").
    data = files[0].read_bytes()
    for step, key, value in _numeric(read_metrics(run)):
        text = str(int(value)) if float(value).is_integer() else json.dumps(value)
        assert key.encode() in data and text.encode() in data, (step, key, value, text)


def test_missing_mirror_package_fails_before_any_work(fast_overrides, tmp_path, monkeypatch, capsys):
    import importlib.util

    from rldynamics.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert main(["train", *fast_overrides, "log.name=nowb", "log.wandb=true"]) == 2
    assert "needs the wandb package: pip install wandb" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "nowb").exists()
