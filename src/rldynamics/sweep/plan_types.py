"""What a sweep plans: its (point, seed) runs, each with its overrides and action, and the sweep's settings.

The types alone, below both modules that use them: `sweep.plan` builds a plan, `sweep.runs` records its runs in
`OUT/plan.json`. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rldynamics.sweep.protocols import Point, Protocol


@dataclass
class RunPlan:
    """One (point, seed) run: where it lives, the overrides it is trained with, and the action to take."""

    point: Point
    index: int
    seed: int
    path: Path
    overrides: list[str]
    """Everything but the seed and the run directory: the point's overrides, the user's, checkpoint settings."""
    action: str
    """start | resume (from the latest checkpoint) | restart (no checkpoint yet, or a damaged run: the old attempt is
    kept aside) | skip (finished)."""

    def train_overrides(self) -> list[str]:
        """The full `key=value` list given to `rldyn train`."""
        extra = ["checkpoint.resume=latest"] if self.action == "resume" else []
        return [*self.overrides, f"seed={self.seed}", f"log.run_dir={self.path.parent}", f"log.name={self.path.name}",
                *extra]


@dataclass
class SweepPlan:
    protocol: Protocol
    seeds: list[int]
    out: Path
    preset: str
    config_file: str | None
    point_overrides: dict[str, list[str]]
    """label -> the override set of the point (protocol, user and checkpoint settings), as printed."""
    runs: list[RunPlan]
    checkpointing: list[str]
    """The checkpoint settings the sweep added to every point (none when the preset or the user chose them)."""
