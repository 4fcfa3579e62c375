"""What a job holds while it runs: the `Session` (config, models, optimizers, the run writer) and the `Start` it
began from. A leaf module, so that every stage and diagnostic can type its session; `train/setup.py` builds both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rldynamics.config import Config
from rldynamics.rollout.engines import RolloutEngine
from rldynamics.tracking.console import StepConsole
from rldynamics.tracking.run_dir import RunWriter

if TYPE_CHECKING:
    from rldynamics.train.diagnostics.base import Diagnostic
    from rldynamics.train.lagged import LaggedPolicy
    from rldynamics.train.snapshots import Snapshots


@dataclass
class Start:
    """Where a run starts: the checkpoint it resumes (None: step 0) and that checkpoint's trainer state."""

    checkpoint: Path | None = None
    state: dict | None = None
    in_place: bool = False  # continues the run in its own directory (rather than a probe of another run)
    attempt: int = 0  # rollbacks the run has made before (`rolled_back/attempt_<k>/`): its sampling stream

    @property
    def step(self) -> int:
        """The last step already done (0 when starting from scratch)."""
        return self.state["step"] if self.state else 0


@dataclass
class Session:
    """Everything a step needs: config, models, optimizers, run writer. Built once by `train/setup.py`; only
    `writer` (opened once the run directory is locked) and `console` (the job's progress display) are set later."""

    cfg: Config
    run_dir: Path
    writer: RunWriter | None  # opened once the run directory is locked
    model: torch.nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer
    ref_model: torch.nn.Module | None = None  # the KL reference: the frozen base model, or with LoRA the actor itself
    # (its adapters switched off where it is used: `models.lora.as_reference`)
    critic: torch.nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    console: StepConsole | None = None
    engine: RolloutEngine | None = None  # the run's rollout engine (rollout.engines; None: an HFEngine per rollout)
    main: bool = True  # rank 0 (or one process): the one that writes the run directory
    environment: dict | None = None  # what computes this start (`tracking.environment`), recorded by open_run
    diagnostics: list[Diagnostic] = field(default_factory=list)  # read-only parts of the step (`train/diagnostics`)
    attempt: int = 0  # rollbacks the run has made (`rolled_back/attempt_<k>/`): its sampling stream
    snapshots: Snapshots | None = None  # states in memory a rollback can go back to (`train/snapshots.py`)
    lagged: LaggedPolicy | None = None  # rollout.staleness >= 1: the sampler's lagged weights (`train/lagged.py`)

    def sampler_versions(self, step: int) -> dict | None:
        """What a checkpoint of `step` keeps of the lagged sampler (`LaggedPolicy.saved`; None on-policy)."""
        return self.lagged.saved(step) if self.lagged is not None else None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append the metrics row of `step` (rank 0 only)."""
        if self.main:
            self.writer.log(step, metrics)
