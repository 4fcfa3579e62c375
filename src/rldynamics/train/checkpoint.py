"""Checkpoints: safetensors weights loadable with `from_pretrained`, plus optimizer, RNG and trainer state.

Layout of `checkpoints/step_<N>/`:
    actor/             model + tokenizer (`AutoModelForCausalLM.from_pretrained(...)` works on it); with LoRA the
                       adapter in peft's format + tokenizer (`PeftModel.from_pretrained(base, ...)` works on it)
    actor_merged/      LoRA with `checkpoint.save_merged`: the base with the adapters merged in, a whole model
    critic/            value model (GAE only)
    optimizer.pt       actor (and critic) optimizer state dicts: tensors and plain containers only
    rng.pt             torch RNG state (`torch`; written by several ranks also `ranks`: every rank's, in order)
    trainer_state.json step, early-stop state, the collapse diagnostics' EMA
    sampler.pt         rollout.staleness >= 1: the earlier versions of the trained weights that later steps'
                       rollouts sample with (`train/lagged.py`), version -> {parameter name: tensor}
    manifest.json      size and SHA-256 of every other file; written last

Writes go to a temporary sibling directory (`.tmp_step_<N>_<pid>`) that is renamed into place once the
manifest is written, so a crash never leaves a half-written checkpoint; leftovers of a crash are removed
by `remove_stale` when the run starts again. A write that fails (a full disk) removes the temporary directory and
raises `CheckpointWriteError`, one line naming the checkpoint and the last complete one, which is still there.
Links where a checkpoint is written or removed are removed as links, never followed (`tracking.files`).

Loading verifies first (`verify_checkpoint`: the manifest, each file's size, the structure of the JSON and
safetensors files, each checksum), then loads with `torch.load(weights_only=True)` (no pickle code execution)
and checks the optimizer state against the model. Every problem is one `CheckpointError` line naming the file and
what is wrong, raised before any work.

Several ranks (torchrun): every rank calls `save_checkpoint`, which gathers the full weights and optimizer states
on rank 0 (collectives); rank 0 alone writes, in the same format as one process. A checkpoint therefore resumes on
any number of ranks: the weights are loaded by every rank and sharded, the optimizer state is read by rank 0 and
sent to each rank in its shards; each rank takes its own RNG state back when the number of ranks is the same
(rank 0's otherwise: every sampling stream is reseeded at each step, so nothing depends on it).
"""

from __future__ import annotations

import copy as copy_module
import json
import os
import re
import shutil
import signal
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from rldynamics import dist
from rldynamics.models.lora import ADAPTER_CONFIG, is_adapted, save_merged
from rldynamics.models.sharding import (
    full_optimizer_state,
    full_state_dict,
    is_sharded,
    load_full_optimizer_state,
    local,
)
from rldynamics.models.tiny import save_tokenizer
from rldynamics.tracking.files import remove, sha256_file, write_file

MANIFEST = "manifest.json"
FORMAT = "rldynamics-checkpoint/1"
REQUIRED = ("trainer_state.json", "optimizer.pt", "rng.pt")
SAMPLER = "sampler.pt"
ACTOR_CONFIGS = ("actor/config.json", f"actor/{ADAPTER_CONFIG}")  # a whole model's, or a LoRA adapter's: one of them
CRASH_ENV = "RLDYN_CRASH_AT"
_STEP_DIR = re.compile(r"step_(\d+)")
TRAIN_JOB, SFT_JOB = "train", "sft"  # trainer_state.json's `job` (absent: train): the command that wrote it


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and what is wrong."""


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (a full disk); the message names it and the last complete one."""


