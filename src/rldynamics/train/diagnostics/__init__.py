"""The diagnostics of the training step: read-only parts that the step runs at fixed points (`base.py`).

To add one: write a module here with a `Diagnostic` subclass (its `name`, `point`, `enabled`, `run`; `due`,
`needs` and a state when it has them), and add it to `DIAGNOSTICS`. The step loop does not change.
"""

from __future__ import annotations

from rldynamics.config import Config
from rldynamics.train.diagnostics.base import Diagnostic
from rldynamics.train.diagnostics.collapse import Collapse
from rldynamics.train.diagnostics.gradient_analysis import GradientAnalysis
from rldynamics.train.diagnostics.health import Health
from rldynamics.train.diagnostics.lengths import ReplyLengths
from rldynamics.train.diagnostics.mismatch import Mismatch
from rldynamics.train.diagnostics.records import StepRecorder

# name -> its class, in the order the diagnostics of one point run
DIAGNOSTICS: dict[str, type[Diagnostic]] = {
    "reply_lengths": ReplyLengths,
    "collapse": Collapse,
    "gradient_analysis": GradientAnalysis,
    "mismatch": Mismatch,
    "health": Health,  # after the others: it reads their results
    "step_records": StepRecorder,  # last: it records the steps on which a health rule starts firing
}


def build_diagnostics(cfg: Config, trainer_state: dict | None = None) -> list[Diagnostic]:
    """The diagnostics a run with `cfg` has, their states restored from a checkpoint's `trainer_state`."""
    saved = dict((trainer_state or {}).get("diagnostics", {}))
    if trainer_state and "collapse_ema" in trainer_state:  # checkpoints written before `diagnostics`
        saved.setdefault("collapse", {"ema": trainer_state["collapse_ema"]})
    out = [cls(cfg) for cls in DIAGNOSTICS.values() if cls.enabled(cfg)]
    for d in out:
        d.load_state_dict(saved.get(d.name, {}))
    return out


def diagnostic_states(diagnostics: list[Diagnostic]) -> dict[str, dict]:
    """The states to save with a checkpoint, by name (diagnostics without one left out)."""
    return {d.name: state for d in diagnostics if (state := d.state_dict())}
