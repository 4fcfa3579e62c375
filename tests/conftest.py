"""Shared fixtures: a per-session cache for the embedded tiny model, and a fast training config."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(2)

FAST = [
    "train.steps=2", "train.env_groups=2", "train.group_size=2", "train.mini_batch_size=2",
    "train.micro_batch_size=1", "val.env_groups=3", "val.every=1", "env.max_turns=2", "env.max_new_tokens=8",
    "model.warm_start_episodes=8", "model.warm_start_epochs=1", "log.progress=false", "log.samples_per_step=1",
    "log.report=false",
]


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> str:
    """One model cache for the whole test session (the tiny model is built once)."""
    return str(tmp_path_factory.mktemp("rldyn_cache"))


@pytest.fixture
def fast_overrides(tiny_cache, tmp_path, monkeypatch) -> list[str]:
    """Overrides for a seconds-long training run writing under tmp_path."""
    monkeypatch.setenv("RLDYN_CACHE", tiny_cache)
    return [*FAST, f"log.run_dir={tmp_path / 'runs'}"]
