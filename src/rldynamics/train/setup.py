"""Run set-up: run directory, the step to start from, device, models, optimizers, metric sinks.

Everything is checked and loaded before anything is written to the run directory:

    plan_start (read only): the run directory is not in use, not another run's and holds no link in place of a
        file the run writes (`tracking.files`: a run never writes through a link); for a resume, which
        checkpoint it continues, verified file by file, and whether the command asks for settings the
        run was not trained with
    -> make_session (writes nothing): models and optimizers built, optimizer and RNG state restored and checked
    -> the caller locks the run directory (one writer per run), then open_run: stale temporary checkpoints
       removed, rows after the resumed step dropped, config.yaml written.

A start that fails leaves the run directory as it was (or absent).

Several ranks (torchrun): rank 0 makes the checks and the writes; every rank loads the models (from the same files)
and wraps them for the process group (`models.sharding.wrap`: FSDP2 with `model.shard=true`, replicas otherwise).

The base model (the initial weights, and the KL reference of the whole run) is the run's own: a probe of another
run's checkpoint takes it from that run's config.yaml (`run_base_path`), never from its own settings, and a
reference whose parameters do not have the shapes of the checkpoint's actor is refused.

Resuming (`checkpoint.resume=latest` or a checkpoint path of the same run) continues the run with the settings
in its `config.yaml`. Only the keys in `RESUME_MAY_CHANGE` (how long the run goes on, when it stops, where and
how it logs, the device) may differ; any other difference is refused with the list of keys, and nothing is
written. A run killed before its first checkpoint is restarted from step 0 by `checkpoint.resume=latest`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rldynamics import dist
from rldynamics.config import (
    RESUME_MAY_CHANGE,
    Config,
    ConfigError,
    config_diff,
    load_config,
    resume_may_change,
    save_config,
    to_dict,
)
from rldynamics.memory import keep_freed_memory
from rldynamics.models import lora
from rldynamics.models.hardware import Bf16Speed, DtypeChoice, bf16_speed, choose_dtype, cpu_model
from rldynamics.models.loading import load_model_and_tokenizer, load_value_model, resolve_model_path
from rldynamics.models.precision import compute_in, enable_checkpointing
from rldynamics.models.sharding import wrap
from rldynamics.models.tiny import ensure_tiny_model, is_tiny_model
from rldynamics.rollout import engines
from rldynamics.rollout.engines import rollout_engine
from rldynamics.start_notes import warm_starts
from rldynamics.threads import choose_threads
from rldynamics.tracking.environment import describe, record_start
from rldynamics.tracking.run_dir import RunLock, RunWriter, attempts, check_no_links
from rldynamics.tracking.sinks import TensorBoardSink, WandbSink, check_installed
from rldynamics.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_trainer_state,
    read_sampler,
    read_trainer_state,
    remove_stale,
    verify_checkpoint,
)
from rldynamics.train.diagnostics import build_diagnostics, needs_reference
from rldynamics.train.diagnostics import check_world as check_diagnostics_world
from rldynamics.train.diagnostics.base import ROLL_FORWARD, TRAIN
from rldynamics.train.lagged import LaggedPolicy
from rldynamics.train.session import Session, Start
from rldynamics.train.snapshots import Snapshots
from rldynamics.train.warmstart import ensure_warm_start, tiny_corpus


def resolve_device(name: str) -> torch.device:
    """`auto` = cuda when available, else cpu; a device this machine does not have is a ConfigError.

    Several ranks: `auto` and `cuda` mean each rank's own GPU (`cuda:LOCAL_RANK`)."""
    if dist.distributed() and name in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", dist.local_rank())
    if dist.distributed() and name.startswith("cuda:"):
        raise ConfigError(f"model.device={name}: under torchrun each rank uses its own GPU (cuda:LOCAL_RANK); "
                          "use model.device=auto or cuda")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        raise ConfigError(f"model.device={name}: no such CUDA device on this machine "
                          f"({torch.cuda.device_count()} visible); use model.device=auto or cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("model.device=mps: MPS is not available on this machine; use model.device=auto or cpu")
    return device


def base_model_path(cfg: Config) -> str:
    """The initial weights: a local dir / hub id, a GGUF checkpoint or the packaged SmolLM2 (converted once and
    cached), or the embedded tiny model (built, warm-started, cached)."""
    if cfg.model.path != "tiny":
        return resolve_model_path(cfg.model.path, corpus_fn=lambda: ())
    t = cfg.tiny
    path = str(ensure_tiny_model(lambda: tiny_corpus(cfg.env), hidden_size=t.hidden_size, num_layers=t.layers,
                                 intermediate_size=4 * t.hidden_size, tie_embeddings=t.tie_embeddings))
    return ensure_warm_start(path, cfg) if warm_starts(cfg) else path


def run_config(checkpoint: str | Path) -> Config:
    """The saved config of the run a checkpoint belongs to (`runs/<run>/checkpoints/step_N` ->
    `runs/<run>/config.yaml`): what its base model is made of. ConfigError when the run has none (a checkpoint
    moved out of its run)."""
    file = Path(checkpoint).resolve().parent.parent / "config.yaml"
    if not file.is_file():
        raise ConfigError(f"{checkpoint}: its run's {file} is missing, so the run's base model (the KL reference) is "
                          "unknown; use the checkpoint inside its run directory, next to the run's config.yaml "
                          "(runs/<run>/checkpoints/step_<N>)")
    return load_config(file)


def run_base_path(cfg: Config, start: Start) -> str:
    """The base model of the run whose weights the session starts from: this run's own (`base_model_path`), or, for a
    checkpoint of another run (a probe), that run's, built from its config.yaml and never from `cfg`."""
    own = start.checkpoint is None or start.in_place
    return base_model_path(cfg if own else run_config(start.checkpoint))


def check_reference(actor_shapes: dict[str, tuple], reference: torch.nn.Module, base: str, checkpoint: Path) -> None:
    """Refuse a reference model whose parameters are not those of the checkpoint's actor (names and shapes)."""
    shapes = _shapes(reference)
    if shapes == actor_shapes:
        return
    name = next(n for n in sorted(shapes.keys() | actor_shapes.keys()) if shapes.get(n) != actor_shapes.get(n))
    raise CheckpointError(f"{checkpoint / 'actor'}: not the architecture of the base model of its run ({base}, from "
                          f"{checkpoint.resolve().parent.parent / 'config.yaml'}): {name} is "
                          f"{list(actor_shapes.get(name, ()))} in the checkpoint, {list(shapes.get(name, ()))} in "
                          "the base model; a checkpoint copied from another run is analysed inside its own run "
                          "directory")


def _shapes(model: torch.nn.Module) -> dict[str, tuple]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def check_world(cfg: Config, ranks: int | None = None, job: str = TRAIN) -> None:
    """Settings a run of several ranks (default: this process group's) cannot honour are refused before any work
    (ConfigError naming the key): the rollouts' and validation's groups here, the diagnostics' own settings by each
    diagnostic of `job`."""
    ranks = dist.world() if ranks is None else ranks
    if ranks == 1:
        return
    if cfg.rollout.staleness > 0:
        raise ConfigError(f"rollout.staleness={cfg.rollout.staleness} runs in one process (its sampler is a copy of "
                          f"the whole actor); run it without torchrun, or with rollout.staleness=0 on {ranks} ranks")
    check_diagnostics_world(cfg, ranks, job)
    for key, value in {"train.env_groups": cfg.train.env_groups, "val.env_groups": cfg.val.env_groups}.items():
        if value < ranks:
            raise ConfigError(dist.too_few_groups(key, value, ranks))


def resolve_run_dir(cfg: Config, new_name: str | None = None) -> Path:
    """The run directory: `log.run_dir/log.name` (when unset, `new_name` or `<env>_<model>_<time>`), or the run of a
    resumed checkpoint."""
    resume = cfg.checkpoint.resume
    if resume and resume != "latest":
        return Path(resume).resolve().parent.parent
    if resume == "latest" and not cfg.log.name:
        raise ConfigError("checkpoint.resume=latest needs log.name=<run name> to know which run to resume")
    name = cfg.log.name or new_name or f"{cfg.env.name}_{Path(cfg.model.path).name}_{time.strftime('%Y%m%d-%H%M%S')}"
    return Path(cfg.log.run_dir) / name


def resume_base(cfg: Config, run_dir: Path | None = None) -> Config:
    """The saved config of the run that `cfg.checkpoint.resume` continues (in `run_dir`, default the trainer's
    `resolve_run_dir`): what a resumed run starts from."""
    resume = cfg.checkpoint.resume
    if resume != "latest":
        read_trainer_state(resume)  # a missing path, a file or no trainer state: named before anything else
    return _saved_config(cfg, run_dir or resolve_run_dir(cfg))


def _saved_config(cfg: Config, run_dir: Path) -> Config:
    file = run_dir / "config.yaml"
    if not file.is_file():
        raise ConfigError(f"checkpoint.resume={cfg.checkpoint.resume}: {file} not found, so there is no run to "
                          "resume (check log.name and log.run_dir)")
    return load_config(file)


def plan_start(cfg: Config, run_dir: Path) -> Start:
    """Check what can be checked without writing (packages, device, the lock, the checkpoint and settings of a
    resume) and decide where the run starts; raise before any work if it cannot start. (`validate` has already
    built one env with the configured settings.)"""
    check_installed(cfg.log.wandb, cfg.log.tensorboard)
    engines.check_installed(cfg.rollout.engine)
    lora.check_installed(cfg.model.lora.rank)
    resolve_device(cfg.model.device)
    check_no_links(run_dir)  # a link in place of a file the run writes is refused before any work
    RunLock(run_dir).check()  # a second process fails here, at once
    resume = cfg.checkpoint.resume
    path = None if not resume else latest_checkpoint(run_dir) if resume == "latest" else Path(resume)
    in_place = resume == "latest" or (bool(resume) and run_dir.resolve() == Path(resume).resolve().parent.parent)
    check_new_run(run_dir, in_place)
    if in_place:
        check_resume_settings(cfg, run_dir)
    if path is None:  # a new run, or one killed before its first checkpoint: start from step 0
        return Start(in_place=in_place)
    if not in_place:
        run_config(path)  # a checkpoint of another run (a probe): its run's base model must be known
    state = verify_checkpoint(path, needs_critic=cfg.algo.has_critic)
    return Start(checkpoint=path, state=state, in_place=in_place, attempt=attempts(run_dir))


def check_new_run(run_dir: Path, in_place: bool) -> None:
    """Refuse to write a new run (or a probe) into a directory that already holds one."""
    if not in_place and (run_dir / "metrics.jsonl").exists():
        raise FileExistsError(f"run directory {run_dir} already holds a run; choose another log.name or pass "
                              "checkpoint.resume=latest to continue it (from step 0 if it has no checkpoint yet)")


def check_resume_settings(cfg: Config, run_dir: Path) -> None:
    """Refuse to continue a run with settings other than its own (except `RESUME_MAY_CHANGE`)."""
    differ = [f"{key} (run: {old!r}, given: {new!r})" for key, old, new in config_diff(_saved_config(cfg, run_dir), cfg)
              if not key.startswith(RESUME_MAY_CHANGE)]
    if differ:
        raise ConfigError(f"cannot resume {run_dir} with other settings: {'; '.join(differ)}. A resumed run keeps "
                          f"its config.yaml (only {resume_may_change()} may change); to go on with other settings "
                          "start a new run from the weights: model.path=<checkpoint>/actor (a LoRA run's: "
                          "<checkpoint>/actor_merged, written with checkpoint.save_merged=true)")


def make_session(cfg: Config, run_dir: Path, start: Start, job: str = TRAIN) -> Session:
    """Build the session of `job` for `cfg`, resuming `start`; writes nothing (`open_run` does, under the lock)."""
    device = resolve_device(cfg.model.device)
    threads, threads_from, malloc, precision = start_compute(cfg, device)
    torch.manual_seed(cfg.seed)
    base = dist.on_main(run_base_path, cfg, start)  # the tiny model is built (and warm-started) once, by rank 0
    ckpt = start.checkpoint
    model, tokenizer = load_actor(cfg, base, ckpt, device)
    if lora.is_adapted(model) and dist.is_main():
        print(lora.count(model).words(), flush=True)
    actor_shapes = _shapes(model)
    model = wrap(prepare(model, cfg, precision), cfg.model.shard)
    optimizer = adamw(lora.trainable(model), cfg.train.lr, cfg.train.weight_decay, cfg.train.optim)
    diagnostics = build_diagnostics(cfg, start.state, job)  # a resumed run's diagnostics go on
    ref_model = None
    if needs_reference(cfg, job):
        ref_model = model if lora.is_adapted(model) else load_reference(cfg, base, ckpt, actor_shapes, device,
                                                                         precision)
    critic = critic_optimizer = None
    if cfg.algo.has_critic:
        critic = load_value_model(str(ckpt / "critic") if ckpt else base, device=str(device))
        critic = wrap(prepare(critic, cfg, precision), cfg.model.shard)
        critic_optimizer = adamw(critic.parameters(), cfg.critic.lr, 0.0, cfg.train.optim)
    if ckpt is not None:
        load_trainer_state(ckpt, model=model, optimizer=optimizer, critic=critic, critic_optimizer=critic_optimizer)
        set_optimizer_settings(cfg, optimizer, critic_optimizer)  # a rollback's remedy may have changed them
    environment = describe(start.step, threads, threads_from, _device_name(device),
                           base if cfg.model.path == "tiny" and dist.is_main() else None)
    trained = sum(p.numel() for p in lora.trainable(model))  # with LoRA: the adapters' alone
    environment.update(precision.record(), malloc=malloc, trained_parameters=trained)
    engine = rollout_engine(cfg, base, model, precision.engine_dtype)
    return Session(cfg=cfg, run_dir=run_dir, writer=None, model=model, tokenizer=tokenizer, optimizer=optimizer,
                   ref_model=ref_model, critic=critic, critic_optimizer=critic_optimizer, main=dist.is_main(),
                   environment=environment, engine=engine, diagnostics=diagnostics, attempt=start.attempt,
                   snapshots=Snapshots(cfg, model, critic), lagged=lagged_policy(cfg, model, start, engine, job))


def lagged_policy(cfg: Config, model, start: Start, engine, job: str) -> LaggedPolicy | None:
    """The sampler of a training run (or a replay's retraining) with `rollout.staleness` >= 1, its earlier versions
    from the resumed checkpoint's `sampler.pt`; None on-policy, for a probe (it samples the weights it probes) and for
    a replay (it takes the recorded rollout)."""
    if cfg.rollout.staleness == 0 or job not in (TRAIN, ROLL_FORWARD):
        return None
    history = read_sampler(start.checkpoint) if start.checkpoint is not None else None
    try:
        return LaggedPolicy(cfg.rollout.staleness, model, start.step, history, engine)
    except ValueError as e:
        raise CheckpointError(f"{start.checkpoint}: {e} (sampler.pt: written by a run with a smaller "
                              f"rollout.staleness, or none); a run with rollout.staleness={cfg.rollout.staleness} "
                              f"can start from its weights instead: model.path={start.checkpoint}/actor") from None


def set_optimizer_settings(cfg: Config, optimizer, critic_optimizer=None) -> None:
    """The config's learning rates, weight decay and AdamW implementation in the optimizers (a checkpoint's
    optimizer state carries the values it was saved with, `fused` included; a rollback's remedy or a replay's
    what-if may change them, and a checkpoint written before `train.optim` holds the loop's)."""
    fused = cfg.train.optim == "adamw_torch_fused"
    for group in optimizer.param_groups:
        group.update(lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, fused=fused, foreach=None)
    if critic_optimizer is not None:
        for group in critic_optimizer.param_groups:
            group.update(lr=cfg.critic.lr, fused=fused, foreach=None)


def adamw(params, lr: float, weight_decay: float, optim: str) -> torch.optim.AdamW:
    """AdamW over `params`, fused (`adamw_torch_fused`) or the per-parameter loop (`adamw_torch`): `train.optim`."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=optim == "adamw_torch_fused")


def load_actor(cfg: Config, base: str, checkpoint: Path | None, device: torch.device) -> tuple[torch.nn.Module, object]:
    """The actor a session starts from, and its tokenizer: a checkpoint's (its whole weights, or its LoRA adapter put
    back on `base`, the base model of its run), else `base`, with fresh adapters when `model.lora.rank` > 0."""
    actor = checkpoint / "actor" if checkpoint is not None else None
    adapter = actor is not None and lora.is_adapter_dir(actor)
    model, tokenizer = load_model_and_tokenizer(str(actor) if actor and not adapter else base, device=str(device),
                                                chat_template=cfg.model.chat_template)
    if adapter:
        model = lora.load_adapter(model, actor)
    elif actor is None and cfg.model.lora.rank > 0:
        r = cfg.model.lora
        model = lora.add_adapters(model, r.rank, r.alpha, r.dropout, r.target_modules)
    return model, tokenizer


def load_reference(cfg: Config, base: str, checkpoint: Path | None, actor_shapes: dict[str, tuple],
                   device: torch.device, precision: Precision) -> torch.nn.Module:
    """The KL reference of a full fine-tuning run: the base model loaded a second time, frozen, computing as the actor
    does (checked against a checkpoint's actor: `check_reference`)."""
    ref_model, _ = load_model_and_tokenizer(base, device=str(device))
    if checkpoint is not None:
        check_reference(actor_shapes, ref_model, base, checkpoint)
    return wrap(prepare(ref_model.requires_grad_(False), cfg, precision), cfg.model.shard)


def start_compute(cfg: Config, device: torch.device) -> tuple[int, str, str, Precision]:
    """How this process computes, set and said once per start (`rldyn train`, `probe`, `eval`): torch's thread
    count, freed memory kept for reuse, the compute dtypes; the first console line says them. Returns (threads,
    where the number comes from, what malloc does, precision)."""
    threads, threads_from = set_threads(cfg)
    malloc = keep_freed_memory()
    precision = choose_precision(cfg, device)
    announce(device, threads, threads_from, precision)
    return threads, threads_from, malloc, precision


def set_threads(cfg: Config) -> tuple[int, str]:
    """Set torch's CPU thread count (`threads.choose_threads`); returns (threads, where the number comes from)."""
    threads, threads_from = choose_threads(cfg.model.threads)
    torch.set_num_threads(threads)
    return threads, threads_from


@dataclass(frozen=True)
class Precision:
    """The compute dtypes of a start (`model.dtype`, and `rollout.vllm_dtype` with the vLLM engine), resolved by the
    hardware rule of `models.hardware`, and the device's bfloat16 speed behind them."""

    model: DtypeChoice
    engine: DtypeChoice | None  # None: no vLLM engine
    speed: Bf16Speed

    @property
    def engine_dtype(self) -> str:
        return self.engine.name if self.engine is not None else self.model.name

    def words(self) -> str:
        """`compute float32 (model.dtype=auto: ...)`, with the engine's dtype when it has one."""
        out = f"compute {self.model.name} ({self.model.reason})"
        return out + (f", vLLM {self.engine.name} ({self.engine.reason})" if self.engine is not None else "")

    def record(self) -> dict:
        """The fields of `environment.jsonl` that say which dtype computes and why."""
        out = {"compute_dtype": self.model.name, "compute_dtype_reason": self.model.reason,
               "bf16_capability": self.speed.capability, "bf16_factor": self.speed.factor, "cpu_model": cpu_model()}
        if self.engine is not None:
            out.update(vllm_dtype=self.engine.name, vllm_dtype_reason=self.engine.reason)
        return out


def choose_precision(cfg: Config, device: torch.device) -> Precision:
    """Resolve `model.dtype` (and `rollout.vllm_dtype`) on `device` (`models.hardware.choose_dtype`)."""
    engine = cfg.rollout.vllm_dtype if cfg.rollout.engine == "vllm" else None
    tiny = is_tiny_model(cfg.model.path)  # `tiny`, or a checkpoint of it (`rldyn eval`)
    explicit = "bfloat16" in (cfg.model.dtype, engine)
    speed = bf16_speed(device, measure=explicit or not tiny, measure_slow=explicit)  # tiny + auto: float32 anyway
    return Precision(model=choose_dtype("model.dtype", cfg.model.dtype, speed, tiny=tiny),
                     engine=None if engine is None else choose_dtype("rollout.vllm_dtype", engine, speed, tiny=tiny),
                     speed=speed)


def announce(device: torch.device, threads: int, threads_from: str, precision: Precision) -> None:
    """The run's first console line: device, threads and compute dtype, each with why (rank 0); then any warning."""
    if not dist.is_main():
        return
    print(f"device {_device_name(device)}, {threads} torch thread{'s' if threads > 1 else ''} ({threads_from}), "
          f"{precision.words()}", flush=True)
    for choice in (precision.model, precision.engine):
        if choice is not None and choice.warning:
            print(choice.warning, flush=True)


def _device_name(device: torch.device) -> str:
    """`cpu`, or `cuda:0 (NVIDIA H100 80GB HBM3)`."""
    return f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)


