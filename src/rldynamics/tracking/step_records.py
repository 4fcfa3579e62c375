"""Step records: what one training step trained on, kept compactly in the run directory so that the step can be
looked at (the report's sample browser), recomputed from the checkpoint before it (`rldyn replay`) and attributed
to its samples and tokens (`rldyn replay --attribute`).

A record is one safetensors file, `records/step_<N>.safetensors`: its tensors and, in the header's metadata, one
JSON object (`meta`). This module imports no torch: readers get numpy arrays (a report can be written on any machine
with the run directory copied over).

Tensors (N trajectories of the whole rollout before the filter, L token positions, K reward components, M rows kept
by the filter, in batch order; per-token conventions of `rollout.batch`):

    input_ids          int32   [N, L]  token ids, right-padded
    attention_mask     uint8   [N, L]
    response_mask      uint8   [N, L]  1 on the tokens the policy sampled (the trained tokens)
    rollout_logprobs   float32 [N, L]  the sampler's log-prob of each sampled token (absent without them)
    scores             float32 [N]     the trained reward (weighted sum of the components)
    group_ids          int64   [N]     trajectories of a group share a prompt
    reward_components  float32 [N, K]  raw reward components (absent without them)
    kept_rows          int64   [M]     rows the filter kept (whole groups)
    advantages         float32 [M, L]  the trained advantages of the kept rows (absent when nothing was prepared)
    trainer_logprobs   float32 [M, L]  the trainer's log-probs of the kept rows' sampled tokens under the rollout
                                       policy (absent when no pass computed them)
    entropy            float32 [M, L]  the rollout policy's entropy at each sampled token (absent likewise)

The per-token floats are stored packed: only their values on the response mask (of all rows, or of the kept rows),
in row-major order; `read_record` returns them unpacked to [N, L] / [M, L] with zeros elsewhere (where the trainer
and the sampler put zeros too). A step's record is therefore about the size of its token ids.

`meta` (JSON): `format`, `step`, `seed_step` (the step whose env and sampling seeds were drawn), `attempt`
(rollbacks before it), `sampling_seed`, `env_seeds` [N], `reward_names`, `reward_weights`, `env_metrics` [N],
`reasons` (why it was recorded: `every`, `chosen`, `alarm:<rule>`), `filter` (kept ratio, mean group reward std),
`passes` (which no-grad passes the step ran: `old_logprobs`, `ref_logprobs`), `update` (per optimizer step: grad
norm, clipped, skipped, refused by a guard; the step's `actor/*` losses), `weights_after` (SHA-256 of the actor's
weights after the step, `weights_digest`), `threads` (torch's CPU threads), `pieces` (token id -> its text decoded
alone, for every id in the record: what the sample browser shows token by token), `state_before` (whether
`records/step_<N>.before/` holds the state the step started from), `run` (the run that wrote it:
`id`, its directory's `run_id`, and `name`; absent from records written before records named it).

`records/step_<N>.before/` (optional): the weights, optimizer, critic, RNG and trainer state before step N, in the
checkpoint format of `train/checkpoint.py` (a checkpoint of step N - 1), so that `rldyn replay` starts from it.
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from rldynamics.tracking.files import refuse_link, remove, write_file

FORMAT = "rldynamics-step-record/1"
RECORDS_DIR = "records"
PACKED_ALL = ("rollout_logprobs",)  # per-token floats of every row, stored on the response mask only
PACKED_KEPT = ("advantages", "trainer_logprobs", "entropy")  # ... of the kept rows
_NAME = re.compile(r"step_(\d+)\.safetensors")


class RecordError(ValueError):
    """A step record that cannot be used; the message names the file and what is wrong."""


REPLAYS_DIR = "replays"  # `rldyn replay` writes replays/step_<N>[_<what-if>]/ (`train/replay.py`)
ATTRIBUTION_FILE = "attribution.json"  # in a replay's directory: `train/replay.py` `attribution_json`
RUN_ID_FILE = "run_id"  # the run directory's id: written with its first record, kept across resumes


def run_identity(run_dir: str | Path, create: bool = False) -> str | None:
    """The id of the run in `run_dir` (`RUN_ID_FILE`, a random hex string), written first when
    `create` and the run has none; None for a run without one."""
    path = Path(run_dir) / RUN_ID_FILE
    if create and not path.is_file():
        write_file(path, uuid.uuid4().hex + "\n")
    return path.read_text().strip() if path.is_file() else None


def replay_dir(run_dir: str | Path, step: int, what_if: str = "") -> Path:
    """Where the replay of `step` (as recorded, or the what-if named `what_if`) is written."""
    return Path(run_dir) / REPLAYS_DIR / (f"step_{step}" + (f"_{what_if}" if what_if else ""))


def attribution_path(run_dir: str | Path, step: int) -> Path:
    """The attribution of `step`'s gradient, written by `rldyn replay --attribute`."""
    return replay_dir(run_dir, step) / ATTRIBUTION_FILE


