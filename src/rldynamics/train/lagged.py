"""Off-policy rollouts (`rollout.staleness=N`, `rollout.overlap`): which weights a step's batch is sampled with, the
copy of the actor that holds them, and a rollout generated in a second thread while the update before it runs.

- Versions: version v is the actor's weights after step v (a run's start: the weights it began with, version 0 or
  its resumed step). Step t's batch is sampled with version `version_of(t) = max(0, t - 1 - N)`, so the update of
  step t trains on samples exactly N updates old; N = 0 is the on-policy run, which builds none of this.
- The sampler: a copy of the actor, its parameters without gradients, into which the version a rollout needs is
  copied (the HF engine generates with it; the vLLM engine is synced from it). The trainer's model is never the
  sampler, so a rollout and the update can run at the same time.
- History: after each step the actor's trainable weights (a LoRA run's adapters) are copied as that step's version;
  versions no later step samples with are dropped (N + 1 are held). A checkpoint keeps the N before its own
  (`saved`, written as `sampler.pt`), so a resumed run samples exactly what an uninterrupted one would.
- Overlap: `launch(step, work)` runs `work()` (the generation of `step`'s batch on the sampler) in a thread;
  `take(step)` waits for it and returns the batch with the seconds the thread took and the seconds waited. The
  weights a launched rollout needs are put in place before the thread starts, and the thread draws only from
  keyed streams (`train.row_seeded_sampling`), so the batch is the one the sequential run makes, bit for bit.
  The thread computes with the trainer's thread count; on 2 cores the update and the rollout then have one each.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rldynamics.rollout.engines import RolloutEngine

Weights = dict[str, torch.Tensor]  # a version: parameter name -> tensor (the trainable parameters)


def version_of(step: int, staleness: int) -> int:
    """The version (the step whose weights) that samples `step`'s batch under `rollout.staleness`."""
    return max(0, step - 1 - staleness)


def trainable_weights(model: torch.nn.Module) -> Weights:
    """A copy of `model`'s trainable parameters by name (tied weights once)."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


@dataclass
class Generated:
    """A batch generated ahead (`LaggedPolicy.take`): what the work returned, and how long it took and was waited."""

    batch: object
    seconds: float  # the generation's own wall time (in its thread)
    waited: float  # how long the step waited for it


class LaggedPolicy:
    """The sampler of a run with `rollout.staleness` >= 1: the versions it may still need and a copy of the actor
    holding the one the next rollout samples with."""

    def __init__(self, staleness: int, model: torch.nn.Module, start: int, history: dict[int, Weights] | None = None,
                 engine: RolloutEngine | None = None):
        self.staleness, self.engine = staleness, engine
        self.sampler = copy.deepcopy(model)
        for p in self.sampler.parameters():
            p.requires_grad_(False)
        self.versions: dict[int, Weights] = dict(history or {})
        self.versions[start] = trainable_weights(model)
        missing = [v for v in range(version_of(start + 1, staleness), start) if v not in self.versions]
        if missing:
            raise ValueError(f"the sampler versions {missing} are not kept")
        self.holds = start  # the version in `sampler` (the copy of the model is the starting weights)
        self.engine_holds: int | None = start if engine is not None else None  # the version the engine was synced with
        self.pending: tuple[int, threading.Thread, dict] | None = None

    def model_for(self, step: int) -> torch.nn.Module:
        """The sampler holding `step`'s version (its engine synced with it): what `step`'s rollout generates with."""
        version = version_of(step, self.staleness)
        if self.holds != version:
            with torch.no_grad():
                params = dict(self.sampler.named_parameters())
                for name, value in self.versions[version].items():
                    params[name].copy_(value)
            self.holds = version
        if self.engine is not None and self.engine_holds != version:
            self.engine.sync(self.sampler)
            self.engine_holds = version
        return self.sampler

    def engine_lent(self) -> None:
        """The trainer synced the engine with its own weights (for a validation): the next rollout syncs again."""
        self.engine_holds = None

    def keep(self, step: int, model: torch.nn.Module) -> None:
        """Keep the actor's weights after `step` as its version; drop the versions no later step samples with."""
        self.versions[step] = trainable_weights(model)
        oldest = version_of(step + 1, self.staleness)
        self.versions = {v: w for v, w in self.versions.items() if v >= oldest}

    def saved(self, step: int) -> dict[int, Weights]:
        """What a checkpoint of `step` keeps: the versions before `step` that later steps sample with."""
        return {v: w for v, w in self.versions.items() if v < step}

    def launch(self, step: int, work: Callable[[], object]) -> None:
        """Start `step`'s generation, `work()` (on `model_for(step)`, already in place), in a thread."""
        self.close()
        threads = torch.get_num_threads()
        out: dict = {}

        def run() -> None:
            torch.set_num_threads(threads)
            start = time.perf_counter()
            try:
                out["batch"] = work()
            except BaseException as e:  # noqa: BLE001 (raised again in the step that takes it)
                out["error"] = e
            out["seconds"] = time.perf_counter() - start

        thread = threading.Thread(target=run, name=f"rollout-step-{step}", daemon=True)
        thread.start()
        self.pending = (step, thread, out)

    def take(self, step: int) -> Generated | None:
        """The batch generated ahead for `step` (None: none was launched for it), raising what its work raised."""
        if self.pending is None or self.pending[0] != step:
            return None
        _, thread, out = self.pending
        start = time.perf_counter()
        thread.join()
        self.pending = None
        if "error" in out:
            raise out["error"]
        return Generated(out["batch"], out["seconds"], time.perf_counter() - start)

    def wait(self) -> None:
        """Let a launched generation finish (it keeps its batch for `take`): before the engine or the RNG is used."""
        if self.pending is not None:
            self.pending[1].join()

    def close(self) -> None:
        """Wait for a launched generation and drop it (the run ends or reopens without the step it was for)."""
        self.wait()
        self.pending = None
