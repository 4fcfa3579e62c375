"""The diagnostics of the training step: read-only parts that the step runs at fixed points (`base.py`).

To add one: write a module here with a `Diagnostic` subclass (its `name`, `point`, `enabled`, `run`; `due`,
`needs`, `reads`, a state and the jobs it runs in when it has them), and add it to `DIAGNOSTICS`. The step loop,
the set-up and the commands do not change.
"""

from __future__ import annotations

from rldynamics.config import Config
from rldynamics.train.diagnostics.base import JOBS, TRAIN, Diagnostic, diagnostic_states, trainer_state
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


def check_order(table: dict[str, type[Diagnostic]]) -> None:
    """Refuse a table in which a diagnostic comes before one whose result it `reads`."""
    order = list(table.values())
    for i, cls in enumerate(order):
        late = [r.name for r in cls.reads if r not in order[:i]]
        if late:
            raise ValueError(f"diagnostic {cls.name} reads {', '.join(late)}, which must come before it in DIAGNOSTICS")


check_order(DIAGNOSTICS)


def job_classes(job: str) -> list[type[Diagnostic]]:
    """The diagnostics that run in `job` (`base.JOBS`; a job not among them, a replay, runs none), in order."""
    return [cls for cls in DIAGNOSTICS.values() if job in cls.jobs]


def needs_reference(cfg: Config, job: str) -> bool:
    """Whether a session of `job` loads the reference model: for the KL term, or for a diagnostic that measures
    against the reference with the term off (the gradient analysis). A replay (a job that runs no diagnostic) runs
    the passes of the training step it replays, so it loads what the training step's diagnostics load."""
    classes = job_classes(job if job in JOBS else TRAIN)
    return cfg.algo.kl_coef > 0 or any(cls.needs_reference and cls.enabled(cfg) for cls in classes)


def job_settings(job: str) -> list[str]:
    """The config overrides `job` applies for its diagnostics (the probe turns the gradient analysis on)."""
    return [o for cls in job_classes(job) for o in cls.job_settings.get(job, ())]


def check_world(cfg: Config, ranks: int, job: str = TRAIN) -> None:
    """Each diagnostic of `job` that a run with `cfg` has refuses what it cannot honour on `ranks` ranks."""
    for cls in job_classes(job):
        if cls.enabled(cfg):
            cls.check_world(cfg, ranks)


def build_diagnostics(cfg: Config, trainer_state: dict | None = None, job: str = TRAIN) -> list[Diagnostic]:
    """The diagnostics a `job` with `cfg` has, their states restored from a checkpoint's `trainer_state`."""
    saved = dict((trainer_state or {}).get("diagnostics", {}))
    if trainer_state and "collapse_ema" in trainer_state:  # checkpoints written before `diagnostics`
        saved.setdefault("collapse", {"ema": trainer_state["collapse_ema"]})
    out = [cls(cfg) for cls in job_classes(job) if cls.enabled(cfg)]
    for d in out:
        d.load_state_dict(saved.get(d.name, {}))
    return out


__all__ = ["DIAGNOSTICS", "Diagnostic", "build_diagnostics", "check_world", "diagnostic_states", "job_classes",
           "job_settings", "needs_reference", "trainer_state"]
