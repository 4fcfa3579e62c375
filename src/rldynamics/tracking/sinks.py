"""Optional metric mirrors. Each imports its library only when enabled; the run directory stays the truth."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class WandbSink:
    """Mirror metrics to Weights & Biases (`WANDB_MODE=offline` works without network)."""

    def __init__(self, project: str, name: str, config: dict[str, Any], run_dir: Path):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("log.wandb=true needs the wandb package: pip install wandb") from e
        self.run = wandb.init(project=project, name=name, config=config, dir=str(run_dir))

    def log(self, step: int, row: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in row.items() if k != "step"}, step=step)

    def close(self) -> None:
        self.run.finish()


class TensorBoardSink:
    """Mirror numeric metrics to TensorBoard event files under `<run_dir>/tensorboard`."""

    def __init__(self, run_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("log.tensorboard=true needs the tensorboard package: pip install tensorboard") from e
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, row: dict[str, Any]) -> None:
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)):
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()