def crash_point(point: str, step: int) -> None:
    """Test hook: SIGKILL this process when the environment has `RLDYN_CRASH_AT=<point>:<step>`.

    Placed at the write boundaries of a step (see `tests/test_crash.py`), so a test can kill a real run
    exactly between two writes and check that the resumed run loses and repeats nothing. A no-op otherwise.
    """
    if os.environ.get(CRASH_ENV) == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class TrainingState:
    """What a checkpoint saves of a session, gathered on rank 0: the actor's and critic's weights (None: the model's
    own state dict, complete in one process), the optimizer states, every rank's RNG state and the trainer state."""

    step: int
    weights: dict[str, torch.Tensor] | None
    optim: dict
    critic_weights: dict[str, torch.Tensor] | None
    rng: list[torch.Tensor]
    trainer_state: dict
    sampler: dict | None = None  # rollout.staleness >= 1: version -> the trained weights of that step (`sampler.pt`)


def capture_state(step: int, *, model, optimizer, critic=None, critic_optimizer=None,
                  trainer_state: dict | None = None, copy: bool = False, sampler: dict | None = None) -> TrainingState:
    """The state `save_checkpoint` writes (collective when sharded: the whole state on rank 0, none elsewhere).
    `copy`: every tensor copied, so the state stays as it is while training goes on (a snapshot in memory; tied
    weights stay tied). `sampler`: the lagged sampler's earlier versions (`LaggedPolicy.saved`; they are copies
    already, never changed in place)."""
    weights = full_state_dict(model)
    optim = {"actor": full_optimizer_state(model, optimizer)}
    critic_weights = full_state_dict(critic) if critic is not None else None
    if critic is not None:
        optim["critic"] = full_optimizer_state(critic, critic_optimizer)
    state = TrainingState(step, weights, optim, critic_weights, dist.gather(torch.get_rng_state()),
                          dict(trainer_state or {}), sampler or None)
    if not copy:
        return state
    return TrainingState(step, _copied(model.state_dict() if weights is None else weights), copy_module.deepcopy(optim),
                         _copied(critic.state_dict() if critic_weights is None else critic_weights)
                         if critic is not None else None,
                         [r.clone() for r in state.rng], copy_module.deepcopy(state.trainer_state), state.sampler)


def state_bytes(*modules: torch.nn.Module | None) -> int:
    """About what `capture_state(copy=True)` holds: each module's weights plus two float32 AdamW moments of each
    trainable parameter (whole tensors: the same on every rank when sharded)."""
    total = 0
    for module in (m for m in modules if m is not None):
        total += sum(t.numel() * t.element_size() for t in _unique(module.state_dict()).values())
        total += sum(8 * p.numel() for p in module.parameters() if p.requires_grad)
    return total