def record_path(run_dir: str | Path, step: int) -> Path:
    """Where the record of `step` lives."""
    return Path(run_dir) / RECORDS_DIR / f"step_{step}.safetensors"


def state_before_path(run_dir: str | Path, step: int) -> Path:
    """Where the state before `step` is kept beside its record (a checkpoint of step - 1, `record.state_before_mb`)."""
    return Path(run_dir) / RECORDS_DIR / f"step_{step}.before"


def write_record(run_dir: str | Path, step: int, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> Path:
    """Write the record of `step` atomically (replacing one of the same step); returns its path."""
    from safetensors.numpy import save

    directory = Path(run_dir) / RECORDS_DIR
    refuse_link(directory)
    directory.mkdir(parents=True, exist_ok=True)
    data = save({k: np.ascontiguousarray(v) for k, v in _packed(tensors).items()},
                metadata={"format": FORMAT, "meta": json.dumps({"format": FORMAT, "step": step, **meta})})
    return write_file(record_path(run_dir, step), data)


def read_record(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The tensors and meta of a record; RecordError naming the file for anything that is not one."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    path = Path(path)
    if not path.is_file():
        raise RecordError(f"{path}: no such step record (list a run's records with `ls <run>/{RECORDS_DIR}`)")
    data = path.read_bytes()
    try:
        tensors = load(data)
        header = _header_metadata(data)
        meta = json.loads(header.get("meta", "null"))
    except (SafetensorError, ValueError, KeyError) as e:
        raise RecordError(f"{path}: not a readable step record ({e.__class__.__name__}: {e}); it was cut short or "
                          "damaged: remove it (the step can be recorded again with record.steps=[N])") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise RecordError(f"{path}: not a step record of format {FORMAT} (found {header.get('format')!r})")
    missing = [k for k in ("input_ids", "attention_mask", "response_mask", "scores", "group_ids", "kept_rows")
               if k not in tensors]
    if missing:
        raise RecordError(f"{path}: step record without {', '.join(missing)}")
    try:
        return _unpacked(tensors), meta
    except ValueError as e:
        raise RecordError(f"{path}: {e}") from None


def _masks(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The mask each packed tensor is stored on: the response mask of all rows, or of the kept rows. [N, L] bool"""
    mask = tensors["response_mask"].astype(bool)
    kept = mask[tensors["kept_rows"]] if "kept_rows" in tensors else mask[:0]
    return {**dict.fromkeys(PACKED_ALL, mask), **dict.fromkeys(PACKED_KEPT, kept)}


def _packed(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`tensors` with the per-token floats reduced to their values on their mask. [T] each"""
    masks = _masks(tensors)
    return {k: v[masks[k]] if k in masks else v for k, v in tensors.items()}


def _unpacked(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse of `_packed`: packed values back in place, zeros elsewhere."""
    masks = _masks(tensors)
    out = dict(tensors)
    for k, mask in masks.items():
        if k in tensors:
            if tensors[k].shape != (int(mask.sum()),):
                raise ValueError(f"{k} holds {tensors[k].shape} values for {int(mask.sum())} response tokens")
            full = np.zeros(mask.shape, dtype=tensors[k].dtype)
            full[mask] = tensors[k]
            out[k] = full
    return out


def _header_metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors file's JSON header."""
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + size]).get("__metadata__") or {}


def records(run_dir: str | Path) -> list[Path]:
    """The run's step records, by step."""
    directory = Path(run_dir) / RECORDS_DIR
    found = [p for p in directory.glob("step_*.safetensors") if _NAME.fullmatch(p.name)] if directory.is_dir() else []
    return sorted(found, key=record_step)


def record_step(path: str | Path) -> int:
    """The step of a record file's name."""
    match = _NAME.fullmatch(Path(path).name)
    if match is None:
        raise RecordError(f"{path}: not a step record's name (step_<N>.safetensors)")
    return int(match.group(1))


def prune_records(run_dir: str | Path, keep_last: int, keep: set[int] = frozenset()) -> list[Path]:
    """Keep only the newest `keep_last` records (0 = all) and those of the steps in `keep`; returns the removed."""
    if keep_last <= 0:
        return []
    found = records(run_dir)
    gone = [p for p in found[:-keep_last] if record_step(p) not in keep]
    for p in gone:
        remove(p)
        state = state_before_path(run_dir, record_step(p))
        if state.exists():
            remove(state)
    return gone

