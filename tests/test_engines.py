"""The rollout-engine table: one entry per `rollout.engine` choice, engines that follow the protocol, the factory and
the install check read from the table."""

from __future__ import annotations

import inspect

import pytest
import torch

from rldynamics.config import CHOICES, make_config
from rldynamics.rollout.agent import HFEngine
from rldynamics.rollout.engines import ENGINES, EngineEntry, RolloutEngine, check_installed, rollout_engine
from rldynamics.rollout.vllm_engine import VllmEngine

MEMBERS = [name for name, value in vars(RolloutEngine).items() if callable(value) and not name.startswith("_")]


def test_every_engine_choice_has_an_entry():
    assert set(ENGINES) == set(CHOICES["rollout.engine"])


@pytest.mark.parametrize("engine", [HFEngine, VllmEngine])
def test_engines_follow_the_protocol(engine):
    """Every member of the protocol, with its parameters (names, kinds, defaults)."""
    assert MEMBERS == ["generate", "drop", "sync", "release"]
    assert issubclass(engine, RolloutEngine)

    def parameters(function) -> list[tuple]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]

    for name in MEMBERS:
        assert parameters(getattr(engine, name)) == parameters(getattr(RolloutEngine, name)), name


def test_hf_builds_no_engine_per_run_and_needs_no_install():
    check_installed("hf")
    assert rollout_engine(make_config(), "unused", torch.nn.Linear(1, 1), "float32") is None


def test_the_factory_builds_the_entry_and_syncs_it(monkeypatch):
    """The run's engine is the entry's, built on the base model's directory in the engine dtype, then synced with the
    trainer's model."""
    calls = []

    class Fake:
        def __init__(self, cfg, path, dtype):
            calls.append(("build", path, dtype))

        def sync(self, model):
            calls.append(("sync", model))

    model = torch.nn.Linear(1, 1)
    monkeypatch.setitem(ENGINES, "vllm", EngineEntry(build=Fake))
    engine = rollout_engine(make_config(overrides=["rollout.engine=vllm"]), "base", model, "bfloat16")
    assert isinstance(engine, Fake) and calls == [("build", "base", "bfloat16"), ("sync", model)]


def test_a_missing_module_is_one_line_naming_the_entry_install(monkeypatch):
    monkeypatch.setitem(ENGINES, "other", EngineEntry(build=None, module="no_such_module_rldyn", package="Other",
                                                      install="pip install other"))
    with pytest.raises(ModuleNotFoundError, match=r"^rollout.engine=other needs Other, which is not installed: "
                                                  r"pip install other$"):
        check_installed("other")
