"""Checkpoints: safetensors weights loadable with `from_pretrained`, plus optimizer, RNG and trainer state.

Layout of `checkpoints/step_<N>/`:
    actor/             model + tokenizer (`AutoModelForCausalLM.from_pretrained(...)` works on it)
    critic/            value model (GAE only)
    optimizer.pt       actor (and critic) optimizer state dicts: tensors and plain containers only
    rng.pt             torch RNG state
    trainer_state.json step, early-stop state

Writes go to a temporary sibling directory that is renamed into place, so a crash never leaves a
half-written checkpoint. Loading uses `torch.load(weights_only=True)`: no pickle code execution.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch


def save_checkpoint(directory: Path, step: int, *, model, tokenizer, optimizer, critic=None, critic_optimizer=None,
                    trainer_state: dict | None = None, keep_last: int = 0) -> Path:
    """Write `directory/step_<step>` atomically and return its path; then keep only the newest `keep_last`
    checkpoints (0 = keep all)."""
    final = directory / f"step_{step}"
    tmp = directory / f".tmp_step_{step}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / "actor", safe_serialization=True)
    tokenizer.save_pretrained(tmp / "actor")
    optim = {"actor": optimizer.state_dict()}
    if critic is not None:
        critic.save_pretrained(tmp / "critic")
        optim["critic"] = critic_optimizer.state_dict()
    torch.save(optim, tmp / "optimizer.pt")
    torch.save({"torch": torch.get_rng_state()}, tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **(trainer_state or {})}, indent=2))
    if final.exists():
        old = directory / f".old_step_{step}_{os.getpid()}"
        final.rename(old)
        shutil.rmtree(old)
    tmp.rename(final)
    if keep_last > 0:
        for old_ckpt in _checkpoints(directory)[:-keep_last]:
            shutil.rmtree(old_ckpt)
    return final


def _checkpoints(directory: Path) -> list[Path]:
    """`step_<N>` directories, oldest first."""
    return sorted(directory.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))


def find_checkpoint(resume: str, run_dir: Path) -> Path:
    """Resolve `checkpoint.resume` (a path, or `latest` = newest in `run_dir/checkpoints`)."""
    if resume == "latest":
        found = _checkpoints(run_dir / "checkpoints")
        if not found:
            raise FileNotFoundError(f"checkpoint.resume=latest: no checkpoints in {run_dir / 'checkpoints'} "
                                    "(set log.name to the run to resume, or pass a checkpoint path)")
        return found[-1]
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"checkpoint.resume={resume}: not a checkpoint directory "
                                "(expected trainer_state.json, actor/ and optimizer.pt inside)")
    return path


def load_trainer_state(path: Path, *, optimizer, critic_optimizer=None) -> dict:
    """Restore optimizer and RNG state from a checkpoint; returns the trainer state (with `step`)."""
    optim = torch.load(path / "optimizer.pt", weights_only=True)
    optimizer.load_state_dict(optim["actor"])
    if critic_optimizer is not None:
        critic_optimizer.load_state_dict(optim["critic"])
    torch.set_rng_state(torch.load(path / "rng.pt", weights_only=True)["torch"])
    return json.loads((path / "trainer_state.json").read_text())
