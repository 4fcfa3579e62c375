"""The record of one step as it runs: the typed results of its stages, which the diagnostics read and which the
step recorder keeps (`train/diagnostics/records.py`), and the step's metrics in the order they came.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rldynamics.rollout.batch import RolloutBatch
from rldynamics.train.actor import ActorUpdate
from rldynamics.train.batch_ops import Filtered, Validation
from rldynamics.train.prepare import Prepared

if TYPE_CHECKING:
    from rldynamics.train.diagnostics.base import Diagnostic, DiagnosticResult


@dataclass
class StepRecord:
    """One step as it runs: the typed results of its stages, which diagnostics read, and the metrics of every stage
    and diagnostic in the order they ran (merged into the step's row by `metrics`)."""

    step: int  # the step the row is logged at
    seed_step: int  # the step whose env and sampling seeds were drawn (a probe: always 1)
    sampling_seed: int | None = None  # the rollout's sampling seed (set with the rollout)
    policy_version: int | None = None  # rollout.staleness: the step whose weights sampled it (None: the current)
    rollout: RolloutBatch | None = None  # the whole rollout, before the filter
    filtered: Filtered | None = None  # the filter's outcome
    prepared: Prepared | None = None  # the update's inputs (None: the filter kept nothing)
    update: ActorUpdate | None = None  # the actor update (None before it, or without one)
    validation: Validation | None = None  # the step's validation (None: not due, or the step stopped)
    early_stop: dict | None = None  # the early stopper's state at END (what a checkpoint of the step saves)
    results: dict[str, DiagnosticResult] = field(default_factory=dict)  # diagnostic name -> its result this step
    parts: list[dict[str, float]] = field(default_factory=list)

    def result_of(self, diagnostic: type[Diagnostic]) -> DiagnosticResult | None:
        """The result `diagnostic` gave this step (None: it did not run). A diagnostic reads another's result only
        when it declares it in its `reads` (`train/diagnostics/__init__.py` checks it runs after it)."""
        return self.results.get(diagnostic.name)

    def add(self, *metrics: dict[str, float]) -> None:
        """Record the metrics of a stage or diagnostic."""
        self.parts.extend(metrics)

    def metrics(self) -> dict[str, float]:
        """The step's row: every part's metrics, later parts last."""
        return {k: v for part in self.parts for k, v in part.items()}

    def rollout_policy_logprobs(self) -> torch.Tensor | None:
        """The trainer's log-probs [N, L] of the filtered batch's sampled tokens under the rollout policy: from the
        whole old-log-prob pass, else from the update's own (`ActorUpdate.logprobs`; None when neither ran)."""
        if self.prepared is not None and self.prepared.inputs.old_logprobs is not None:
            return self.prepared.inputs.old_logprobs
        return self.update.logprobs if self.update is not None else None

    def rollout_policy_entropy(self) -> torch.Tensor | None:
        """The rollout policy's entropy [N, L] at the filtered batch's sampled tokens, from the same pass as
        `rollout_policy_logprobs` (None when neither ran)."""
        if self.prepared is not None and self.prepared.token_entropy is not None:
            return self.prepared.token_entropy
        return self.update.token_entropy if self.update is not None else None
