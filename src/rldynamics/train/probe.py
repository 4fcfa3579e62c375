"""`rldyn probe`: one gradient-analysis pass on a saved checkpoint, written to its own run directory.

The probe loads the checkpoint's run (same config, same weights and critic) in probe mode (`analysis.only`):
nothing is updated, early stopping is off (the probe of the last checkpoint of a run that stopped early
still analyses) and no checkpoint is written. As in RAGEN's probe, the metrics are logged at the
checkpoint's step N, and the analysed batch is drawn from a fixed seed stream: the env seeds and sampling
seed of step 1 (`train.seed_base + g` for group g; a separate analysis batch: `train.seed_base + 500000 + g`),
whatever N is. Probes of the checkpoints of one run therefore compare policies on the same puzzles, and a
probe of weights equal to the initial ones reproduces the run's step-1 analysis. Defaults follow RAGEN's
probe script: KL (k3, 0.001) and entropy (0.001) enabled so that both regularisers are measured; any key
can be overridden except those the run's model is made of (`RUN_MODEL_KEYS`).

The analysed model is the checkpoint's own: its actor, and as the KL reference the base model of its run, built from
the run's config.yaml (`setup.run_base_path`). A checkpoint without its run's config.yaml, or an override of what
the base model is made of, would pair the actor with another reference (a KL gradient of another model pair); both
are refused in one line before any work.
"""

from __future__ import annotations

from pathlib import Path

from rldynamics.config import Config, ConfigError, apply_overrides, config_diff
from rldynamics.train.checkpoint import read_trainer_state
from rldynamics.train.setup import run_config
from rldynamics.train.trainer import train

PROBE_DEFAULTS = ["algo.kl_coef=0.001", "algo.kl_type=k3", "algo.entropy_coef=0.001"]
RUN_MODEL_KEYS = ("model.path", "model.tiny_", "model.warm_start_")  # the run's base model: never a probe's to change


def probe_config(checkpoint: Path, overrides: list[str], validate: bool = False) -> Config:
    """The probe's config: the run's saved config, RAGEN's probe defaults, probe mode, then `overrides`.

    A checkpoint that is missing or has no usable trainer state is a CheckpointError naming the file (the training
    start verifies every file of it before any work); a run without config.yaml, or overrides of `RUN_MODEL_KEYS`,
    a ConfigError."""
    step = read_trainer_state(checkpoint)["step"]
    base = run_config(checkpoint)
    mode = [f"checkpoint.resume={checkpoint}", f"train.steps={step}", "analysis.enabled=true", "analysis.every=1",
            "analysis.exit_after=true", "analysis.only=true", f"val.before_train={str(validate).lower()}"]
    cfg = apply_overrides(base, PROBE_DEFAULTS + mode + overrides)
    changed = [f"{key}={new} (the run's: {old})" for key, old, new in config_diff(base, cfg)
               if key.startswith(RUN_MODEL_KEYS)]
    if changed:
        raise ConfigError(f"{'; '.join(changed)}: a probe analyses the checkpoint's own model (its actor, and the base "
                          "model of its run as the KL reference); drop this override")
    return cfg


def probe_checkpoint(checkpoint: str | Path, overrides: list[str], validate: bool = False) -> Path:
    """Run the probe and return its run directory (`<log.run_dir>/probe_<run>_step<N>` unless log.name is set)."""
    checkpoint = Path(checkpoint).resolve()
    cfg = probe_config(checkpoint, overrides, validate)
    name = cfg.log.name if any(o.startswith("log.name=") for o in overrides) else (
        f"probe_{checkpoint.parent.parent.name}_{checkpoint.name}")
    return train(cfg, Path(cfg.log.run_dir) / name)
