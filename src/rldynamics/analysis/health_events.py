"""The health monitor's bookkeeping over its rules: which rules start, go on or stop firing at a
step, and the events.jsonl rows that say so. Pure (no torch): the trainer's monitor
(`train/diagnostics/health.py`), `rldyn doctor` and the TRL callback (`integrations/`) share it, so
the three write the same rows for the same signals.

- `check_rules`: every rule's check of one step's `Signals`, with its streak kept: `Outcome.new`
  when the rule starts firing (its first step after a step it did not fire), `Outcome.ended` when a
  streak ends (the rule saw its signal and did not fire; a step without the rule's signal leaves its
  streak as it was).
- `writes_row`: record, warn and skip write their row on the first step of a streak only; rollback
  and stop on every step they fire (each ends or rewinds the run).
- `Monitor`: the rules with their actions outside the trainer, where an action is only a row (and a
  stop the caller carries out): `rldyn doctor` and the TRL callback."""

from __future__ import annotations

from dataclasses import dataclass, field

from rldynamics.analysis.health_rules import (
    CLEAR,
    RULES,
    Alarm,
    FallingValidation,
    NoLearning,
    Rule,
    Signals,
)
from rldynamics.config import HealthConfig

QUIET = ("record", "warn", "skip")  # actions that write their row on a streak's first step only
# the rules that the validation before training starts
VALIDATION_RULES = (FallingValidation.name, NoLearning.name)


@dataclass(frozen=True)
class Outcome:
    """One rule at one step."""

    rule: str
    alarm: Alarm | None  # None: the rule did not fire
    new: bool  # the rule started firing at this step
    ended: int | None  # the first step of a streak that ended at this step (None: none ended)


def check_rules(rules: dict[str, Rule], x: Signals) -> list[Outcome]:
    """Check every rule (in the table's order) on `x` and keep its streak: an `Outcome` a rule."""
    out = []
    for name, rule in rules.items():
        alarm = rule.check(x)
        new = alarm is not None and rule.streak_start is None
        ended = rule.streak_start if alarm is None and rule.sees(x) else None
        # a step without the rule's signal leaves its streak as it was
        if alarm is not None or rule.sees(x):
            rule.streak_start = None if alarm is None else (rule.streak_start or alarm.since)
        out.append(Outcome(name, alarm, new, ended))
    return out


def writes_row(new: bool, action: str) -> bool:
    """Whether a firing rule writes an events.jsonl row at this step."""
    return new or action not in QUIET


def alarm_row(step: int, alarm: Alarm, action: str, why: str = "", ends_with: int | None = None) -> dict:
    """The events.jsonl row of an alarm; `why` (what its action became and why) ends its message; `ends_with`: the
    step whose kept state a stop leaves as the run's last checkpoint (set only then)."""
    message = f"{alarm.message}; {why}" if why else alarm.message
    row = {"step": step, "rule": alarm.rule, "action": action, "value": alarm.value,
           "threshold": alarm.threshold, "since": alarm.since, "message": message}
    return row if ends_with is None else {**row, "ends_with": ends_with}


def clear_message(rule: str, fired: int) -> str:
    return f"{rule} no longer fires (it did from step {fired})"


def clear_row(step: int, rule: str, since: int, fired: int) -> dict:
    """The events.jsonl row of a warning whose rule stopped firing (`fired`: the step it started
    firing)."""
    return {"step": step, "rule": rule, "action": CLEAR, "since": since,
            "message": clear_message(rule, fired)}


@dataclass
class StepHealth:
    """What the rules said at one step: `health/<rule>` flags, events.jsonl rows, the rule that
    stops the run."""

    flags: dict[str, float] = field(default_factory=dict)  # rule -> 1.0 where it fired, else 0.0
    rows: list[dict] = field(default_factory=list)
    stop: str | None = None  # the first rule whose action is stop and that fired


class Monitor:
    """The rules of `analysis/health_rules.py` with their streaks and actions, outside the trainer.

    `actions`: rule -> (action, note): the action written in its rows and a note after the message
    (what the configured action became and why, or ""). The caller carries out a stop
    (`StepHealth.stop`)."""

    def __init__(self, cfg: HealthConfig, actions: dict[str, tuple[str, str]]):
        self.rules = {name: rule(cfg) for name, rule in RULES.items()}
        self.actions = actions
        self.fired_at: dict[str, int] = {}  # rule -> the step its latest streak started firing

    def before_training(self, x: Signals) -> None:
        """The validation before training: the start of the validation rules (their best, their
        first value)."""
        for name in VALIDATION_RULES:
            self.rules[name].check(x)

    def step(self, x: Signals) -> StepHealth:
        out = StepHealth()
        for o in check_rules(self.rules, x):
            action, note = self.actions[o.rule]
            out.flags[o.rule] = float(o.alarm is not None)
            if o.ended is not None and action == "warn":
                fired = self.fired_at.get(o.rule, o.ended)
                out.rows.append(clear_row(x.step, o.rule, o.ended, fired))
            if o.alarm is None:
                continue
            if o.new:
                self.fired_at[o.rule] = x.step
            if writes_row(o.new, action):
                out.rows.append(alarm_row(x.step, o.alarm, action, note))
            if action == "stop":
                out.stop = out.stop or o.rule
        return out
