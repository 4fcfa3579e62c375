"""`rldyn sft`: supervised fine-tuning on demonstrations, the warm start before RL (TRL's SFTTrainer, then GRPO).

What it trains on (`train.sft_data`): episodes the env's own solver plays through the agent loop, in the exact
multi-turn chat the env plays and the model's chat template (`sft.episodes`, each action random with probability
`sft.noise` for a deliberately weak start), or a user's data set in TRL's conversational format (`sft.data`). The
loss is the mean NLL of the assistant's tokens only; conversations are packed into rows of `sft.max_length` tokens.

Held out: a demonstration never plays a validation puzzle. Its seeds are on training's side of `val.held_out` (the
trainer's split by content), and any demonstration whose problem is one of the validation puzzles' is dropped (with
`val.held_out` = 0 they can share problems). Validation (`sft.val_every`; always before the first step and after
the last): the loss on the solver's demonstrations of the validation puzzles, and the env's success there, measured
by the trainer's validation stage (`train.stages.validate`: `val.env_groups` x `val.group_size` at
`val.temperature`), so the number is the one `rldyn train` logs at its step 0.

The run directory is the trainer's: config.yaml, metrics.jsonl (`sft/*` rows, validation's `val-env/<env>/*`),
checkpoints/step_N (`train.checkpoint`: `actor/` loads with `from_pretrained` and trains with `rldyn train
model.path=<checkpoint>/actor`). A killed run resumes exactly (`checkpoint.resume=latest log.name=<run>`): the
demonstrations are played again from the same seeds, the epoch's order is a function of (seed, epoch), and the
optimizer and RNG state come from the checkpoint. One process (no torchrun). On the embedded tiny model it starts
from the untrained model (`model.warm_start_*` is the trainer's own use of this code: `train.warmstart`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rldynamics import metric_names as names
from rldynamics.config import Config, ConfigError, save_config
from rldynamics.envs import ENVS
from rldynamics.envs.base import demonstrable
from rldynamics.models.forward import packed_logprobs, token_logprobs
from rldynamics.tracking.console import Lines, progress_bar
from rldynamics.train.batch_ops import env_seeds, step_seed, validation_seeds
from rldynamics.train.sft_data import (
    DEMO_SEED_BASE,
    Conversation,
    demonstrations,
    pack,
    packed_tensors,
    padded_tensors,
    read_conversations,
)

MAX_GRAD_NORM = 1.0  # TRL's SFTConfig default
PACKING_TOLERANCE = 1e-3  # logits: what the conversation before may move a packed one's by (`check_packing`)


@dataclass(frozen=True)
class SftData:
    """The conversations of a fine-tuning: those it trains on, those its validation loss is measured on."""

    train: list[Conversation]
    val: list[Conversation]


@dataclass(frozen=True)
class StepResult:
    """One optimizer step: the NLL per trained token, the pre-clip gradient norm, trained and forwarded tokens."""

    loss: float
    grad_norm: float
    tokens: int
    forwarded: int  # tokens the forwards computed, padding included
    real: int  # ... of which conversations' own

    def metrics(self, lr: float) -> dict[str, float]:
        return {names.SFT_LOSS: self.loss, names.SFT_GRAD_NORM: self.grad_norm, names.SFT_TOKENS: float(self.tokens),
                names.SFT_PADDING: 1.0 - self.real / self.forwarded if self.forwarded else 0.0, names.SFT_LR: lr}


# ---------------------------------------------------------------------------------------------- demonstrations


def sft_data(cfg: Config, tokenizer, log=print) -> SftData:
    """The training and validation conversations of `cfg.sft` (a data set, else the env's solver)."""
    if cfg.sft.data:
        return SftData(read_conversations(cfg.sft.data, tokenizer), [])
    if not demonstrable(ENVS[cfg.env.name]):
        raise ConfigError(f"env {cfg.env.name!r} has no solver to demonstrate; give conversations with "
                          "sft.data=<file or datasets directory> (TRL's `messages` format)")
    val = demonstrations(cfg, tokenizer, validation_seeds(cfg), 0.0, cfg.seed)
    held = {c.problem for c in val}
    start = time.perf_counter()
    seeds = env_seeds(cfg, [DEMO_SEED_BASE + i for i in range(cfg.sft.episodes)])
    demos = demonstrations(cfg, tokenizer, seeds, cfg.sft.noise, cfg.seed)
    kept = [d for d in demos if d.problem not in held]
    if not kept:
        raise ConfigError(f"every one of the {len(demos)} demonstrations plays a validation puzzle (env {cfg.env.name} "
                          "has few distinct problems): set val.held_out (e.g. 0.25) to keep a share of them for "
                          "validation alone")
    log(f"sft: {len(kept)} solver demonstrations of {cfg.env.name} (action noise {cfg.sft.noise:g}) in "
        f"{time.perf_counter() - start:.0f} s, {len(demos) - len(kept)} left out for playing a validation puzzle")
    return SftData(kept, val)


# ---------------------------------------------------------------------------------------------- the loss


def rows_of(convs: list[Conversation], packing: bool, max_length: int) -> list[list[Conversation]]:
    """The rows a step takes: packed conversations, or one conversation per row."""
    if not packing:
        pack([len(c) for c in convs], max_length)  # the same refusal of a conversation that is too long
        return [[c] for c in convs]
    return [[convs[i] for i in row] for row in pack([len(c) for c in convs], max_length)]


def nll_sum(model, rows: list[list[Conversation]], pad_id: int, packed: bool) -> tuple[torch.Tensor, int, int]:
    """Summed NLL of the trained tokens of `rows` [] (with its graph), their count and the forwarded tokens."""
    if packed:
        ids, positions, trained = packed_tensors(rows, pad_id)  # [R, W] each
        logprobs = packed_logprobs(model, ids, positions, trained)  # [R, W]
    else:
        ids, attention, trained = padded_tensors([c for row in rows for c in row], pad_id)  # [N, W] each
        logprobs, _ = token_logprobs(model, ids, attention, positions=trained, shared_prefix=False)  # [N, W]
    return -(logprobs * trained).sum(), int(trained.sum()), ids.numel()


def supervised_step(model, optimizer, rows: list[list[Conversation]], pad_id: int, packed: bool,
                    micro_batch_size: int) -> StepResult:
    """One AdamW step on the token-mean NLL of `rows`, accumulated over micro-batches of `micro_batch_size` rows
    (each micro-batch's sum divided by the step's trained tokens: the gradient of the whole step's mean)."""
    tokens = sum(sum(c.trained) for row in rows for c in row)
    if not tokens:
        raise ValueError("a step with no assistant token to train on")
    optimizer.zero_grad(set_to_none=True)
    total, forwarded = 0.0, 0
    for start in range(0, len(rows), micro_batch_size):
        nll, _, width = nll_sum(model, rows[start:start + micro_batch_size], pad_id, packed)
        (nll / tokens).backward()
        total += nll.item()
        forwarded += width
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], MAX_GRAD_NORM)
    optimizer.step()
    real = sum(len(c) for row in rows for c in row)
    return StepResult(total / tokens, float(grad_norm), tokens, forwarded, real)


