"""`rldyn probe`: one gradient-analysis pass on a saved checkpoint, written to its own run directory.

The probe loads the checkpoint's run (same config, same weights and critic) in probe mode (`analysis.only`):
nothing is updated, early stopping is off (the probe of the last checkpoint of a run that stopped early
still analyses) and no checkpoint is written. As in RAGEN's probe, the metrics are logged at the
checkpoint's step N, and the analysed batch is drawn from a fixed seed stream: the env seeds and sampling
seed of step 1 (`train.seed_base + g` for group g; a separate analysis batch: `train.seed_base + 500000 + g`),
whatever N is. Probes of the checkpoints of one run therefore compare policies on the same puzzles, and a
probe of weights equal to the initial ones reproduces the run's step-1 analysis. Defaults follow RAGEN's
probe script: KL (k3, 0.001) and entropy (0.001) enabled so that both regularisers are measured; any key
can be overridden.
"""

from __future__ import annotations

from pathlib import Path

from rldynamics.config import Config, apply_overrides, load_config, make_config
from rldynamics.train.checkpoint import read_trainer_state
from rldynamics.train.trainer import train

PROBE_DEFAULTS = ["algo.kl_coef=0.001", "algo.kl_type=k3", "algo.entropy_coef=0.001"]


def probe_config(checkpoint: Path, overrides: list[str], validate: bool = False) -> Config:
    """The probe's config: the run's saved config, RAGEN's probe defaults, probe mode, then `overrides`.

    A checkpoint that is missing or has no usable trainer state is a CheckpointError naming the file; the
    training start verifies every file of it before any work."""
    step = read_trainer_state(checkpoint)["step"]
    saved = checkpoint.parent.parent / "config.yaml"
    base = load_config(saved) if saved.is_file() else make_config()
    mode = [f"checkpoint.resume={checkpoint}", f"train.steps={step}", "analysis.enabled=true", "analysis.every=1",
            "analysis.exit_after=true", "analysis.only=true", f"val.before_train={str(validate).lower()}"]
    return apply_overrides(base, PROBE_DEFAULTS + mode + overrides)


def probe_checkpoint(checkpoint: str | Path, overrides: list[str], validate: bool = False) -> Path:
    """Run the probe and return its run directory (`<log.run_dir>/probe_<run>_step<N>` unless log.name is set)."""
    checkpoint = Path(checkpoint).resolve()
    cfg = probe_config(checkpoint, overrides, validate)
    name = cfg.log.name if any(o.startswith("log.name=") for o in overrides) else (
        f"probe_{checkpoint.parent.parent.name}_{checkpoint.name}")
    return train(cfg, Path(cfg.log.run_dir) / name)
