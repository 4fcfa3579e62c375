"""The run directory: the source of truth of a run. Plots, reports and sweeps read only this.

Layout:
    config.yaml                resolved config
    metrics.jsonl              one JSON object per logged step, always with "step"
    samples.jsonl              a few decoded trajectories per step
    analysis/step_<N>/         gradient-analysis tables and sketches
    checkpoints/step_<N>/      model weights (safetensors) + trainer state
    plots/, report.html        written by `rldyn plot` / `rldyn report`

This module imports no torch, so readers work on any machine with the run directory copied over.
Non-finite floats are written as JSON `NaN`/`Infinity` (Python's json reads them back).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class RunWriter:
    """Appends metrics and samples to a run directory; optional mirrors receive the same metrics."""

    def __init__(self, path: str | Path, sinks: list | None = None):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.sinks = sinks or []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append one metrics object for `step` (and forward it to the sinks)."""
        row = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        for sink in self.sinks:
            sink.log(step, row)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Append decoded trajectories (dicts with at least `text` and `reward`)."""
        with open(self.path / "samples.jsonl", "a") as f:
            for s in samples:
                f.write(json.dumps({"step": step, **s}) + "\n")

    def analysis_dir(self, step: int) -> Path:
        """The directory for the analysis artefacts of `step` (created)."""
        d = self.path / "analysis" / f"step_{step}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def truncate_after(self, step: int) -> None:
        """Drop logged rows with a step > `step` (used when resuming from a checkpoint)."""
        for name in ("metrics.jsonl", "samples.jsonl"):
            file = self.path / name
            if file.exists():
                rows = [line for line in file.read_text().splitlines() if json.loads(line)["step"] <= step]
                file.write_text("".join(r + "\n" for r in rows))

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def _plain(value: Any) -> Any:
    """A JSON-ready scalar (tensors and numpy scalars become Python numbers; floats are kept exact)."""
    return value.item() if hasattr(value, "item") else value


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All metrics rows of a run, in file order."""
    file = Path(run_dir) / "metrics.jsonl"
    if not file.exists():
        raise FileNotFoundError(f"{file} not found: is {run_dir} a run directory written by `rldyn train`?")
    return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]


def read_config(run_dir: str | Path) -> dict[str, Any]:
    """The resolved config of a run as a plain dict."""
    import yaml

    return yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
