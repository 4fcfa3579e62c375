"""The step recorder: keeps a compact record of chosen steps in the run directory (`tracking/step_records.py`).

A step is recorded on the schedule (`record.every`), when chosen (`record.steps`) and when a health rule starts
firing on it (`record.on_alarm`; the recorder runs after the health monitor at END). The record holds the whole
rollout (token ids, masks, the sampler's log-probs, rewards per component, groups, env seeds and the sampling seed),
the filter's choice, the trained advantages, the trainer's log-probs and entropies of the sampled tokens, the
passes and optimizer steps the update made, and a digest of the weights after it: with the checkpoint before the
step, enough for `rldyn replay` to recompute the update and check it (train/replay.py). Nothing it does changes
training: the only pass it asks for is the update's own log-probs, which the update computes anyway.

The state before a recorded step: a step recorded for an alarm is known only at its end, so the recorder keeps the
state after every step in memory (`checkpoint.capture_state(copy=True)`: weights, optimizer, critic, RNG and trainer
state) and writes the one before a recorded step beside its record (`records/step_<N>.before/`, a checkpoint of
step N - 1) unless the run keeps a checkpoint of that step. `record.state_before_mb` bounds what it may hold; one
process only. A replay then starts from it instead of training the run again.
"""

from __future__ import annotations

from rldynamics import dist
from rldynamics import metric_names as names
from rldynamics.config import Config
from rldynamics.tracking.step_records import prune_records, state_before_path
from rldynamics.train.checkpoint import (
    TrainingState,
    capture_state,
    checkpoint_step,
    checkpoints,
    state_bytes,
    write_state,
)
from rldynamics.train.diagnostics.base import (
    END,
    TRAIN,
    Diagnostic,
    DiagnosticResult,
    Needs,
    StepRecord,
    trainer_state,
)
from rldynamics.train.record_io import recorded_step, weights_digest
from rldynamics.train.session import Session


class StepRecorder(Diagnostic):
    """Writes `records/step_<N>.safetensors` on the scheduled, chosen and alarmed steps, with the state before the
    step beside it; keeps the state after the last step in memory for that."""

    name, point = "step_records", END
    jobs = frozenset({TRAIN})  # a probe trains nothing; a replay's retraining keeps no records of its own

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.keeps_state: bool | None = None  # decided at the first step, from the state's size
        self.last_state: TrainingState | None = None  # the state after the last step of this process

    @staticmethod
    def enabled(cfg: Config) -> bool:
        r = cfg.record
        return r.every > 0 or bool(r.steps) or (r.on_alarm and cfg.health.enabled)

    def scheduled(self, step: int) -> list[str]:
        """Why `step` is recorded whatever happens in it (`every`, `chosen`)."""
        r = self.cfg.record
        return (["every"] if r.every > 0 and step % r.every == 0 else []) + (["chosen"] if step in r.steps else [])

    def due(self, step: int) -> bool:
        return bool(self.scheduled(step)) or (self.cfg.record.on_alarm and self.cfg.health.enabled)

    def needs(self, step: int) -> Needs:
        return Needs(update_logprobs=True)  # the trainer's log-probs the update took itself: kept, not recomputed

    def run(self, s: Session, record: StepRecord) -> DiagnosticResult:
        reasons = self.scheduled(record.step)
        if self.cfg.record.on_alarm:
            reasons += [f"alarm:{rule}" for result in record.results.values() for rule in result.alarms]
        if self.keeps_state is None:
            self.keeps_state = self._may_keep_state(s)
        result = DiagnosticResult({})
        if reasons and record.rollout is not None:
            result = self._write(s, record, reasons)
        if self.keeps_state:
            self.last_state = capture_state(record.step, model=s.model, optimizer=s.optimizer, critic=s.critic,
                                            critic_optimizer=s.critic_optimizer, copy=True,
                                            trainer_state=trainer_state(record.early_stop or {}, s.diagnostics))
        return result

    def _write(self, s: Session, record: StepRecord, reasons: list[str]) -> DiagnosticResult:
        """The record of `record`'s step (and the state before it), its size in bytes as the metric."""
        digest = weights_digest(s.model) if record.update is not None else None  # collective when sharded
        if not s.main:
            return DiagnosticResult({})
        state = self._state_before(s, record.step)
        path = recorded_step(s, record, reasons, digest, state is not None).write(s.run_dir)
        prune_records(s.run_dir, self.cfg.record.keep_last, keep=set(self.cfg.record.steps))
        size = path.stat().st_size + (_tree_bytes(state) if state is not None else 0)
        return DiagnosticResult({names.RECORD_BYTES: float(size)})

    def _state_before(self, s: Session, step: int):
        """Write the state before `step` beside its record where a replay would not find it otherwise; its path."""
        before = self.last_state
        if before is None or before.step != step - 1:
            return None  # the first step of this process: the base model, or the checkpoint it started from
        if self.cfg.checkpoint.keep_last == 0 and any(checkpoint_step(p) == step - 1 for p in checkpoints(s.run_dir)):
            return None  # the run keeps a checkpoint of that step
        return write_state(state_before_path(s.run_dir, step), before, model=s.model, tokenizer=s.tokenizer,
                           critic=s.critic)

    def _may_keep_state(self, s: Session) -> bool:
        """Whether this run keeps the state before each step in memory (one process, within record.state_before_mb);
        says so once when the size rules it out."""
        limit = self.cfg.record.state_before_mb
        if limit <= 0 or dist.distributed():
            return False
        size = state_bytes(s.model, s.critic) / 2**20
        if size > limit and s.main:
            print(f"note: records keep no state before their step ({size:.0f} MiB > record.state_before_mb={limit:g}):"
                  " `rldyn replay` of a step without a checkpoint before it trains the run again from the last one")
        return size <= limit


def _tree_bytes(path) -> int:
    """The bytes of the files under `path`."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