def schedule_words(cfg, state_mb: float) -> str:
    """What the run's checkpoint schedule will hold on disk at most, for its start-up line, with `state_mb` the size
    of one checkpoint (`state_bytes`: the weights and two AdamW moments per trained weight; a LoRA run's are
    smaller, its adapters alone)."""
    c, steps = cfg.checkpoint, cfg.train.steps
    count = (steps // c.every if c.every > 0 else 0) + (1 if c.save_last and (c.every == 0 or steps % c.every) else 0)
    if c.keep_last > 0:
        count = min(count, c.keep_last)
    return (f"checkpoints: {count} of about {_mib(state_mb)} MiB each kept at most ({_mib(count * state_mb)} MiB; "
            "checkpoint.every and checkpoint.keep_last set it)")


def _mib(mb: float) -> str:
    """`1539` or `1.85`: whole MiB from 100 on, three significant digits below."""
    return f"{mb:.0f}" if mb >= 100 else f"{mb:.3g}"


def _points_to(t: torch.Tensor) -> tuple:
    """What a tensor views (a sharded one: its shard on this rank): equal for the names of one tied weight."""
    t = local(t)
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride()


def _unique(tensors: dict[str, torch.Tensor]) -> dict[tuple, torch.Tensor]:
    """The distinct tensors of a state dict (tied weights once)."""
    return {_points_to(t): t for t in tensors.values()}


def _copied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of a state dict in which the tensors that shared memory share it again (a tied embedding)."""
    copies = {key: t.detach().clone() for key, t in _unique(tensors).items()}  # each tied weight once
    return {name: copies[_points_to(t)] for name, t in tensors.items()}


def save_checkpoint(directory: Path, step: int, *, model, tokenizer, optimizer, critic=None, critic_optimizer=None,
                    trainer_state: dict | None = None, keep_last: int = 0, merged: bool = False,
                    sampler: dict | None = None) -> Path | None:
    """Write `directory/step_<step>` atomically (manifest last, then a rename) and return its path; then keep
    only the newest `keep_last` checkpoints (0 = keep all); `merged`: a LoRA actor's merged export too
    (`actor_merged/`). Several ranks: every rank calls it (the states are gathered collectively); rank 0 writes and
    returns the path, the others return None."""
    state = capture_state(step, model=model, optimizer=optimizer, critic=critic, critic_optimizer=critic_optimizer,
                          trainer_state=trainer_state, sampler=sampler)
    if not dist.is_main():
        return None
    final = write_state(directory / f"step_{step}", state, model=model, tokenizer=tokenizer, critic=critic,
                        merged=merged, crash_points=True)
    if keep_last > 0:
        for old in checkpoints(directory.parent)[:-keep_last]:
            _remove(old)
    return final


def write_state(final: Path, state: TrainingState, *, model, tokenizer, critic=None, merged: bool = False,
                crash_points: bool = False) -> Path:
    """Write `state` as a checkpoint directory `final` (the checkpoint format; model and critic give the configs),
    atomically: into a temporary sibling, manifest last, then renamed into place. Returns `final`."""
    tmp = final.with_name(f".tmp_{final.name}_{os.getpid()}")
    try:
        _write_files(tmp, state, model=model, tokenizer=tokenizer, critic=critic, merged=merged,
                     crash_points=crash_points)
    except (OSError, RuntimeError, SafetensorError) as e:  # torch and safetensors raise their own on a full disk
        _discard(tmp)
        raise CheckpointWriteError(_write_failure(final, e)) from None
    if crash_points:
        crash_point("checkpoint_manifest", state.step)
    if os.path.lexists(final):
        _remove(final)
    tmp.rename(final)
    return final


def _write_files(tmp: Path, state: TrainingState, *, model, tokenizer, critic, merged: bool,
                 crash_points: bool) -> None:
    """Every file of checkpoint `state.step` into a new directory `tmp` (whatever stood there is removed), manifest
    last."""
    if os.path.lexists(tmp):
        remove(tmp)
    tmp.mkdir(parents=True)  # never an existing directory or link: everything below is written into this new one
    _write_actor(tmp, model, tokenizer, state.weights, merged)
    if critic is not None:
        critic.save_pretrained(tmp / "critic", state_dict=state.critic_weights)
    torch.save(state.optim, tmp / "optimizer.pt")
    rng = state.rng
    torch.save({"torch": rng[0], **({"ranks": rng} if len(rng) > 1 else {})}, tmp / "rng.pt")
    write_file(tmp / "trainer_state.json", json.dumps({"step": state.step, **state.trainer_state}, indent=2))
    if state.sampler:
        torch.save(state.sampler, tmp / SAMPLER)
    if crash_points:
        crash_point("checkpoint_files", state.step)
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {"format": FORMAT, "step": state.step,
                "files": {p.relative_to(tmp).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
                          for p in files}}
    write_file(tmp / MANIFEST, json.dumps(manifest, indent=1))


def _write_actor(tmp: Path, model, tokenizer, weights, merged: bool) -> None:
    """`actor/`: the whole model, or a LoRA actor's adapter (peft's files, without the blank model card peft adds),
    with the tokenizer; with `merged` (LoRA only) also `actor_merged/`, the merged whole model with the tokenizer."""
    model.save_pretrained(tmp / "actor", safe_serialization=True, state_dict=weights)
    if is_adapted(model):
        (tmp / "actor" / "README.md").unlink(missing_ok=True)
    save_tokenizer(tokenizer, tmp / "actor")
    if merged and is_adapted(model):
        save_merged(model, tmp / "actor_merged", weights)
        save_tokenizer(tokenizer, tmp / "actor_merged")


def _write_failure(final: Path, error: Exception) -> str:
    """One line: which checkpoint failed and why, how much space is left, and that the last complete one is kept."""
    reason = error.strerror if isinstance(error, OSError) and error.strerror else (
        f"{error.__class__.__name__}: {(str(error).splitlines() or ['no detail'])[0][:200]}")
    try:
        free = f"; {shutil.disk_usage(final.parent).free // 2**20} MiB free there"
    except OSError:
        free = ""
    last = latest_checkpoint(final.parent.parent)
    kept = f"the last complete checkpoint, {last}, is still there" if last else "no earlier checkpoint was written"
    return (f"checkpoint {final} could not be written ({reason}{free}); {kept}: free some space, then continue the "
            "run with checkpoint.resume=latest")


def _remove(checkpoint: Path) -> None:
    """Delete a published checkpoint: renamed away first, so a kill never leaves a half-deleted `step_<N>`."""
    old = checkpoint.with_name(f".old_{checkpoint.name}_{os.getpid()}")
    checkpoint.rename(old)
    remove(old)


def remove_stale(directory: Path) -> list[Path]:
    """Remove the temporary directories a killed run left in `directory` (call with the run lock held)."""
    stale = sorted(p for p in directory.glob(".*_step_*") if p.name.startswith((".tmp_step_", ".old_step_")))
    for p in stale:
        _discard(p)
    return stale


def _discard(path: Path) -> None:
    """Remove a temporary directory (or a link in its place) as far as possible; what is left is removed next start."""
    try:
        if os.path.lexists(path):
            remove(path)
    except OSError:
        pass


def checkpoints(run_dir: Path) -> list[Path]:
    """The published checkpoints (`checkpoints/step_<N>`) of `run_dir`, oldest first."""
    found = [p for p in (run_dir / "checkpoints").glob("step_*") if _STEP_DIR.fullmatch(p.name)]
    return sorted(found, key=checkpoint_step)


def set_aside_after(run_dir: Path, step: int, into: Path) -> list[Path]:
    """Move the published checkpoints of `run_dir` after `step` into the directory `into` (created when there are
    any): states a rollback undid, or saved after the trouble a stop ends before, stay on disk but are no longer the
    run's checkpoints (its latest is the state it went back to). Returns their new paths, oldest first."""
    later = [p for p in checkpoints(run_dir) if checkpoint_step(p) > step]
    if later:
        into.mkdir(parents=True, exist_ok=True)
    return [p.rename(into / p.name) for p in later]


