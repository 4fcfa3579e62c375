"""The environment protocol every rldynamics env implements.

Design choices:
- Envs speak text. `reset` and `step` return observation strings; the rollout loop owns prompts, chat
  templates and action parsing (`rldynamics.rollout.parse`), so an env never sees raw model output.
- `step` takes exactly one action word that the caller has already checked against `actions`. Turns with
  several actions are the rollout loop's business: it calls `step` once per action.
- Rewards come back as one float per step plus an `info` dict of floats (0/1 flags and counters), so
  metrics can be averaged without type juggling.
- `reset(seed)` is deterministic: the same seed gives the same initial state in every process and on
  every machine. Envs in a group share a seed and therefore a starting state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass
class StepResult:
    """What one `Env.step` call returns.

    Attributes:
        observation: text rendering of the state after the action.
        reward: scalar reward for this single action.
        done: True when the episode is over (solved, or out of env steps).
        info: float-valued diagnostics; at least `action_is_effective` (1.0 if the action changed the
            state), `action_is_valid` (1.0 if the action was a legal word) and `success` (1.0 if solved).
    """

    observation: str
    reward: float
    done: bool
    info: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
    """A text environment driven one action word at a time.

    Attributes:
        actions: the valid action words, spelled as the model should write them (e.g. "Up").
    """

    actions: tuple[str, ...]

    def instructions(self) -> str:
        """Task description for the system prompt: rules, symbol legend and available actions."""
        ...

    def reset(self, seed: int) -> str:
        """Start a new episode whose initial state is a deterministic function of `seed`; return its text."""
        ...

    def step(self, action: str) -> StepResult:
        """Execute one action word (already validated to be in `actions`) and return the outcome."""
        ...

    def success(self) -> bool:
        """True when the current state counts as solved."""
        ...
