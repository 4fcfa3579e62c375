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

import hashlib
import math

import numpy as np
import torch

from rldynamics import dist
from rldynamics import metric_names as names
from rldynamics.config import Config
from rldynamics.models.sharding import full_state_dict
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.tracking.step_records import (
    prune_records,
    run_identity,
    state_before_path,
    write_record,
)
from rldynamics.train.checkpoint import (
    TrainingState,
    capture_state,
    checkpoint_step,
    checkpoints,
    state_bytes,
    write_state,
)
from rldynamics.train.diagnostics.base import END, Diagnostic, DiagnosticResult, Needs, StepRecord

RECORDS_OFF = ["record.every=0", "record.steps=[]", "record.on_alarm=false"]  # overrides of a job that records nothing


class StepRecorder(Diagnostic):
    """Writes `records/step_<N>.safetensors` on the scheduled, chosen and alarmed steps, with the state before the
    step beside it; keeps the state after the last step in memory for that."""

    name, point = "step_records", END

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
        return Needs(update_logprobs=True)  # the trainer's log-probs of a single-pass update: kept, not recomputed

    def run(self, s, record: StepRecord) -> DiagnosticResult:
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
                                            trainer_state=_trainer_state(s, record))
        return result

    def _write(self, s, record: StepRecord, reasons: list[str]) -> DiagnosticResult:
        """The record of `record`'s step (and the state before it), its size in bytes as the metric."""
        digest = weights_digest(s.model) if record.update is not None else None  # collective when sharded
        if not s.main:
            return DiagnosticResult({})
        tensors, meta = record_contents(s, record)
        state = self._state_before(s, record.step)
        meta.update(reasons=reasons, weights_after=digest, state_before=state is not None)
        path = write_record(s.run_dir, record.step, tensors, meta)
        prune_records(s.run_dir, self.cfg.record.keep_last, keep=set(self.cfg.record.steps))
        size = path.stat().st_size + (_tree_bytes(state) if state is not None else 0)
        return DiagnosticResult({names.RECORD_BYTES: float(size)})

    def _state_before(self, s, step: int):
        """Write the state before `step` beside its record where a replay would not find it otherwise; its path."""
        before = self.last_state
        if before is None or before.step != step - 1:
            return None  # the first step of this process: the base model, or the checkpoint it started from
        if self.cfg.checkpoint.keep_last == 0 and any(checkpoint_step(p) == step - 1 for p in checkpoints(s.run_dir)):
            return None  # the run keeps a checkpoint of that step
        return write_state(state_before_path(s.run_dir, step), before, model=s.model, tokenizer=s.tokenizer,
                           critic=s.critic)

    def _may_keep_state(self, s) -> bool:
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


def _trainer_state(s, record: StepRecord) -> dict:
    """The trainer state a checkpoint of `record`'s step saves: the early stopper's and the diagnostics' states."""
    from rldynamics.train.diagnostics import diagnostic_states

    return {"early_stop": record.early_stop or {}, "diagnostics": diagnostic_states(s.diagnostics)}


def _tree_bytes(path) -> int:
    """The bytes of the files under `path`."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def record_contents(s, record: StepRecord) -> tuple[dict[str, np.ndarray], dict]:
    """The tensors and meta of the record of `record`'s step (`tracking/step_records.py` lists them)."""
    batch = record.rollout
    tensors = batch_tensors(batch)
    meta = {"seed_step": record.seed_step, "attempt": s.attempt, "env_seeds": list(batch.seeds),
            "reward_names": list(batch.reward_names), "reward_weights": list(batch.reward_weights),
            "env_metrics": batch.env_metrics, "threads": torch.get_num_threads(),
            "sampling_seed": record.sampling_seed, "pieces": token_pieces(s.tokenizer, batch),
            "run": {"id": run_identity(s.run_dir, create=True), "name": s.run_dir.name}}
    filtered = record.filtered
    kept = kept_rows(batch, filtered.batch) if filtered is not None else []
    tensors["kept_rows"] = np.asarray(kept, dtype=np.int64)
    if filtered is not None:
        meta["filter"] = {"kept_ratio": filtered.kept_ratio, "reward_std": filtered.reward_std}
    if record.prepared is not None:
        inputs = record.prepared.inputs
        tensors["advantages"] = _f32(inputs.advantages)
        meta["passes"] = {"old_logprobs": inputs.old_logprobs is not None,
                          "ref_logprobs": inputs.ref_logprobs is not None}
    for key, values in (("trainer_logprobs", record.rollout_policy_logprobs()),
                        ("entropy", record.rollout_policy_entropy())):
        if values is not None:
            tensors[key] = _f32(values)
    if record.update is not None:
        meta["update"] = {"steps": [{"grad_norm": t.grad_norm, "clipped": t.clipped, "skipped": t.skipped,
                                     "refused": t.skipped and math.isfinite(t.grad_norm)} for t in record.update.steps],
                          "metrics": {k: v for k, v in record.update.metrics.items() if k.startswith("actor/")}}
    return tensors, meta


def batch_tensors(batch: RolloutBatch) -> dict[str, np.ndarray]:
    """The per-row tensors of a rollout, in the record's dtypes."""
    out = {"input_ids": batch.input_ids.numpy().astype(np.int32),
           "attention_mask": batch.attention_mask.numpy().astype(np.uint8),
           "response_mask": batch.response_mask.numpy().astype(np.uint8),
           "scores": _f32(batch.scores), "group_ids": batch.group_ids.numpy().astype(np.int64)}
    if batch.rollout_logprobs is not None:
        out["rollout_logprobs"] = _f32(batch.rollout_logprobs)
    if batch.reward_components is not None:
        out["reward_components"] = _f32(batch.reward_components)
    return out


def kept_rows(batch: RolloutBatch, kept: RolloutBatch) -> list[int]:
    """The rows of `batch` that the filter kept (whole groups, in batch order)."""
    ids = set(kept.group_ids.tolist())
    return [i for i, g in enumerate(batch.group_ids.tolist()) if g in ids]


def token_pieces(tokenizer, batch: RolloutBatch) -> dict[str, str]:
    """Every token id of the batch's attended positions -> its text decoded alone (what the sample browser shows
    token by token)."""
    ids = sorted(set(batch.input_ids[batch.attention_mask > 0].tolist()))
    return {str(t): tokenizer.decode([t]) for t in ids}


def weights_digest(model: torch.nn.Module) -> str | None:
    """SHA-256 over the actor's weights (names, dtypes, shapes, bytes; in name order): equal digests mean bit-identical
    weights. Sharded models are gathered first (a collective; None on the ranks other than 0)."""
    state = full_state_dict(model)
    if state is None:
        state = model.state_dict()
    elif not state:
        return None
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _f32(values: torch.Tensor) -> np.ndarray:
    return values.detach().float().cpu().numpy()
