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
(rollbacks before it), `sampling_seed`, `policy_version` (with `rollout.staleness`: the step whose weights sampled
the rollout, 0 = the start), `env_seeds` [N], `reward_names`, `reward_weights`, `env_metrics` [N],
`reasons` (why it was recorded: `every`, `chosen`, `alarm:<rule>`), `filter` (kept ratio, mean group reward std),
`passes` (which no-grad passes the step ran: `old_logprobs`, `ref_logprobs`), `update` (per optimizer step: grad
norm, clipped, skipped, refused by a guard; the step's `actor/*` losses), `weights_after` (SHA-256 of the actor's
weights after the step, `weights_digest`), `threads` (torch's CPU threads of each rank), `ranks` (how many
trained the step; 1 where absent), `pieces` (token id -> its text decoded alone, for every id in the record: what
the sample browser shows token by token), `state_before` (whether
`records/step_<N>.before/` holds the state the step started from), `run` (the run that wrote it:
`id`, its directory's `run_id`, and `name`; absent from records written before records named it).

`records/step_<N>.before/` (optional): the weights, optimizer, critic, RNG and trainer state before step N, in the
checkpoint format of `train/checkpoint.py` (a checkpoint of step N - 1), so that `rldyn replay` starts from it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rldynamics.tracking.files import refuse_link, remove, write_file

FORMAT = "rldynamics-step-record/1"
FORMATS = (FORMAT,)  # the formats this version reads (each a `RecordedStep.from_file` of its own)
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
    if not isinstance(meta, dict) or meta.get("format") not in FORMATS:
        found = header.get("format")
        why = ("not a step record" if found is None else
               "a step record of a newer rldynamics (upgrade it to read this one)")
        raise RecordError(f"{path}: {why}: format {found!r}; this version reads {', '.join(FORMATS)}")
    missing = [k for k in ("input_ids", "attention_mask", "response_mask", "scores", "group_ids", "kept_rows")
               if k not in tensors]
    if missing:
        raise RecordError(f"{path}: step record without {', '.join(missing)}")
    try:
        return _unpacked(tensors), meta
    except ValueError as e:
        raise RecordError(f"{path}: {e}") from None


@dataclass(frozen=True)
class OptimizerStepRecord:
    """One optimizer step of a recorded update."""

    grad_norm: float  # pre-clip
    clipped: bool
    skipped: bool  # not taken: a non-finite gradient, or refused by a guard
    refused: bool  # refused by a guard (the health monitor's gradient-spike rule)


@dataclass(frozen=True)
class RecordedStep:
    """A step record, typed: the rollout (N rows before the filter), the filter's kept rows (M), what the update
    ran and made, and what the browser shows. Arrays as `read_record` returns them (unpacked); None where the
    record has none."""

    step: int
    seed_step: int  # the step whose env and sampling seeds were drawn
    input_ids: np.ndarray  # [N, L] int32
    attention_mask: np.ndarray  # [N, L] uint8
    response_mask: np.ndarray  # [N, L] uint8
    scores: np.ndarray  # [N] float32
    group_ids: np.ndarray  # [N] int64
    kept_rows: np.ndarray  # [M] int64
    env_seeds: tuple[int, ...] = ()  # [N]
    env_metrics: tuple[dict, ...] = ()  # [N]
    reward_names: tuple[str, ...] = ()
    reward_weights: tuple[float, ...] = ()
    reward_components: np.ndarray | None = None  # [N, K] float32
    rollout_logprobs: np.ndarray | None = None  # [N, L] float32
    advantages: np.ndarray | None = None  # [M, L] float32
    trainer_logprobs: np.ndarray | None = None  # [M, L] float32
    entropy: np.ndarray | None = None  # [M, L] float32
    attempt: int = 0
    sampling_seed: int | None = None
    policy_version: int | None = None  # rollout.staleness: the step whose weights sampled the rollout (None: these)
    threads: int | None = None
    ranks: int = 1  # the ranks that trained the step (torchrun, `rldyn train --nproc`)
    reasons: tuple[str, ...] = ()
    kept_ratio: float | None = None  # the filter's
    reward_std: float | None = None  # mean group reward std before the filter
    old_logprobs_pass: bool | None = None  # which no-grad passes ran (None: nothing was prepared)
    ref_logprobs_pass: bool | None = None
    update_steps: tuple[OptimizerStepRecord, ...] | None = None  # None: no actor update
    update_metrics: dict[str, float] = field(default_factory=dict)  # the update's `actor/*` losses
    weights_after: str | None = None
    state_before: bool = False
    pieces: dict[int, str] = field(default_factory=dict)  # token id -> its text decoded alone
    run_id: str | None = None  # the run that wrote it (None: written before records named their run)
    run_name: str | None = None

    @classmethod
    def read(cls, path: str | Path) -> RecordedStep:
        """The record at `path`; RecordError naming the file for anything this version cannot read."""
        tensors, meta = read_record(path)
        return cls.from_file(tensors, meta)

    @classmethod
    def from_file(cls, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> RecordedStep:
        """A record of `FORMATS` from its tensors and meta (`read_record`)."""
        update, run, passes, filt = meta.get("update"), meta.get("run") or {}, meta.get("passes"), meta.get("filter")
        steps = None if update is None else tuple(OptimizerStepRecord(
            s["grad_norm"], bool(s["clipped"]), bool(s["skipped"]), bool(s.get("refused", False)))
            for s in update.get("steps", []))
        return cls(step=meta["step"], seed_step=meta.get("seed_step", meta["step"]),
                   **{k: tensors.get(k) for k in (*_ROLLOUT, *_OPTIONAL)},
                   env_seeds=tuple(meta.get("env_seeds", ())), env_metrics=tuple(meta.get("env_metrics", ())),
                   reward_names=tuple(meta.get("reward_names", ())),
                   reward_weights=tuple(meta.get("reward_weights", ())), attempt=meta.get("attempt", 0),
                   sampling_seed=meta.get("sampling_seed"), policy_version=meta.get("policy_version"),
                   threads=meta.get("threads"), ranks=int(meta.get("ranks", 1)),
                   reasons=tuple(meta.get("reasons", ())),
                   kept_ratio=filt.get("kept_ratio") if filt else None,
                   reward_std=filt.get("reward_std") if filt else None,
                   old_logprobs_pass=passes.get("old_logprobs") if passes else None,
                   ref_logprobs_pass=passes.get("ref_logprobs") if passes else None,
                   update_steps=steps, update_metrics=dict(update.get("metrics", {})) if update else {},
                   weights_after=meta.get("weights_after"), state_before=bool(meta.get("state_before")),
                   pieces={int(k): str(v) for k, v in meta.get("pieces", {}).items()},
                   run_id=run.get("id"), run_name=run.get("name"))

    def to_file(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Its tensors and meta as `write_record` takes them (without `format` and `step`, which it adds)."""
        tensors = {k: getattr(self, k) for k in (*_ROLLOUT, *_OPTIONAL) if getattr(self, k) is not None}
        meta: dict[str, Any] = {"seed_step": self.seed_step, "attempt": self.attempt,
                                "env_seeds": list(self.env_seeds), "reward_names": list(self.reward_names),
                                "reward_weights": list(self.reward_weights), "env_metrics": list(self.env_metrics),
                                "threads": self.threads, "ranks": self.ranks, "sampling_seed": self.sampling_seed,
                                "pieces": {str(k): v for k, v in self.pieces.items()}}
        if self.run_id is not None:
            meta["run"] = {"id": self.run_id, "name": self.run_name}
        if self.policy_version is not None:
            meta["policy_version"] = self.policy_version
        if self.kept_ratio is not None:
            meta["filter"] = {"kept_ratio": self.kept_ratio, "reward_std": self.reward_std}
        if self.old_logprobs_pass is not None:
            meta["passes"] = {"old_logprobs": self.old_logprobs_pass, "ref_logprobs": self.ref_logprobs_pass}
        if self.update_steps is not None:
            meta["update"] = {"steps": [{"grad_norm": s.grad_norm, "clipped": s.clipped, "skipped": s.skipped,
                                         "refused": s.refused} for s in self.update_steps],
                              "metrics": dict(self.update_metrics)}
        meta.update(reasons=list(self.reasons), weights_after=self.weights_after, state_before=self.state_before)
        return tensors, meta

    def write(self, run_dir: str | Path) -> Path:
        """Write it as the record of its step in `run_dir` (atomically); its path."""
        tensors, meta = self.to_file()
        return write_record(run_dir, self.step, tensors, meta)

    @property
    def rows(self) -> int:
        """Trajectories in the rollout (N)."""
        return len(self.scores)


_ROLLOUT = ("input_ids", "attention_mask", "response_mask", "scores", "group_ids", "kept_rows")
_OPTIONAL = ("reward_components", "rollout_logprobs", "advantages", "trainer_logprobs", "entropy")


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

