"""Run set-up: run directory, device, models (actor, reference, critic), optimizers, metric sinks."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from rldynamics.config import Config, save_config, to_dict
from rldynamics.models.loading import load_model_and_tokenizer, load_value_model
from rldynamics.models.tiny import ensure_tiny_model
from rldynamics.tracking.run_dir import RunWriter
from rldynamics.tracking.sinks import TensorBoardSink, WandbSink, check_installed
from rldynamics.train.checkpoint import find_checkpoint
from rldynamics.train.warmstart import ensure_warm_start, tiny_corpus


def resolve_device(name: str) -> torch.device:
    """`auto` = cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def base_model_path(cfg: Config) -> str:
    """The initial weights: a local dir / hub id, or the embedded tiny model (built, warm-started, cached)."""
    if cfg.model.path != "tiny":
        return cfg.model.path
    m = cfg.model
    path = str(ensure_tiny_model(lambda: tiny_corpus(cfg.env), hidden_size=m.tiny_hidden_size, num_layers=m.tiny_layers,
                                 intermediate_size=4 * m.tiny_hidden_size))
    return ensure_warm_start(path, cfg) if m.warm_start_episodes > 0 else path


def resolve_run_dir(cfg: Config) -> Path:
    """The run directory; refuses to write over an existing run unless resuming it."""
    resume = cfg.checkpoint.resume
    if resume and cfg.analysis.only:
        raise ValueError("analysis.only=true with checkpoint.resume would log into the checkpointed run itself; use "
                         "`rldyn probe <checkpoint>`, which writes its own run directory")
    if resume and resume != "latest":
        return Path(resume).resolve().parent.parent
    if resume == "latest" and not cfg.log.name:
        raise ValueError("checkpoint.resume=latest needs log.name=<run name> to know which run to resume")
    name = cfg.log.name or f"{cfg.env.name}_{Path(cfg.model.path).name}_{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.log.run_dir) / name
    if not resume and (run_dir / "metrics.jsonl").exists():
        raise FileExistsError(f"run directory {run_dir} already holds a run; choose another log.name or pass "
                              "checkpoint.resume=latest to continue it")
    return run_dir


def make_session(cfg: Config, run_dir: Path | None = None):
    """Build the training session (models on device, optimizers, writer) for `cfg`."""
    from rldynamics.train.trainer import Session

    run_dir = run_dir or resolve_run_dir(cfg)
    check_installed(cfg.log.wandb, cfg.log.tensorboard)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.model.device)
    base = base_model_path(cfg)
    ckpt = find_checkpoint(cfg.checkpoint.resume, run_dir) if cfg.checkpoint.resume else None
    actor_path = str(ckpt / "actor") if ckpt else base
    model, tokenizer = load_model_and_tokenizer(actor_path, dtype=cfg.model.dtype, device=str(device),
                                                chat_template=cfg.model.chat_template)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    ref_model = None
    if cfg.algo.kl_coef > 0 or cfg.analysis.enabled:  # the probe measures the KL gradient even at coef 0
        ref_model, _ = load_model_and_tokenizer(base, dtype=cfg.model.dtype, device=str(device))
        ref_model.requires_grad_(False)
    critic = critic_optimizer = None
    if cfg.algo.adv_estimator == "gae":
        critic = load_value_model(str(ckpt / "critic") if ckpt else base, dtype=cfg.model.dtype, device=str(device))
        critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=cfg.critic.lr, weight_decay=0.0)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    writer = RunWriter(run_dir, sinks=_sinks(cfg, run_dir))
    return Session(cfg=cfg, run_dir=run_dir, writer=writer, model=model, tokenizer=tokenizer, optimizer=optimizer,
                   ref_model=ref_model, critic=critic, critic_optimizer=critic_optimizer)


def _sinks(cfg: Config, run_dir: Path) -> list:
    sinks = []
    if cfg.log.wandb:
        sinks.append(WandbSink(cfg.log.wandb_project, run_dir.name, to_dict(cfg), run_dir))
    if cfg.log.tensorboard:
        sinks.append(TensorBoardSink(run_dir))
    return sinks