def checkpoint_step(path: Path) -> int:
    """The step of a published checkpoint directory (`step_<N>`)."""
    return int(path.name[5:])


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The published checkpoint of `run_dir` with the highest step, or None."""
    found = checkpoints(run_dir)
    return found[-1] if found else None


def saved_ranks(path: Path) -> int:
    """How many ranks wrote the checkpoint at `path` (its RNG file holds one state per rank; 1 where it cannot be
    read, which `verify_checkpoint` then reports)."""
    try:
        return max(1, len(_torch_load(path / "rng.pt").get("ranks", [])))
    except (CheckpointError, AttributeError):
        return 1


def verify_checkpoint(path: str | Path, needs_critic: bool = False, job: str | None = TRAIN_JOB) -> dict:
    """Check a checkpoint before any work; returns its trainer state (with `step`). `job`: the command that must
    have written it (`rldyn train` or `rldyn sft`, which continue only their own), None for any (an evaluation).

    Raises CheckpointError naming the file and the problem: a missing or non-directory path, a missing or
    malformed manifest, a missing, empty, truncated or grown file, a malformed `trainer_state.json` or
    safetensors header, a checksum mismatch, or no `critic/` when one is needed.
    """
    path = _checkpoint_dir(path)
    files = _manifest_files(path)
    for rel in (*REQUIRED, *(["critic/config.json"] if needs_critic else [])):
        if rel not in files:
            raise CheckpointError(f"{path / MANIFEST}: lists no {rel}; the checkpoint is incomplete"
                                  + (" (written by a run without a critic)" if rel.startswith("critic") else ""))
    if not any(rel in files for rel in ACTOR_CONFIGS):
        raise CheckpointError(f"{path / MANIFEST}: lists no {' or '.join(ACTOR_CONFIGS)} (a whole model or a LoRA "
                              "adapter); the checkpoint is incomplete")
    if not any(rel.startswith("actor/") and rel.endswith(".safetensors") for rel in files):
        raise CheckpointError(f"{path / MANIFEST}: lists no actor weights (actor/*.safetensors)")
    for rel, (size, _) in files.items():
        _check_size(path / rel, size)
    state = _trainer_state(path / "trainer_state.json")
    if job is not None and state.get("job", TRAIN_JOB) != job:
        raise CheckpointError(f"{path}: a checkpoint of `rldyn {state['job']}`, which `rldyn {job}` does not "
                              f"continue; start from its weights instead: model.path={path / 'actor'}")
    for rel in files:
        _check_structure(path / rel)
    for rel, (_, digest) in files.items():
        if sha256_file(path / rel) != digest:
            raise CheckpointError(f"{path / rel}: checksum mismatch (the file changed or was corrupted after the "
                                  "checkpoint was written)")
    return state


def read_sampler(path: Path) -> dict:
    """The lagged sampler's versions a verified checkpoint keeps (`sampler.pt`; empty when it has none)."""
    file = Path(path) / SAMPLER
    if not file.is_file():
        return {}
    versions = _torch_load(file)
    if not isinstance(versions, dict) or not all(isinstance(v, int) and isinstance(w, dict)
                                                 for v, w in versions.items()):
        raise CheckpointError(f"{file}: expected the sampler's versions (step -> weights)")
    return versions


