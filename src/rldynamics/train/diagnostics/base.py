"""What a diagnostic is: a read-only part of the training step that says when it is due, what it reads, what it
returns and what state it keeps. The step (`train/stages.py`) runs the due ones at three fixed points:

    ROLLOUT        after the rollout, on the whole (unfiltered) batch, under the policy that sampled it
    BEFORE_UPDATE  after the critic update, before the actor update: the filtered batch and its prepared inputs,
                   still under the rollout policy (`prepared` is None when the filter kept nothing)
    END            last, on every step, after the update and the step's validation (`prepared`, `update`,
                   `validation` are None where the step had none: an empty batch, the critic warm-up, an early stop)

A diagnostic reads the step's typed results from a `StepRecord` (the stages' results and, through
`result_of`, the results of the diagnostics it declares in `reads`), never a metric string, and returns a
`DiagnosticResult`: its metrics and, rarely, a reason to end the run (a health rule's stop; the gradient
analysis's exit after it) or to roll back to a checkpoint. During the actor update a diagnostic's `guard` may
refuse an optimizer step (the health monitor's gradient-spike rule). Its state (`state_dict`) is saved in the
checkpoint's trainer state under `diagnostics/<name>` and restored on resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from rldynamics.config import Config
from rldynamics.train.session import Session
from rldynamics.train.step_record import StepRecord

if TYPE_CHECKING:
    from rldynamics.train.update import StepTrace

__all__ = ["BEFORE_UPDATE", "END", "JOBS", "POINTS", "PROBE", "ROLL_FORWARD", "ROLLOUT", "TRAIN", "Diagnostic",
           "DiagnosticResult", "Needs", "StepRecord", "diagnostic_states", "trainer_state"]

ROLLOUT, BEFORE_UPDATE, END = "rollout", "before_update", "end"
POINTS = (ROLLOUT, BEFORE_UPDATE, END)  # the order the step reaches them
# the jobs that run steps, each choosing its diagnostics by `Diagnostic.jobs` (a replay runs none)
TRAIN, PROBE, ROLL_FORWARD = "train", "probe", "roll_forward"  # `rldyn train`, `rldyn probe`, a replay's retraining
JOBS = (TRAIN, PROBE, ROLL_FORWARD)


@dataclass(frozen=True)
class Needs:
    """What a due diagnostic needs from the step beyond what the update itself needs."""

    old_logprobs: bool = False  # the old-log-prob pass, even where the update is one pass on the rollout policy
    ref_logprobs: bool = False  # the reference model's log-probs, even with the KL term off
    update_logprobs: bool = False  # the update's own log-probs (`ActorUpdate.logprobs`) when it skips that pass
    layer_traces: bool = False  # per-layer gradient norms and update ratios in the optimizer-step traces

    def __or__(self, other: Needs) -> Needs:
        return Needs(**{f.name: getattr(self, f.name) or getattr(other, f.name) for f in fields(self)})


@dataclass
class DiagnosticResult:
    """What a diagnostic returns: its metrics, a reason to end the run after this step (None: go on), the step
    whose kept state the run goes back to (None: no rollback), the step whose kept state a stopping run ends with
    (None: the state of the step it stops at), the alarms that started at this step (the rules of the health
    monitor whose trouble is new: the step recorder keeps such steps), and `exit_line`: set, the run ends right
    after this step with its row alone (no checkpoint, no early-stop flag), saying this line."""

    metrics: dict[str, float]
    stop: str | None = None
    rollback_to: int | None = None
    end_with: int | None = None  # with `stop`: the step whose kept state becomes the run's last checkpoint
    alarms: list[str] = field(default_factory=list)
    exit_line: str | None = None


class Diagnostic:
    """A read-only diagnostic of the step. Subclasses set `name`, `point` (and `phase`, the console's word while
    it runs) and implement `enabled` and `run`; the rest has defaults.

    What it needs from the set-up and the jobs it belongs in are its own: `jobs` (the jobs it runs in),
    `job_settings` (config overrides a job applies for it: the probe turns the gradient analysis on),
    `needs_reference` (load the reference model even with the KL term off), `check_world` (settings it cannot
    honour on several ranks), `reads` (the diagnostics whose results it reads: they run before it).

    Read-only means: it changes no parameter, no optimizer state and no RNG stream that training draws from
    (draw from generators seeded by (seed, step), or inside `torch.random.fork_rng`)."""

    name: str = ""  # its key in the trainer state and its timing metric (`timing_s/<name>`)
    point: str = END  # where in the step it runs (`POINTS`)
    phase: str | None = None  # shown on the console while it runs (None: too quick to show)
    jobs: frozenset[str] = frozenset(JOBS)  # the jobs it runs in
    job_settings: dict[str, tuple[str, ...]] = {}  # job -> the overrides that job applies to the run's config
    needs_reference: bool = False  # the reference model (the base model) is loaded for it
    reads: tuple[type[Diagnostic], ...] = ()  # diagnostics whose results it reads (`StepRecord.result_of`)

    def __init__(self, cfg: Config):
        self.cfg = cfg

    @staticmethod
    def enabled(cfg: Config) -> bool:
        """Whether a run with `cfg` has this diagnostic at all."""
        raise NotImplementedError

    @staticmethod
    def check_world(cfg: Config, ranks: int) -> None:
        """Raise ConfigError, naming the key, for a setting it cannot honour on `ranks` > 1 ranks (default: none)."""

    def due(self, step: int) -> bool:
        """Whether it runs at `step` (default: every step)."""
        return True

    def needs(self, step: int) -> Needs:
        """What it needs from the step at `step` (only asked when due)."""
        return Needs()

    def run(self, s: Session, record: StepRecord) -> DiagnosticResult:
        """Its result at `record.step`."""
        raise NotImplementedError

    def guard(self, trace: StepTrace) -> bool:
        """During the actor update, before each optimizer step: True refuses the step (default: never)."""
        return False

    def before_training(self, validation) -> None:
        """The validation before the first step of a run started from scratch (`val.before_train`; a
        `train.batch_ops.Validation`), given once before step 1 (default: ignored)."""

    def state_dict(self) -> dict:
        """What a resumed run needs to go on as if never stopped (JSON-serialisable; {} for none)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`'s output."""

    def close(self) -> None:
        """Finish pending work at the end of the run (files written in the background)."""


def diagnostic_states(diagnostics: list[Diagnostic]) -> dict[str, dict]:
    """The states to save with a checkpoint, by name (diagnostics without one left out)."""
    return {d.name: state for d in diagnostics if (state := d.state_dict())}


def trainer_state(early_stop: dict, diagnostics: list[Diagnostic]) -> dict:
    """What a checkpoint keeps beside the weights: the early stopper's state and the diagnostics' states."""
    return {"early_stop": early_stop, "diagnostics": diagnostic_states(diagnostics)}
