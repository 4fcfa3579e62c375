"""`rldyn eval`: one validation of a checkpoint or a model, written to a small run directory of its own.

What is measured is the trainer's validation stage itself (`train.stages.validate`: the fixed validation seeds
`val.seed_base ..`, `val.group_size` samples each at `val.temperature`), so an eval of a run's checkpoint gives the
number that run logged at that step: success, pass@`val.group_size`, the weighted reward and each raw reward
component (`val-reward/<name>/*`), response length and the env's own metrics.

The settings: a checkpoint (`runs/<run>/checkpoints/step_N`) is evaluated under its run's config.yaml (same env,
same validation), its actor as `model.path` (a LoRA adapter on the base model of the run: `setup.run_config`), and
its metrics are logged at step N; anything else (a model directory,
a hub id in the local cache, a `.gguf` file, `tiny`) under a preset (default: the training default), at step 0.
`--preset P` replaces the run's config by the preset; `key=value` overrides apply last, except
those that would make a checkpoint's model another one (`CHECKPOINT_MODEL_KEYS`: the base would be
evaluated under the checkpoint's name), which are refused. Nothing is trained: only the policy is
loaded (no critic, no reference model, no optimizer).

The run directory (`<log.run_dir>/eval_<run or model>_<step>` unless `log.name` is set) holds config.yaml and
metrics.jsonl (one row); an existing run is never written into.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from rldynamics import metric_names as names
from rldynamics.config import (
    Config,
    ConfigError,
    apply_overrides,
    config_diff,
    load_config,
    make_config,
    save_config,
)

CHECKPOINT_MODEL_KEYS = ("model.path", "tiny.", "model.warm_start_")  # what a checkpoint's model is
LABELS = {"response_length": "response_length (tokens per turn)",
          names.PROBLEMS: "distinct problems"}  # names in the eval table


def is_checkpoint(target: str | Path) -> bool:
    """True for a trainer checkpoint directory (`step_N` with `trainer_state.json` and `actor/`)."""
    path = Path(target)
    return (path / "trainer_state.json").is_file() and (path / "actor").is_dir()


def eval_config(target: str, preset: str | None, overrides: list[str], default_preset: str) -> tuple[Config, int]:
    """The evaluation's config and the step its metrics are logged at (the checkpoint's, else 0).

    A run directory, or a checkpoint path that does not exist, is a ConfigError saying which checkpoint to give."""
    _check_target(target)
    step = 0
    if is_checkpoint(target):
        checkpoint = Path(target).resolve()
        step = _checkpoint_step(checkpoint)
        run_config = checkpoint.parent.parent / "config.yaml"
        if preset is None and not run_config.is_file():
            raise ConfigError(f"{target}: its run's config.yaml ({run_config}) is missing, so the env and validation "
                              "it was trained with are unknown; pass --preset P (and the env keys it was trained with)")
        base = make_config(preset) if preset else load_config(run_config)
        model = str(checkpoint / "actor")
    else:
        base, model = make_config(preset or default_preset), target
    own = apply_overrides(base, [f"model.path={model}", "log.name=null"])
    cfg = apply_overrides(own, overrides)
    if is_checkpoint(target):
        cfg = _same_model(target, own, cfg)
    if cfg.checkpoint.resume and cfg.checkpoint.resume != base.checkpoint.resume:
        raise ConfigError("checkpoint.resume has no meaning for an evaluation; give the checkpoint as the argument "
                          "(rldyn eval runs/<run>/checkpoints/step_<N>)")
    return apply_overrides(cfg, ["checkpoint.resume=null"]), step


def eval_run_dir(cfg: Config, target: str, step: int) -> Path:
    """`<log.run_dir>/<log.name>`, else `eval_<run>_step<N>` for a checkpoint, `eval_<model>_<time>` for a model."""
    if cfg.log.name:
        return Path(cfg.log.run_dir) / cfg.log.name
    path = Path(target)
    name = (f"eval_{path.resolve().parent.parent.name}_{path.name}" if is_checkpoint(target)
            else f"eval_{path.name or 'model'}_{time.strftime('%Y%m%d-%H%M%S')}")
    return Path(cfg.log.run_dir) / name


def evaluate(cfg: Config, run_dir: Path, step: int = 0, checkpoint: Path | None = None) -> dict[str, float]:
    """Validate `cfg.model.path` with the trainer's validation stage; write config.yaml and the metrics row (at `step`)
    to `run_dir`; return the metrics. Checks the run directory, and verifies `checkpoint` (the manifest's sizes and
    checksums, as `rldyn probe` and a resume do), before loading anything; writes the run directory only at the end."""
    import torch

    from rldynamics import dist
    from rldynamics.models import lora
    from rldynamics.models.loading import load_model_and_tokenizer
    from rldynamics.models.sharding import wrap
    from rldynamics.rollout.engines import rollout_engine
    from rldynamics.tracking.run_dir import RunLock, RunWriter, check_no_links
    from rldynamics.train import stages
    from rldynamics.train.checkpoint import verify_checkpoint
    from rldynamics.train.session import Session
    from rldynamics.train.setup import base_model_path, prepare, resolve_device, run_config, start_compute

    check_no_links(run_dir)
    _check_new(run_dir)
    RunLock(run_dir).check()
    if checkpoint is not None:
        verify_checkpoint(checkpoint, job=None)  # a fine-tuning's checkpoint is evaluated too
    device = resolve_device(cfg.model.device)
    *_, precision = start_compute(cfg, device)
    torch.manual_seed(cfg.seed)
    path = base_model_path(cfg)
    adapter = checkpoint is not None and lora.is_adapter_dir(checkpoint / "actor")
    base = base_model_path(run_config(checkpoint)) if adapter else path  # a LoRA adapter goes on its run's base
    model, tokenizer = load_model_and_tokenizer(base, device=str(device), chat_template=cfg.model.chat_template)
    if adapter:
        model = lora.load_adapter(model, checkpoint / "actor", trainable=False)
    model = wrap(prepare(model, cfg, precision), cfg.model.shard)
    session = Session(cfg=cfg, run_dir=run_dir, writer=None, model=model, tokenizer=tokenizer, optimizer=None,
                      main=dist.is_main(), engine=rollout_engine(cfg, base, model, precision.engine_dtype))
    start = time.perf_counter()
    metrics = stages.validate(session).metrics
    metrics[names.timing("eval")] = time.perf_counter() - start
    if dist.is_main():
        with RunLock(run_dir):
            _check_new(run_dir)
            writer = RunWriter(run_dir)
            save_config(cfg, run_dir / "config.yaml")
            writer.log(step, metrics)
            writer.close()
    return metrics


def _checkpoint_step(checkpoint: Path) -> int:
    """The step a checkpoint was saved at, read from its trainer_state.json without torch (`evaluate` verifies its
    files before the actor loads)."""
    file = checkpoint / "trainer_state.json"
    try:
        step = json.loads(file.read_text(encoding="utf-8")).get("step")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise ConfigError(f"{file} is not a readable trainer state ({e.__class__.__name__}); is {checkpoint} a "
                          "checkpoint written by rldyn train?") from None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"{file} has no step number; is {checkpoint} a checkpoint written by rldyn train?")
    return step


def _same_model(target: str, own: Config, cfg: Config) -> Config:
    """`cfg`, refused when an override changes what the checkpoint's model is
    (`CHECKPOINT_MODEL_KEYS`): another model would be evaluated under the checkpoint's name. The
    checkpoint's actor given again is no change."""
    if Path(cfg.model.path).expanduser().resolve() == Path(own.model.path):
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=own.model.path))
    changed = [(key, value) for key, _, value in config_diff(own, cfg)
               if key.startswith(CHECKPOINT_MODEL_KEYS)]
    if not changed:
        return cfg
    key, value = changed[0]
    if key == "model.path":
        raise ConfigError(f"model.path={value} contradicts the checkpoint {target}, whose actor is "
                          "the model evaluated; drop model.path, or evaluate that model itself: "
                          f"rldyn eval {value}")
    raise ConfigError(f"{key}={value} does not apply to the checkpoint {target}: its actor is "
                      "evaluated as saved (the tiny model's build and warm start made its run's "
                      f"base model); drop {key}")


