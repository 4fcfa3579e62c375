"""Optional metric mirrors. Each imports its library only when enabled; the run directory stays the truth."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

MISSING = {
    "wandb": "log.wandb=true needs the wandb package: pip install wandb (or set log.wandb=false)",
    "tensorboard": "log.tensorboard=true needs the tensorboard package: pip install tensorboard "
                   "(or set log.tensorboard=false)",
}


def check_installed(wandb: bool, tensorboard: bool) -> None:
    """Raise ImportError, before any work, when an enabled mirror's package is not installed."""
    for enabled, package in ((wandb, "wandb"), (tensorboard, "tensorboard")):
        if enabled and importlib.util.find_spec(package) is None:
            raise ImportError(MISSING[package])


class WandbSink:
    """Mirror metrics to Weights & Biases (`WANDB_MODE=offline` works without network)."""

    def __init__(self, project: str, name: str, config: dict[str, Any], run_dir: Path):
        import wandb

        self.run = wandb.init(project=project, name=name, config=config, dir=str(run_dir))

    def log(self, step: int, row: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in row.items() if k != "step"}, step=step)

    def close(self) -> None:
        self.run.finish()


class TensorBoardSink:
    """Mirror numeric metrics to TensorBoard event files under `<run_dir>/tensorboard`."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, row: dict[str, Any]) -> None:
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)):
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()