def read_trainer_state(path: str | Path) -> dict:
    """The trainer state (with `step`) of a checkpoint, checked for shape only (`verify_checkpoint` checks all)."""
    return _trainer_state(_checkpoint_dir(path) / "trainer_state.json")


def _checkpoint_dir(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a file; pass a checkpoint directory "
                              "(runs/<run>/checkpoints/step_<N>)")
    return path


def load_trainer_state(path: Path, *, model, optimizer, critic=None, critic_optimizer=None) -> dict:
    """Restore optimizer and RNG state from a verified checkpoint; returns the trainer state (with `step`).

    Several ranks: for sharded models rank 0 alone reads and checks `optimizer.pt` (an error is raised on every
    rank) and each rank receives its shards of the states; replicas read the file themselves."""
    read = dist.main_checked if is_sharded(model) else (lambda fn, *args: fn(*args))
    optim = read(_read_optimizers, path, optimizer, critic_optimizer)
    for name, net, opt in (("actor", model, optimizer), ("critic", critic, critic_optimizer)):
        if opt is not None:
            try:
                load_full_optimizer_state(net, opt, None if optim is None else optim[name])
            except (ValueError, KeyError, TypeError, RuntimeError) as e:
                raise CheckpointError(f"{path / 'optimizer.pt'}: the {name} optimizer state does not fit "
                                      f"({str(e).splitlines()[0]})") from None
    rng = _torch_load(path / "rng.pt")
    try:
        ranks = rng.get("ranks", [])
        torch.set_rng_state(ranks[dist.rank()] if len(ranks) == dist.world() else rng["torch"])
    except (TypeError, KeyError, IndexError, RuntimeError, AttributeError) as e:
        raise CheckpointError(f"{path / 'rng.pt'}: not a torch RNG state ({str(e).splitlines()[0]})") from None
    return _trainer_state(path / "trainer_state.json")


def _read_optimizers(path: Path, optimizer, critic_optimizer=None) -> dict:
    """The actor (and critic) optimizer states of a checkpoint, each checked against its optimizer's parameters."""
    file = path / "optimizer.pt"
    optim = _torch_load(file)
    if not isinstance(optim, dict) or "actor" not in optim or (critic_optimizer is not None and "critic" not in optim):
        raise CheckpointError(f"{file}: expected the actor" + (" and critic" if critic_optimizer is not None else "")
                              + " optimizer states")
    _check_optimizer(optimizer, optim["actor"], file, "actor")
    if critic_optimizer is not None:
        _check_optimizer(critic_optimizer, optim["critic"], file, "critic")
    return optim