def _check_target(target: str) -> None:
    """A run directory, or a checkpoint path that does not exist, named as what it is (not as a model to load)."""
    path = Path(target)
    if path.is_dir() and (path / "checkpoints").is_dir() and not is_checkpoint(path):
        found = sorted((p.name for p in (path / "checkpoints").glob("step_*")), key=lambda n: n[5:].zfill(12))
        latest = f"{path / 'checkpoints' / found[-1]}" if found else f"{path}/checkpoints/step_<N> (it has none yet)"
        raise ConfigError(f"{target} is a run directory; give one of its checkpoints: rldyn eval {latest}")
    if not path.exists() and "checkpoints" in path.parts:
        raise ConfigError(f"no checkpoint {target}; a run is written to <log.run_dir>/<env>_<model>_<time> unless "
                          "log.name is set (list them: ls runs/); give runs/<run>/checkpoints/step_<N>")


def _check_new(run_dir: Path) -> None:
    if (run_dir / "metrics.jsonl").exists():
        raise FileExistsError(f"run directory {run_dir} already holds a run; choose another log.name")


def metrics_table(metrics: dict[str, float], env: str) -> str:
    """The evaluation as an aligned two-column table: the env's validation metrics first (success, pass@k, reward,
    response length, ...), then each reward component's mean and std."""
    head = names.env_prefix(env, validation=True) + "/"
    first = (names.SUCCESS, *sorted(k[len(head):] for k in metrics if k.startswith(head + "pass@")), "reward",
             "response_length")
    rows = [(LABELS.get(name, name), metrics[head + name])
            for name in first if head + name in metrics]
    rows += [(LABELS.get(k[len(head):], k[len(head):]), v) for k, v in metrics.items()
             if k.startswith(head) and k[len(head):] not in first]
    rows += [(f"reward component {k.split('/')[1]} ({k.split('/')[2]})", v) for k, v in metrics.items()
             if k.startswith(f"{names.VAL_REWARD}/") and k.split("/")[2] in ("mean", "std")]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value:.4g}" for name, value in rows)
