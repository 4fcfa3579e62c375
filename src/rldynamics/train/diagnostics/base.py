"""What a diagnostic is: a read-only part of the training step that says when it is due, what it reads, what it
returns and what state it keeps. The step (`train/step.py`) runs the due ones at three fixed points:

    ROLLOUT        after the rollout, on the whole (unfiltered) batch, under the policy that sampled it
    BEFORE_UPDATE  after the critic update, before the actor update: the filtered batch and its prepared inputs,
                   still under the rollout policy (`prepared` is None when the filter kept nothing)
    END            last, on every step, after the update and the step's validation (`prepared`, `update`,
                   `validation` are None where the step had none: an empty batch, the critic warm-up, an early stop)

A diagnostic reads the step's typed results from a `StepRecord` (the stages' results and the earlier
diagnostics' results), never a metric string, and returns a `DiagnosticResult`: its metrics and, rarely, a reason
to end the run (the gradient analysis with `analysis.exit_after`, a health rule's stop) or to roll back to a
checkpoint. During the actor update a diagnostic's `guard` may refuse an optimizer step (the health monitor's
gradient-spike rule). Its state (`state_dict`) is saved in the checkpoint's trainer state under
`diagnostics/<name>` and restored on resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rldynamics.config import Config
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.train.actor import ActorUpdate
from rldynamics.train.prepare import Prepared
from rldynamics.train.stages import Filtered, Validation

if TYPE_CHECKING:
    from rldynamics.train.update import StepTrace

ROLLOUT, BEFORE_UPDATE, END = "rollout", "before_update", "end"
POINTS = (ROLLOUT, BEFORE_UPDATE, END)  # the order the step reaches them


@dataclass(frozen=True)
class Needs:
    """Passes a due diagnostic needs from the step beyond what the update itself needs."""

    old_logprobs: bool = False  # the old-log-prob pass, even where the update is one pass on the rollout policy
    ref_logprobs: bool = False  # the reference model's log-probs, even with the KL term off
    update_logprobs: bool = False  # the update's own log-probs (`ActorUpdate.logprobs`) when it skips that pass

    def __or__(self, other: Needs) -> Needs:
        return Needs(self.old_logprobs or other.old_logprobs, self.ref_logprobs or other.ref_logprobs,
                     self.update_logprobs or other.update_logprobs)


@dataclass
class StepRecord:
    """One step as it runs: the typed results of its stages, which diagnostics read, and the metrics of every stage
    and diagnostic in the order they ran (merged into the step's row by `metrics`)."""

    step: int  # the step the row is logged at
    seed_step: int  # the step whose env and sampling seeds were drawn (a probe: always 1)
    sampling_seed: int | None = None  # the rollout's sampling seed (set with the rollout)
    rollout: RolloutBatch | None = None  # the whole rollout, before the filter
    filtered: Filtered | None = None  # the filter's outcome
    prepared: Prepared | None = None  # the update's inputs (None: the filter kept nothing)
    update: ActorUpdate | None = None  # the actor update (None before it, or without one)
    validation: Validation | None = None  # the step's validation (None: not due, or the step stopped)
    early_stop: dict | None = None  # the early stopper's state at END (what a checkpoint of the step saves)
    results: dict[str, DiagnosticResult] = field(default_factory=dict)  # diagnostic name -> its result this step
    parts: list[dict[str, float]] = field(default_factory=list)

    def add(self, *metrics: dict[str, float]) -> None:
        """Record the metrics of a stage or diagnostic."""
        self.parts.extend(metrics)

    def metrics(self) -> dict[str, float]:
        """The step's row: every part's metrics, later parts last."""
        return {k: v for part in self.parts for k, v in part.items()}

    def rollout_policy_logprobs(self) -> torch.Tensor | None:
        """The trainer's log-probs [N, L] of the filtered batch's sampled tokens under the rollout policy: from the
        old-log-prob pass, else from a single-pass update's own forward (None when neither ran)."""
        if self.prepared is not None and self.prepared.inputs.old_logprobs is not None:
            return self.prepared.inputs.old_logprobs
        return self.update.logprobs if self.update is not None else None

    def rollout_policy_entropy(self) -> torch.Tensor | None:
        """The rollout policy's entropy [N, L] at the filtered batch's sampled tokens, from the same pass as
        `rollout_policy_logprobs` (None when neither ran)."""
        if self.prepared is not None and self.prepared.token_entropy is not None:
            return self.prepared.token_entropy
        return self.update.token_entropy if self.update is not None else None


@dataclass
class DiagnosticResult:
    """What a diagnostic returns: its metrics, a reason to end the run after this step (None: go on), a
    checkpoint of the run to go back to (None: no rollback), and the alarms that started at this step (the rules of
    the health monitor whose trouble is new: the step recorder keeps such steps)."""

    metrics: dict[str, float]
    stop: str | None = None
    rollback_to: Path | None = None
    alarms: list[str] = field(default_factory=list)


class Diagnostic:
    """A read-only diagnostic of the step. Subclasses set `name`, `point` (and `phase`, the console's word while
    it runs) and implement `enabled` and `run`; the rest has defaults.

    Read-only means: it changes no parameter, no optimizer state and no RNG stream that training draws from
    (draw from generators seeded by (seed, step), or inside `torch.random.fork_rng`)."""

    name: str = ""  # its key in the trainer state and its timing metric (`timing_s/<name>`)
    point: str = END  # where in the step it runs (`POINTS`)
    phase: str | None = None  # shown on the console while it runs (None: too quick to show)

    def __init__(self, cfg: Config):
        self.cfg = cfg

    @staticmethod
    def enabled(cfg: Config) -> bool:
        """Whether a run with `cfg` has this diagnostic at all."""
        raise NotImplementedError

    def due(self, step: int) -> bool:
        """Whether it runs at `step` (default: every step)."""
        return True

    def needs(self, step: int) -> Needs:
        """The passes it needs from the step at `step` (only asked when due)."""
        return Needs()

    def run(self, s, record: StepRecord) -> DiagnosticResult:
        """Its result at `record.step`; `s` is the session (`train.setup.Session`: model, tokenizer, writer)."""
        raise NotImplementedError

    def guard(self, trace: StepTrace) -> bool:
        """During the actor update, before each optimizer step: True refuses the step (default: never)."""
        return False

    def before_training(self, validation) -> None:
        """The validation before the first step of a run started from scratch (`val.before_train`; a
        `train.stages.Validation`), given once before step 1 (default: ignored)."""

    def state_dict(self) -> dict:
        """What a resumed run needs to go on as if never stopped (JSON-serialisable; {} for none)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`'s output."""

    def close(self) -> None:
        """Finish pending work at the end of the run (files written in the background)."""
