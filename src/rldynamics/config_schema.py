"""How a config field declares the check of its value: choices (`one_of`), a range (`within`), a health rule's action
(`health_action`). `config.py` collects the checks of every field (`CHOICES`, `RANGES`) and runs them in `validate`.

Below `config.py` and the modules whose settings it assembles (the health rules, `analysis/health_rules.py`): it
imports nothing of rldynamics, so each of them can declare its fields here without an import circle.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def one_of(default: str, *allowed: str) -> Any:
    """A field whose value must be one of `allowed` (checked by `validate`, collected in `CHOICES`)."""
    return field(default=default, metadata={"choices": allowed})


def within(default: Any, low: float, inclusive: bool = True, high: float | None = None) -> Any:
    """A number field that must be >= `low` (> `low` when not `inclusive`) and <= `high` when given (checked by
    `validate` after the type, collected in `RANGES`; an optional field's null is not checked)."""
    return field(default=default, metadata={"range": (low, inclusive, high)})


HEALTH_ACTIONS = ("record", "warn", "skip", "rollback", "stop")
SKIPPABLE = ("health.grad_spike", "health.non_finite")  # the rules whose trouble is found before the optimizer step


def health_action(default: str) -> Any:
    """A health rule's action: record (a metric and an events.jsonl line), warn (and one console line), skip (refuse
    the optimizer step: grad_spike and non_finite only, `SKIPPABLE`; a non-finite step is skipped in any case),
    rollback (back to the last checkpoint before the trouble, new sampling seeds) or stop (an early stop with the rule
    as its reason)."""
    return one_of(default, *HEALTH_ACTIONS)