@torch.no_grad()
def mean_nll(model, rows: list[list[Conversation]], pad_id: int, packed: bool, micro_batch_size: int) -> float:
    """The NLL per trained token of `rows`, no gradient."""
    total, tokens = 0.0, 0
    for start in range(0, len(rows), micro_batch_size):
        nll, n, _ = nll_sum(model, rows[start:start + micro_batch_size], pad_id, packed)
        total, tokens = total + nll.item(), tokens + n
    return total / max(tokens, 1)


@torch.no_grad()
def check_packing(model, convs: list[Conversation]) -> None:
    """Refuse packing on a model that attends across packed conversations: the second conversation, packed after the
    first and after the first reversed, must get the same logits (a masked-out key has weight exactly 0, in any
    dtype). A model that ignores the position ids' restarts fails here, before any step."""
    if len(convs) < 2:
        return
    first, second = convs[0].ids, convs[1].ids
    ids = torch.tensor([[*first, *second], [*reversed(first), *second]])  # [2, L]
    positions = torch.tensor([*range(len(first)), *range(len(second))]).repeat(2, 1)  # [2, L]
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[:, len(first):].float()  # [2, n, V]
    gap = float((logits[0] - logits[1]).abs().max())
    if gap > PACKING_TOLERANCE:
        raise ConfigError(f"sft.packing: this model attends across packed conversations (a conversation's logits move "
                          f"by {gap:.3g} with the one packed before it); set sft.packing=false")


