"""In-memory states a health rollback can go back to, so that a rollback needs no checkpoint on disk.

With a rule whose action is `rollback`, the training loop keeps a copy of the training state (weights, optimizer,
critic, RNG, trainer state: `checkpoint.capture_state(copy=True)`) before step 1 and after every
`health.snapshot_every`-th step, the newest `health.snapshots` of the latter, within `health.snapshot_mb` in all:
where fewer fit, the state before step 1 first (the one a blow-up of the first updates needs), then as many of the
newest as fit.
A rollback to one of them writes it as the checkpoint of its step (`checkpoints/step_<k>`, the state before step 1
as `step_0`) and reopens the run from it as a resume does: the same checks and restores, so a rollback from memory
and one from disk continue identically; the reopened run keeps the states from before the one it went back to, so
a second rollback can go back further. Under torchrun every rank takes part in keeping a state (a sharded one is
gathered, as for a checkpoint); rank 0 holds it and writes it.
"""

from __future__ import annotations

from pathlib import Path

from rldynamics.analysis.health_rules import RULES
from rldynamics.config import Config
from rldynamics.train.checkpoint import TrainingState, capture_state, state_bytes, write_state
from rldynamics.train.session import Session


def rolls_back(cfg: Config) -> bool:
    """Whether a health rule of `cfg` may roll the run back (or, with no rollback left, end it with a kept state)."""
    h = cfg.health
    return h.enabled and any(getattr(h, rule) == "rollback" for rule in RULES)


class Snapshots:
    """The states kept in memory: the start (the state before the first step of this process) and the newest
    `health.snapshots` of the scheduled ones, by step."""

    def __init__(self, cfg: Config, model, critic=None):
        h = cfg.health
        wanted = rolls_back(cfg)
        self.size_mb = state_bytes(model, critic) / 2**20 if wanted else 0.0  # one state
        fit = int(h.snapshot_mb // self.size_mb) if self.size_mb > 0 else 0  # states within health.snapshot_mb
        self.every, self.asked = h.snapshot_every, h.snapshots
        self.newest = max(0, min(h.snapshots, fit - 1))  # besides the state before step 1
        self.on = wanted and fit >= 1
        self.start: TrainingState | None = None
        self.kept: list[TrainingState] = []

    def words(self) -> str:
        """What a rollback can go back to, for the start-up line of a run that may roll back."""
        total = f"{self.size_mb * (1 + self.newest):.0f} MiB"
        if not self.on:
            return (f"warning: a rollback goes back to checkpoints on disk only (one state in memory takes "
                    f"{self.size_mb:.0f} MiB; health.snapshot_mb allows less)")
        if self.newest == 0:
            where = "the state before step 1"
        else:
            where = f"the state before step 1 or one of the last {self.newest} states kept every {self.every} steps"
        short = (f" ({self.newest} of the health.snapshots={self.asked} fit within health.snapshot_mb)"
                 if self.newest < self.asked else "")
        return f"a rollback can go back to {where}, in memory ({total}){short}, or to a checkpoint"

    def due(self, step: int, *, start: bool = False) -> bool:
        """Whether the state after `step` is kept (`start`: the state this process began from)."""
        return self.on and (start or (self.newest > 0 and step % self.every == 0))

    def keep(self, s: Session, step: int, trainer_state: dict, *, start: bool = False) -> None:
        """Keep the state after `step` (`start`: the state this process began from, unless states were carried
        over from before a rollback: then it is one of the newest); see `due`."""
        if start and self.start is not None and self.start.step == step:
            return  # carried over: the rollback went back to it
        state = capture_state(step, model=s.model, optimizer=s.optimizer, critic=s.critic,
                              critic_optimizer=s.critic_optimizer, trainer_state=trainer_state, copy=True,
                              sampler=s.sampler_versions(step))
        if start and self.start is None:
            self.start = state
            return
        self.kept = self._newest([k for k in self.kept if k.step != step] + [state])

    def carry(self, earlier: Snapshots, back: int) -> None:
        """After a rollback to step `back`, keep what `earlier` (the run before it) kept from before `back`: its start
        and its states of earlier steps, so that a second rollback can still go back further than the first."""
        if not self.on:
            return
        self.start = earlier.start
        self.kept = self._newest([k for k in earlier.kept if k.step < back])

    def _newest(self, states: list[TrainingState]) -> list[TrainingState]:
        """The newest `health.snapshots` of `states` (oldest first)."""
        return states[-self.newest:] if self.newest else []

    def steps(self) -> list[int]:
        """The steps of the kept states, oldest first."""
        return sorted({k.step for k in ([self.start] if self.start else []) + self.kept})

    def write(self, s: Session, step: int) -> Path:
        """Write the kept state of `step` as the run's checkpoint of that step; its path."""
        state = next(k for k in [*self.kept, self.start] if k is not None and k.step == step)
        return write_state(s.run_dir / "checkpoints" / f"step_{step}", state, model=s.model, tokenizer=s.tokenizer,
                           critic=s.critic)
