"""Between a step and its record (`tracking/step_records.py`): the record of a step as it ran
(`recorded_step`), the recorded rollout as the batch it trained on (`batch_of`), the token pieces and the weights
digest. The step recorder (`train/diagnostics/records.py`) writes with these; `rldyn replay`
(`train/replay.py`) reads with them.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

from rldynamics import dist
from rldynamics.models.sharding import full_state_dict
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.tracking.step_records import OptimizerStepRecord, RecordedStep, run_identity
from rldynamics.train.session import Session
from rldynamics.train.step_record import StepRecord


def recorded_step(s: Session, record: StepRecord, reasons: list[str], weights_after: str | None,
                  state_before: bool) -> RecordedStep:
    """The record of `record`'s step (its rollout, the filter's kept rows, the passes, the optimizer steps), with
    why it is recorded, the weights digest after it and whether the state before it is kept beside it."""
    batch, filtered, prepared, update = record.rollout, record.filtered, record.prepared, record.update
    logprobs, entropy = record.rollout_policy_logprobs(), record.rollout_policy_entropy()
    return RecordedStep(
        step=record.step, seed_step=record.seed_step, **batch_tensors(batch),
        kept_rows=np.asarray(filtered.rows if filtered is not None else [], dtype=np.int64),
        env_seeds=tuple(batch.seeds), env_metrics=tuple(batch.env_metrics), reward_names=tuple(batch.reward_names),
        reward_weights=tuple(batch.reward_weights),
        advantages=_f32(prepared.inputs.advantages) if prepared is not None else None,
        trainer_logprobs=_f32(logprobs) if logprobs is not None else None,
        entropy=_f32(entropy) if entropy is not None else None,
        attempt=s.attempt, sampling_seed=record.sampling_seed, policy_version=record.policy_version,
        threads=torch.get_num_threads(), ranks=dist.world(), reasons=tuple(reasons),
        kept_ratio=filtered.kept_ratio if filtered is not None else None,
        reward_std=filtered.reward_std if filtered is not None else None,
        old_logprobs_pass=prepared.inputs.old_logprobs is not None if prepared is not None else None,
        ref_logprobs_pass=prepared.inputs.ref_logprobs is not None if prepared is not None else None,
        update_steps=None if update is None else tuple(
            OptimizerStepRecord(t.grad_norm, t.clipped, t.skipped, t.skipped and math.isfinite(t.grad_norm))
            for t in update.steps),
        update_metrics={k: v for k, v in update.metrics.items() if k.startswith("actor/")} if update else {},
        weights_after=weights_after, state_before=state_before, pieces=token_pieces(s.tokenizer, batch),
        run_id=run_identity(s.run_dir, create=True), run_name=s.run_dir.name)


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


def batch_of(record: RecordedStep) -> RolloutBatch:
    """The recorded rollout as the `RolloutBatch` the step trained on (the dtypes of `rollout.agent`)."""

    def t(values: np.ndarray | None, dtype: torch.dtype) -> torch.Tensor | None:
        return torch.from_numpy(np.array(values)).to(dtype) if values is not None else None

    return RolloutBatch(input_ids=t(record.input_ids, torch.long), attention_mask=t(record.attention_mask, torch.long),
                        response_mask=t(record.response_mask, torch.float32), scores=t(record.scores, torch.float32),
                        group_ids=t(record.group_ids, torch.long),
                        reward_components=t(record.reward_components, torch.float32),
                        reward_names=record.reward_names, reward_weights=record.reward_weights,
                        env_metrics=list(record.env_metrics),
                        rollout_logprobs=t(record.rollout_logprobs, torch.float32), seeds=list(record.env_seeds))


def token_pieces(tokenizer, batch: RolloutBatch) -> dict[int, str]:
    """Every token id of the batch's attended positions -> its text decoded alone (what the sample browser shows
    token by token)."""
    ids = sorted(set(batch.input_ids[batch.attention_mask > 0].tolist()))
    return {t: tokenizer.decode([t]) for t in ids}


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