def _manifest_files(path: Path) -> dict[str, tuple[int, str]]:
    """relative path -> (bytes, sha256) from the manifest, checked for shape and for paths that stay inside."""
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointError(f"{file}: missing; a checkpoint is complete only once its manifest is written "
                              "(an interrupted save, or not a checkpoint written by `rldyn train`)")
    try:
        manifest = json.loads(file.read_bytes())
        entries = manifest["files"]
        files = {rel: (int(e["bytes"]), str(e["sha256"])) for rel, e in entries.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{file}: malformed ({e.__class__.__name__}: {str(e)[:80]})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file}: format {manifest.get('format')!r} is not {FORMAT!r}")
    for rel in files:
        if rel.startswith("/") or ".." in Path(rel).parts or rel == MANIFEST:
            raise CheckpointError(f"{file}: lists the path {rel!r}, which is not inside the checkpoint")
    return files


def _check_size(file: Path, size: int) -> None:
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (listed in the checkpoint's {MANIFEST})")
    actual = file.stat().st_size
    if actual == 0 and size > 0:
        raise CheckpointError(f"{file}: empty (0 of {size} bytes)")
    if actual < size:
        raise CheckpointError(f"{file}: truncated ({actual} of {size} bytes)")
    if actual > size:
        raise CheckpointError(f"{file}: {actual} bytes where {size} were written")


def _trainer_state(file: Path) -> dict:
    if not file.is_file():
        raise CheckpointError(f"{file}: missing; not a checkpoint written by `rldyn train`")
    try:
        state = json.loads(file.read_bytes())
    except ValueError as e:
        raise CheckpointError(f"{file}: not valid JSON ({str(e)[:80]})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(state).__name__}")
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{file}: 'step' must be an integer >= 0, got {step!r}")
    if state.get("job", TRAIN_JOB) == TRAIN_JOB and not isinstance(state.get("early_stop"), dict):
        raise CheckpointError(f"{file}: missing the 'early_stop' state")
    return state


def _check_structure(file: Path) -> None:
    """Parse what can be parsed cheaply: JSON files and safetensors headers (tensor data is checksummed)."""
    if file.suffix == ".json":
        try:
            json.loads(file.read_bytes())
        except ValueError as e:
            raise CheckpointError(f"{file}: not valid JSON ({str(e)[:80]})") from None
    elif file.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(file), framework="pt") as f:
                list(f.keys())
        except Exception as e:  # safetensors raises its own error types for every malformed header
            raise CheckpointError(f"{file}: not a valid safetensors file ({str(e).splitlines()[0][:100]})") from None


def _torch_load(file: Path):
    try:
        with warnings.catch_warnings():  # a foreign pickle's protocol warning: the error below says it all
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(file, weights_only=True, map_location="cpu")
    except Exception as e:  # truncated zip, foreign pickle, ...: torch raises several unrelated types
        raise CheckpointError(f"{file}: cannot be read as tensors ({e.__class__.__name__}: "
                              f"{str(e).splitlines()[0][:100] if str(e) else 'no detail'})") from None


def _check_optimizer(optimizer, state, file: Path, name: str) -> None:
    """Check that `state` is an optimizer state of `optimizer`'s parameters: every saved tensor fits its parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    try:
        saved = [i for group in state["param_groups"] for i in group["params"]]
        per_param = dict(state["state"])
    except (TypeError, KeyError, ValueError) as e:
        raise CheckpointError(f"{file}: the {name} optimizer state is malformed ({e!r})") from None
    if len(saved) != len(params):
        raise CheckpointError(f"{file}: the {name} optimizer state is for {len(saved)} parameters, the model has "
                              f"{len(params)} (a checkpoint of another model?)")
    for index, param in zip(saved, params, strict=True):
        entry = per_param.get(index, {})
        for key, value in (entry.items() if isinstance(entry, dict) else []):
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise CheckpointError(f"{file}: {name} optimizer {key!r} of parameter {index} has shape "
                                      f"{list(value.shape)}, the model's parameter {list(param.shape)}")
