"""The run directory: the source of truth of a run. Plots, reports and sweeps read only this.

Layout:
    config.yaml                resolved config
    metrics.jsonl              one JSON object per logged step, always with "step"
    samples.jsonl              a few decoded trajectories per step
    rewards.jsonl              one row per training trajectory and step: reward components (raw and weighted),
                               total, response length, correct flag (`read_rewards`)
    analysis/step_<N>/         gradient-analysis tables and sketches
    checkpoints/step_<N>/      model weights (safetensors) + trainer state
    plots/, report.html        written by `rldyn plot` / `rldyn report`

This module imports no torch, so readers work on any machine with the run directory copied over.
Non-finite floats are written as JSON `NaN`/`Infinity` (Python's json reads them back).
The JSONL files are only ever appended to (then flushed), so they can be read while a run is going; a line
cut short by a crash is the last line of its file, and readers and resumes ignore it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REWARDS_FILE = "rewards.jsonl"


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

    def log_rewards(self, rows: list[dict[str, Any]]) -> None:
        """Append reward-tracking rows (one per trajectory, see `rollout.rewards.reward_rows`) and flush."""
        with open(self.path / REWARDS_FILE, "a") as f:
            f.write("".join(json.dumps(row) + "\n" for row in rows))
            f.flush()

    def analysis_dir(self, step: int) -> Path:
        """The directory for the analysis artefacts of `step` (created)."""
        d = self.path / "analysis" / f"step_{step}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def truncate_after(self, step: int) -> None:
        """Drop logged rows with a step > `step` (used when resuming from a checkpoint)."""
        for name in ("metrics.jsonl", "samples.jsonl", REWARDS_FILE):
            file = self.path / name
            if file.exists():
                kept = [json.dumps(row) for row in _read_jsonl(file) if row["step"] <= step]
                file.write_text("".join(line + "\n" for line in kept))

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def _plain(value: Any) -> Any:
    """A JSON-ready scalar (tensors and numpy scalars become Python numbers; floats are kept exact)."""
    return value.item() if hasattr(value, "item") else value


def _read_jsonl(file: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file; an unparsable *last* line (cut short by a crash) is skipped, others raise."""
    lines = [line for line in file.read_text().splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, start=1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number == len(lines):
                break
            raise ValueError(f"{file}: line {number} is not valid JSON ({e.msg})") from e
    return rows


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All metrics rows of a run, in file order."""
    file = Path(run_dir) / "metrics.jsonl"
    if not file.exists():
        raise FileNotFoundError(f"{file} not found: is {run_dir} a run directory written by `rldyn train`?")
    return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]


def read_rewards(run_dir: str | Path) -> list[dict[str, Any]]:
    """All reward-tracking rows of a run (one per training trajectory and step), in file order.

    Each row: `step`, `traj`, `group`, `prompt` (env seed), `reward` and `weighted` (component name -> value),
    `total`, `response_tokens`, `response_chars`, `correct`. Safe to call while the run is writing.
    """
    file = Path(run_dir) / REWARDS_FILE
    if not file.exists():
        raise FileNotFoundError(f"{file} not found: is {run_dir} a run directory written by `rldyn train`?")
    return _read_jsonl(file)


def read_config(run_dir: str | Path) -> dict[str, Any]:
    """The resolved config of a run as a plain dict."""
    import yaml

    return yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