def epoch_order(rows: int, seed: int, epoch: int) -> list[int]:
    """The order of the rows in `epoch` (0-based): a permutation seeded by (seed, epoch) alone, so a resumed run
    takes the same steps."""
    generator = torch.Generator().manual_seed(step_seed(seed, epoch, stream=5))
    return torch.randperm(rows, generator=generator).tolist()


def step_rows(rows: list[list[Conversation]], batch_size: int, seed: int, step: int) -> list[list[Conversation]]:
    """The rows of step `step` (1-based): the epoch's order cut into batches of `batch_size` (the last one may be
    smaller)."""
    per_epoch = math.ceil(len(rows) / batch_size)
    epoch, index = divmod(step - 1, per_epoch)
    order = epoch_order(len(rows), seed, epoch)
    return [rows[i] for i in order[index * batch_size:(index + 1) * batch_size]]


# ---------------------------------------------------------------------------------------------- the command


def sft_run_dir(cfg: Config) -> Path:
    """The trainer's run directory (`train.setup.resolve_run_dir`), named `sft_<env or data>_<model>_<time>` when
    `log.name` is unset."""
    from rldynamics.train.setup import resolve_run_dir

    what = Path(cfg.sft.data).stem if cfg.sft.data else cfg.env.name
    return resolve_run_dir(cfg, f"sft_{what}_{Path(cfg.model.path).name}_{time.strftime('%Y%m%d-%H%M%S')}")