def prepare(model: torch.nn.Module, cfg: Config, precision: Precision) -> torch.nn.Module:
    """A float32 model (loaded so, whatever the checkpoint stores) set to compute in the resolved `model.dtype`
    (mixed precision) and, with `model.gradient_checkpointing`, to recompute its blocks in backward."""
    model = compute_in(model, precision.model.name)
    return enable_checkpointing(model) if cfg.model.gradient_checkpointing else model


def open_run(s: Session, start: Start) -> None:
    """The first writes (run directory locked): what was written after the resumed step dropped (everything when
    starting from step 0; a damaged log line stops here, before any change), stale temporary checkpoints
    removed, metric mirrors opened, config.yaml written."""
    check_new_run(s.run_dir, start.in_place)  # again under the lock: another start may have won the race
    s.writer = RunWriter(s.run_dir)
    s.writer.truncate_after(start.step if start.checkpoint is not None else -1)
    remove_stale(s.run_dir / "checkpoints")
    s.writer.sinks = _sinks(s.cfg, s.run_dir)
    save_config(s.cfg, s.run_dir / "config.yaml")
    if s.environment is not None:
        record_start(s.run_dir, s.environment)


def load_early_stop(stopper, start: Start) -> None:
    """Restore the early-stop state of a resumed checkpoint (CheckpointError naming the file if it is foreign)."""
    if start.state is None:
        return
    try:
        stopper.load_state_dict(start.state["early_stop"])
    except ValueError as e:
        raise CheckpointError(f"{start.checkpoint / 'trainer_state.json'}: {e}") from None


def _sinks(cfg: Config, run_dir: Path) -> list:
    sinks = []
    if cfg.log.wandb:
        sinks.append(WandbSink(cfg.log.wandb_project, run_dir.name, to_dict(cfg), run_dir))
    if cfg.log.tensorboard:
        sinks.append(TensorBoardSink(run_dir))
    return sinks
