"""`environment.jsonl` in the run directory: what computed the run, one line per start (a resume adds one).

Each line: the step the start continued from, the versions of torch, transformers, tokenizers, numpy, rldynamics and
Python, the torch thread count (and where it came from), the device, and for the embedded tiny model the SHA-256 of
the initial weights (the warm-started model, cached under `$RLDYN_CACHE`): two runs of one config and seed start from
the same model exactly when these hashes agree. Lines are appended, never rewritten, so a resumed run keeps the
record of what computed its earlier steps. Imports no torch (versions are read from the installed packages).
"""

from __future__ import annotations

import hashlib
import json
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from rldynamics.tracking.files import append_file

ENVIRONMENT_FILE = "environment.jsonl"
PACKAGES = ("torch", "transformers", "tokenizers", "numpy", "rldynamics")


def describe(step: int, threads: int, threads_from: str, device: str, base_model: str | None = None) -> dict[str, Any]:
    """The record of one start (`base_model`: a local model directory whose weights are hashed, or None)."""
    record: dict[str, Any] = {"start_step": step, **{name: _version(name) for name in PACKAGES},
                              "python": platform.python_version(), "threads": threads, "threads_from": threads_from,
                              "device": device, "cpu": platform.processor() or platform.machine()}
    if base_model is not None:
        record["base_model_sha256"] = weights_sha256(Path(base_model))
    return record


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def weights_sha256(directory: Path) -> str:
    """SHA-256 of the directory's `*.safetensors` files' contents, concatenated in name order (for the tiny model's
    one file, what `sha256sum model.safetensors` prints)."""
    digest = hashlib.sha256()
    for file in sorted(directory.glob("*.safetensors")):
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def record_start(run_dir: Path, record: dict[str, Any]) -> None:
    """Append the record of this start to `environment.jsonl`."""
    append_file(run_dir / ENVIRONMENT_FILE, (json.dumps(record, sort_keys=True) + "\n").encode())


def read_environment(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every start's record (none for a run written before this file existed); an unreadable line is skipped."""
    try:
        lines = (Path(run_dir) / ENVIRONMENT_FILE).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [r for r in out if isinstance(r, dict)]