def run_sft(cfg: Config) -> Path:
    """`rldyn sft`: fine-tune `model.path` on `cfg.sft`'s conversations; returns the run directory."""
    from rldynamics.models import lora
    from rldynamics.tracking.run_dir import RunLock, RunWriter, check_no_links
    from rldynamics.train.checkpoint import (
        SFT_JOB,
        crash_point,
        latest_checkpoint,
        load_trainer_state,
        remove_stale,
        save_checkpoint,
        verify_checkpoint,
    )
    from rldynamics.train.setup import (
        check_new_run,
        check_resume_settings,
        load_actor,
        prepare,
        resolve_device,
        start_compute,
    )

    run_dir = sft_run_dir(cfg)
    check_no_links(run_dir)
    RunLock(run_dir).check()
    resume = cfg.checkpoint.resume
    checkpoint = None if not resume else latest_checkpoint(run_dir) if resume == "latest" else Path(resume)
    check_new_run(run_dir, in_place=bool(resume))
    if resume:
        check_resume_settings(cfg, run_dir)
    state = verify_checkpoint(checkpoint, job=SFT_JOB) if checkpoint is not None else {"step": 0}
    device = resolve_device(cfg.model.device)
    *_, precision = start_compute(cfg, device)
    torch.manual_seed(cfg.seed)
    base = sft_base_path(cfg)
    model, tokenizer = load_actor(cfg, base, checkpoint, device)
    model = prepare(model, cfg, precision)
    optimizer = torch.optim.AdamW(lora.trainable(model), lr=cfg.sft.lr, weight_decay=0.0)
    if checkpoint is not None:
        load_trainer_state(checkpoint, model=model, optimizer=optimizer)
    data = sft_data(cfg, tokenizer)
    rows = rows_of(data.train, cfg.sft.packing, cfg.sft.max_length)
    val_rows = rows_of(data.val, cfg.sft.packing, cfg.sft.max_length) if data.val else []
    pad_id = tokenizer.pad_token_id
    if cfg.sft.packing:
        check_packing(model, data.train)
    per_epoch = math.ceil(len(rows) / cfg.sft.batch_size)
    steps = cfg.sft.epochs * per_epoch
    print(f"sft: {len(data.train)} conversations in {len(rows)} rows, {per_epoch} steps per epoch, {steps} steps; "
          f"validation: {len(data.val)} demonstrations"
          + (f" and {cfg.val.env_groups} x {cfg.val.group_size} {cfg.env.name} rollouts" if cfg.sft.success else ""),
          flush=True)
    engine = _engine(cfg, base, model, precision)
    with RunLock(run_dir):
        check_new_run(run_dir, in_place=bool(resume))
        writer = RunWriter(run_dir)
        writer.truncate_after(state["step"] if checkpoint is not None else -1)
        remove_stale(run_dir / "checkpoints")
        save_config(cfg, run_dir / "config.yaml")
        validate = _validator(cfg, run_dir, model, tokenizer, engine, val_rows, pad_id)
        if state["step"] == 0:
            writer.log(0, validate())
        lines = Lines("sft step", steps, state["step"], enabled=cfg.log.progress)
        with progress_bar(cfg.log.progress) as bar:
            task = bar.add_task("sft", total=steps, completed=state["step"], info="")
            for step in range(state["step"] + 1, steps + 1):
                model.train()
                start = time.perf_counter()
                result = supervised_step(model, optimizer, step_rows(rows, cfg.sft.batch_size, cfg.seed, step),
                                         pad_id, cfg.sft.packing, cfg.sft.micro_batch_size)
                metrics = {**result.metrics(cfg.sft.lr), names.SFT_EPOCH: step / per_epoch,
                           names.STEP_TIME: time.perf_counter() - start}
                last = step == steps
                if last or (cfg.sft.val_every and step % cfg.sft.val_every == 0):
                    metrics.update(validate())
                writer.log(step, metrics)
                info = f"NLL {result.loss:.3f}" + (f" | val NLL {metrics[names.SFT_VAL_LOSS]:.3f}"
                                                   if names.SFT_VAL_LOSS in metrics else "")
                bar.update(task, advance=1, info=info)
                lines.line(step, info)
                c = cfg.checkpoint
                if (c.every and step % c.every == 0) or (last and c.save_last):
                    save_checkpoint(run_dir / "checkpoints", step, model=model, tokenizer=tokenizer,
                                    optimizer=optimizer, trainer_state={"step": step, "job": SFT_JOB},
                                    keep_last=c.keep_last, merged=c.save_merged)
                crash_point("sft_step", step)
        writer.close()
    final = latest_checkpoint(run_dir)
    if final is not None:
        print(f"sft: done; train on it with: rldyn train model.path={final / 'actor'}", flush=True)
    return run_dir


def sft_base_path(cfg: Config) -> str:
    """The weights fine-tuning starts from: `model.path`, or for the embedded tiny model the untrained one (never
    the trainer's warm start, which is this command's own use)."""
    from rldynamics.train.setup import base_model_path

    if cfg.model.path != "tiny":
        return base_model_path(cfg)
    return base_model_path(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, warm_start_episodes=0)))


def _engine(cfg: Config, base: str, model, precision):
    """The rollout engine of validation (None: HF generate on the model), when success is measured."""
    from rldynamics.rollout.engines import rollout_engine

    return rollout_engine(cfg, base, model, precision.engine_dtype) if cfg.sft.success else None


def _validator(cfg: Config, run_dir: Path, model, tokenizer, engine, val_rows, pad_id: int):
    """A function giving validation's metrics now: the validation loss and the env's success (`sft.success`)."""
    from rldynamics.train import stages
    from rldynamics.train.session import Session

    def validate() -> dict[str, float]:
        model.eval()
        metrics = {}
        if val_rows:
            metrics[names.SFT_VAL_LOSS] = mean_nll(model, val_rows, pad_id, cfg.sft.packing,
                                                   cfg.sft.micro_batch_size)
        if cfg.sft.success:
            if engine is not None:
                engine.sync(model)
            session = Session(cfg=cfg, run_dir=run_dir, writer=None, model=model, tokenizer=tokenizer,
                              optimizer=None, engine=engine)
            metrics.update(stages.validate(session).metrics)
        return metrics

    return validate
