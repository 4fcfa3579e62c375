"""The health monitor inside TRL: a `transformers.TrainerCallback` added in one line,

    from rldynamics.integrations.trl import HealthCallback
    trainer = GRPOTrainer(..., callbacks=[HealthCallback()])  # or (entropy_collapse="stop")

On every log (`on_log`, each `logging_steps` optimizer steps) it turns TRL's logged metrics into the
monitor's signals by the TRL table of `integrations/signals.py` (the one `rldyn doctor` reads
trainer_state.json with), checks the rules of `analysis/health_rules.py` and carries out their
actions where a callback can: record (the event row), warn (also a console line), stop
(`control.should_training_stop`: the trainer ends the run after this step). At the end
(`on_train_end`) it writes `events.jsonl` and `health_report.html` (verdict, timeline, events,
glossary) into the trainer's `args.output_dir`.

What a callback cannot do, so `skip` and `rollback` are written and said as warn, with a note:
- skip: the monitor's skip refuses a spiking optimizer step before it is taken; TRL logs a step's
  gradient norm after its optimizer step, so the callback learns of a spike when the weights have
  already moved;
- rollback: going back to a checkpoint and on with new sampling seeds is the trainer's loop, not a
  callback's (a callback cannot reload the weights and optimizer state and rewind the data and the
  step counter).

TRL does not log every signal the rules read: the rules without theirs cannot fire, and the report
names them (`signals.TRL` lists what is mapped).
"""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from rldynamics.analysis.health_events import Monitor, StepHealth
from rldynamics.integrations.doctor import actions, health_settings, write_health
from rldynamics.integrations.signals import (
    TRL,
    cannot_run_line,
    signals_of,
    timeline_row,
    values_of,
)

CAN = ("record", "warn", "stop")  # the actions a callback carries out
CANNOT = {"skip": "a callback learns of a step's gradient norm after its optimizer step",
          "rollback": "a callback cannot reload a checkpoint and rewind the trainer"}
INSTALL = 'the TRL callback needs TRL: pip install "rldynamics[trl]"'


def _require_trl() -> None:
    try:
        import trl  # noqa: F401
    except ImportError:
        raise ImportError(INSTALL) from None


def _override(key: str, value) -> str:
    text = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return f"health.{key}={text}"


class HealthCallback(TrainerCallback):
    """The health monitor's rules over TRL's logged metrics, with record / warn / stop (skip and
    rollback are warned instead: see the module's docstring).

    `settings`: `health.*` keys without the prefix (`entropy_collapse="stop"`,
    `zero_variance_steps=3`; the defaults and their meaning: docs/health.md). `out`: where
    events.jsonl and health_report.html go (default: the trainer's `args.output_dir`)."""

    def __init__(self, out: str | Path | None = None, **settings):
        _require_trl()
        self.cfg = health_settings(None, [_override(k, v) for k, v in settings.items()]).health
        self.monitor = Monitor(self.cfg, actions(self.cfg, CAN, CANNOT))
        self.out = out
        self.rows: list[dict] = []  # rldynamics' names, for the report's timeline
        self.events: list[dict] = []
        self.seen: set[str] = set()
        self.last_step = 0  # the last step the rules saw

    def on_train_begin(self, args, state, control, **kwargs):
        """A resumed run: the steps its checkpoint logged go through the rules first (written, not
        said again), so that the rules' histories go on where the run left them."""
        for row in state.log_history:
            step = row.get("step")
            if isinstance(step, int) and step > self.last_step:
                self.check(step, row, state.max_steps)

    def on_log(self, args, state, control, logs=None, **kwargs):
        said = self.check(state.global_step, logs or {}, state.max_steps)
        if said is None:
            return
        if state.is_world_process_zero:
            for row in said.rows:
                if row["action"] != "record":
                    said_by = f"({row['rule']}: {row['action']})"
                    print(f"health at step {state.global_step}: {row['message']} {said_by}")
        if said.stop is not None:
            control.should_training_stop = True  # every process decides the same from the same logs

    def check(self, step: int, logs: dict, max_steps: int) -> StepHealth | None:
        """The rules on one logged step (None for a log without TRL's training metrics: an
        evaluation, the run's summary)."""
        v = values_of(logs, TRL)
        if not v:
            return None
        self.seen |= set(v)
        self.last_step = step
        said = self.monitor.step(signals_of(step, v, step / max(max_steps, 1)))
        self.rows.append(timeline_row(step, v, said.flags))
        self.events += said.rows
        return said

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        out = Path(self.out or args.output_dir)
        notes = [f"TRL run in {args.output_dir}, watched by rldynamics' HealthCallback "
                 f"({state.global_step} of {state.max_steps} steps)", cannot_run_line(self.seen)]
        write_health(out, Path(args.output_dir).resolve().name, self.rows, self.events, notes)
