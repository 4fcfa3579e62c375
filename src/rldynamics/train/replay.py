"""`rldyn replay RUN --step N`: recompute a recorded step's update from the checkpoint before it, and check it.

The replay loads the weights, optimizer and critic of the step before N (`checkpoints/step_<N-1>`, or the state
kept beside the record, `records/step_<N>.before/`; the base model for N = 1) and the record of step N
(`records/step_<N>.safetensors`, `tracking/step_records.py`), and composes the stages of a training step on the
recorded rollout instead of a new one:

    recorded rollout -> filter -> prepare (the passes the step ran) -> critic update -> actor update

with the optimizer steps the health monitor refused refused again. On the same machine with the same thread count
(the record's, set by default) the replay of an unchanged step ends with bit-identical weights (the record holds the
SHA-256 of the weights after the step) and the same loss and gradient norm; `replay.json` says whether it did.

Without a checkpoint at N-1 the run is first rolled forward from its last checkpoint before N (or from step 0) to
N-1 by training those steps again (`replays/roll_forward/`, a run directory of its own, kept for later replays):
every step is seeded by (seed, step), so this repeats the run exactly where a resume does (the HF engine; not across
a health rollback, whose steps drew other samples).

A step trained on W ranks (torchrun, `rldyn train --nproc`, the default `--nproc auto` on a CPU of 2 cores or
more) is replayed on W ranks (`rldyn replay` starts them), so its gradient sums run in the run's order and the weights
can again be bit-identical; with `--attribute` the replay runs in one process (the attribution holds whole per-row
gradients) and the weights are not compared (`weights_identical` is null).

A record is replayed only in the run that wrote it (`check_record`): one naming another run
(`RecordedStep.run_id`, the run directory's `run_id`) is refused, and so is one whose rollout has another
shape (train.env_groups x train.group_size rows) or another sampling seed than the run draws at
that step (what is left to check in a record written before records named their run).

What-ifs: KEY=VALUE overrides of what the update does with the recorded rollout (`WHAT_IFS`:
losses and their coefficients, clip ranges, learning rates, mini-batches, the filter) apply to
step N only; the replay then runs the step twice from the same start, as recorded and as changed,
and compares the two updates (norms, the cosine between them, losses). Overrides of the rollout,
the model or anything else a replay does not use are refused before any work (`check_what_if`).
With `--attribute` it also attributes the step's gradient to its trajectories, groups and tokens
(`analysis/attribution.py`) before the update, into `attribution.json`, says how that gradient
relates to the recorded `actor/grad_norm` (`norm_note`), and writes the run's report.html again
where the run has one.

Output: `<run>/replays/step_<N>[_<what-if>]/` (a run directory: config.yaml, metrics.jsonl with
the replayed row, replay.json, attribution.json), each written into a temporary sibling and
renamed into place once complete (`staged`): an interrupted replay leaves the earlier one as it
was.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rldynamics import dist
from rldynamics import metric_names as names
from rldynamics.analysis.gram import dot64
from rldynamics.config import (
    Config,
    ConfigError,
    TrainConfig,
    apply_overrides,
    config_diff,
    load_config,
)
from rldynamics.models.precision import compute_dtype
from rldynamics.models.sharding import whole_tensor
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.tracking.console import StepConsole
from rldynamics.tracking.files import remove, write_file
from rldynamics.tracking.run_dir import read_metrics
from rldynamics.tracking.step_records import (
    ATTRIBUTION_FILE,
    REPLAYS_DIR,
    RecordedStep,
    RecordError,
    record_path,
    replay_dir,
    run_identity,
    state_before_path,
)
from rldynamics.train import stages
from rldynamics.train.batch_ops import filter_batch, step_seed
from rldynamics.train.checkpoint import checkpoint_step, checkpoints
from rldynamics.train.diagnostics import build_diagnostics
from rldynamics.train.diagnostics.base import ROLL_FORWARD, TRAIN, Needs
from rldynamics.train.lifecycle import opened
from rldynamics.train.record_io import batch_of, weights_digest
from rldynamics.train.session import Session
from rldynamics.train.step_record import StepRecord

REPLAY = "replay"  # the job of a replay: it runs no diagnostic
QUIET = ["log.report=false", "val.before_train=false"]
COMPARED = (names.PG_LOSS, names.ACTOR_GRAD_NORM, names.KL_LOSS, names.PG_CLIPFRAC)  # the recorded update's losses
# what a what-if may change (an entry ending in "." covers a section)
WHAT_IFS = ("algo.", "critic.", "filter.", "train.lr", "train.weight_decay", "train.max_grad_norm",
            "train.mini_batch_size", "train.micro_batch_size", "train.ppo_epochs", "train.shuffle",
            "train.shared_prefix", "model.threads")
CAN_CHANGE = ("a replay can change the losses and their coefficients (algo.*: clip ranges, KL "
              "and entropy coefficients, loss aggregation, advantages), the learning rates and "
              "optimizer steps (train.lr, train.weight_decay, train.max_grad_norm, "
              "train.mini_batch_size, train.ppo_epochs, critic.*) and the filter (filter.*)")
# what the recorded rollout fixed
ROLLOUT_KEYS = ("env.", "rollout.", "seed", "train.env_groups", "train.group_size",
                "train.seed_base", "train.temperature", "train.row_seeded_sampling", "val.held_out")
# relative gap between two passes' gradient norms that rounding alone explains, per compute dtype
ROUNDING = {"float32": 1e-4, "bfloat16": 5e-2}


@dataclass
class Replayed:
    """One replay of the step: its metrics row, the weights digest after it and the change it made."""

    metrics: dict[str, float]
    digest: str | None
    delta: torch.Tensor | None  # [P] float32: weights after - before (None without an actor update)
    kept_rows: list[int] = field(default_factory=list)
    old_logprobs_pass: bool | None = None  # whether the update ran the old-log-prob pass (None: nothing prepared)


def replay_command(run_dir: str | Path, step: int, overrides: list[str], attribute: bool = False) -> Path:
    """Replay step `step` of `run_dir` (with what-if `overrides`); returns the replay's directory
    (the what-if's when there are overrides)."""
    run_dir = Path(run_dir).resolve()
    path = record_path(run_dir, step)
    record = RecordedStep.read(path)
    run_cfg = load_config(run_dir / "config.yaml")
    check_record(run_dir, run_cfg, record, path)
    check_what_if(run_cfg, overrides)
    start = start_checkpoint(run_dir, run_cfg, step, record)
    out = replay_dir(run_dir, step)
    keep = () if attribute else (ATTRIBUTION_FILE,)  # without --attribute: keep an earlier one
    with staged(out, keep) as tmp:
        cfg = replay_config(run_cfg, start, step, record, [])
        as_recorded = run_replay(cfg, tmp, record, attribute=attribute)
        summary = {"step": step, "start": str(start) if start else "base model (step 0)",
                   "threads": record.threads, "ranks": {"recorded": record.ranks, "replayed": dist.world()},
                   **verdict(as_recorded, record, read_row(run_dir, step))}
        dist.on_main(write_file, tmp / "replay.json", json.dumps(summary, indent=1))
    if overrides:
        out = replay_dir(run_dir, step, slug(overrides))
        with staged(out) as tmp:
            cfg = replay_config(run_cfg, start, step, record, overrides)
            what_if = run_replay(cfg, tmp, record, attribute=False)
            summary["what_if"] = {"overrides": overrides, **compare_updates(as_recorded, what_if)}
            dist.on_main(write_file, tmp / "replay.json", json.dumps(summary, indent=1))
    if dist.is_main():
        print(summary_lines(summary))
    if attribute:
        refresh_report(run_dir)
    return out


def check_record(run_dir: Path, cfg: Config, record: RecordedStep, path: Path) -> None:
    """Raise RecordError, in one line naming both runs, unless the record at `path` is one of
    `run_dir`'s: the same run id where both have one, the rollout's shape and its sampling seed."""
    ours, name = run_identity(run_dir), run_dir.name
    other = f"{path}: a record of another run"
    if record.run_id and ours and record.run_id != ours:
        raise RecordError(f"{other}: written by run {record.run_name!r} "
                          f"(run_id {record.run_id}), while {run_dir} is run {name!r} "
                          f"(run_id {ours}); replay a record in the run directory that wrote it")
    rows, groups, size = record.rows, cfg.train.env_groups, cfg.train.group_size
    if rows != groups * size:
        raise RecordError(f"{other}: it holds {rows} trajectories, while the rollout of run "
                          f"{name!r} has {groups * size} (train.env_groups {groups} x "
                          f"train.group_size {size})")
    if record.sampling_seed is not None:
        drawn = step_seed(cfg.seed, record.seed_step, stream=stages.ATTEMPT_STREAM * record.attempt)
        if record.sampling_seed != drawn:
            raise RecordError(f"{other}: its sampling seed {record.sampling_seed} is not the one "
                              f"run {name!r} (seed={cfg.seed}) draws at step {record.seed_step}, "
                              f"{drawn}")


def check_what_if(cfg: Config, overrides: list[str]) -> None:
    """Raise ConfigError, in one line naming the key, for a what-if override a replay cannot
    apply: one that adds a critic, or changes a key outside `WHAT_IFS` (the recorded rollout, the
    saved model, anything a replay does not use)."""
    changed = apply_overrides(cfg, overrides, "what-if overrides")
    if changed.algo.has_critic and not cfg.algo.has_critic:
        raise ConfigError(f"what-if algo.adv_estimator={changed.algo.adv_estimator} needs a critic "
                          "(a value model): a replay cannot add a critic the run did not train; "
                          f"{CAN_CHANGE}")
    for key, _, value in config_diff(cfg, changed):
        if not _covered(key, WHAT_IFS):
            raise ConfigError(f"what-if {key}={value}: {_why_fixed(key)}; {CAN_CHANGE}")


def _covered(key: str, keys: tuple[str, ...]) -> bool:
    """Whether `key` is one of `keys` or in a section of them (an entry ending in ".")."""
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in keys)


def _why_fixed(key: str) -> str:
    """Why a replay cannot change `key`."""
    if _covered(key, ROLLOUT_KEYS):
        return "the rollout is recorded (its replies, rewards and shape): a replay cannot change it"
    if _covered(key, ("model.", "tiny.")):
        return "a replay starts from the run's saved weights: the model is what they hold"
    return "it has no effect on one replayed update"


@contextmanager
def staged(out: Path, keep: tuple[str, ...] = ()) -> Iterator[Path]:
    """Yields a temporary sibling of `out` to write a replay into; publishes it as `out`
    (`publish`) when the block ends without an error and removes it otherwise, so `out` only ever
    holds a complete replay."""
    tmp = dist.on_main(_cleared, out)  # several ranks: rank 0 alone touches the files
    try:
        yield tmp
    except BaseException:
        if dist.is_main() and tmp.exists():
            remove(tmp)
        raise
    dist.on_main(publish, tmp, out, keep)


def _cleared(out: Path) -> Path:
    """The temporary sibling of `out`, with what a killed replay left put right."""
    tmp, old = out.with_name(f".{out.name}.partial"), out.with_name(f".{out.name}.old")
    if tmp.exists():
        remove(tmp)  # left by a killed replay
    if old.exists() and not out.exists():
        os.replace(old, out)  # a replay killed between `publish`'s renames
    return tmp


def publish(tmp: Path, out: Path, keep: tuple[str, ...] = ()) -> Path:
    """Put the finished replay `tmp` in place of `out` by renames, with the files of `keep` that
    the old `out` holds and `tmp` does not; returns `out`."""
    for name in keep:
        if (out / name).is_file() and not (tmp / name).exists():
            write_file(tmp / name, (out / name).read_bytes())
    old = out.with_name(f".{out.name}.old")
    if old.exists():
        remove(old)
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    if old.exists():
        remove(old)
    return out


def start_checkpoint(run_dir: Path, cfg: Config, step: int, record: RecordedStep) -> Path | None:
    """The checkpoint holding the state before `step` (None for step 1: the base model); rolls the run forward to
    step - 1 first where the run has no checkpoint there."""
    if step == 1:
        return None
    at = {checkpoint_step(p): p for p in checkpoints(run_dir)}
    if step - 1 in at:
        return at[step - 1]
    if record.state_before and state_before_path(run_dir, step).is_dir():
        return state_before_path(run_dir, step)  # kept beside the record
    ranks = "" if record.ranks == 1 else f"_{record.ranks}_ranks"  # rolled forward on the run's ranks
    scratch = run_dir / REPLAYS_DIR / f"{ROLL_FORWARD}{ranks}"
    done = {checkpoint_step(p): p for p in checkpoints(scratch)} if scratch.is_dir() else {}
    if step - 1 in done:
        return done[step - 1]
    if record.ranks != dist.world():
        here = "one process" if dist.world() == 1 else f"{dist.world()} ranks"
        raise ConfigError(f"{run_dir}: step {step} was trained on {record.ranks} ranks and the run keeps no state "
                          f"before it; rolling forward in {here} would draw other samples than its ranks did. Replay "
                          f"it without --attribute first (rldyn replay {run_dir} --step {step}: it rolls forward on "
                          f"{record.ranks} ranks and keeps the state), then add --attribute")
    if record.attempt > 0:
        raise ConfigError(f"{run_dir}: step {step} was trained after a health rollback and the run has no checkpoint "
                          f"at step {step - 1}; rolling forward would draw other samples than the run did. Record "
                          "the steps you want to replay with a checkpoint before them (checkpoint.every=1)")
    before = [n for n in at if n < step - 1]
    origin = at[max(before)] if before else None
    return roll_forward(cfg, origin, step - 1, scratch)


def roll_forward(cfg: Config, origin: Path | None, last: int, scratch: Path) -> Path:
    """Train the run's steps after `origin` (None: from step 0) to `last` again, into `scratch`; returns the
    checkpoint of step `last`."""
    from rldynamics.train.trainer import train

    first = checkpoint_step(origin) if origin else 0
    if dist.is_main():
        print(f"no checkpoint at step {last}: training steps {first + 1}-{last} again from "
              f"{origin or 'the base model'} into {scratch}")
    dist.on_main(lambda: scratch.exists() and remove(scratch))
    keys = [f"checkpoint.resume={origin}"] if origin else []
    keys += [f"train.steps={last}", "checkpoint.every=0", "checkpoint.save_last=true", "checkpoint.keep_last=1",
             "log.report=false", "val.before_train=false", "val.every=0"]
    train(apply_overrides(cfg, keys), scratch, job=ROLL_FORWARD)
    found = dist.on_main(lambda: {checkpoint_step(p): p for p in checkpoints(scratch)})  # once rank 0 has written it
    if last not in found:
        raise RuntimeError(f"rolling {scratch} forward stopped before step {last} (an early stop or a health stop): "
                           "the recorded step cannot be reached this way")
    return found[last]


def replay_config(cfg: Config, start: Path | None, step: int, record: RecordedStep, overrides: list[str]) -> Config:
    """The replay's config: the run's, started from `start`, with validation and the report off, the HF engine
    (nothing is sampled), the record's thread count, then the what-if `overrides`."""
    keys = ([f"checkpoint.resume={start}"] if start else []) + [f"train.steps={step}", "rollout.engine=hf"] + QUIET
    if record.threads:
        keys.append(f"model.threads={record.threads}")
    return apply_overrides(apply_overrides(cfg, keys), overrides, "what-if overrides")


def run_replay(cfg: Config, out: Path, record: RecordedStep, *, attribute: bool) -> Replayed:
    """Open a session at the start of the recorded step and run its update phase on the recorded rollout: the
    same function as a training step (`stages.update_phase`), with the passes the step's diagnostics needed
    (`training_needs`) and the optimizer steps the run refused refused again."""
    step = record.step
    with opened(cfg, out, job=REPLAY) as (s, _, _), StepConsole(step, cfg.env.name, enabled=False) as console:
        s.console = console
        before = flat_weights(s.model)
        batch = batch_of(record)
        replayed = StepRecord(step=step, seed_step=record.seed_step, rollout=batch,
                              filtered=filter_batch(batch, cfg.filter))
        replayed.add(replayed.filtered.metrics)
        attribution = (lambda: write_attribution(s, out, replayed, record)) if attribute else (lambda: None)
        phase = stages.update_phase(s, replayed, training_needs(cfg, step), guard=refusals(record),
                                    before_actor=attribution)
        metrics = replayed.metrics()
        s.log(step, metrics)
        delta = flat_weights(s.model) - before if phase.actor_updated else None
        passes = None if replayed.prepared is None else replayed.prepared.inputs.old_logprobs is not None
        return Replayed(metrics, weights_digest(s.model), delta, replayed.filtered.rows, passes)


def training_needs(cfg: Config, step: int) -> Needs:
    """What the training step's due diagnostics needed from its update at `step` (the passes it ran)."""
    return stages.needs_of([d for d in build_diagnostics(cfg, job=TRAIN) if d.due(step)], step)




def refusals(record: RecordedStep):
    """A guard refusing the optimizer steps the run's guard refused (by position), or None when it refused none."""
    refused = [s.refused for s in record.update_steps or ()]
    if not any(refused):
        return None
    calls = iter(refused)
    return lambda trace: next(calls, False)


def flat_weights(model: torch.nn.Module) -> torch.Tensor:
    """The trainable weights as one float32 vector (FSDP2 shards gathered: a collective). [P]"""
    return torch.cat([whole_tensor(p.detach()).float().reshape(-1).cpu() for p in model.parameters()
                      if p.requires_grad])


def read_row(run_dir: Path, step: int) -> dict:
    """The run's metrics row of `step` (the training row, not a validation-only one)."""
    rows = [r for r in read_metrics(run_dir) if r.get("step") == step and names.ACTOR_GRAD_NORM in r]
    return rows[-1] if rows else {}


def verdict(replayed: Replayed, record: RecordedStep, row: dict) -> dict:
    """How the replay compares with the record: the weights digest, the update's losses, the kept rows, and
    whether the update ran the same old-log-prob pass and updated the actor as the step did."""
    recorded = record.update_metrics or row
    metrics = {k: {"recorded": recorded.get(k), "replayed": replayed.metrics.get(k)} for k in COMPARED
               if k in recorded or k in replayed.metrics}
    same = all(_same(m["recorded"], m["replayed"]) for m in metrics.values())
    expected = record.weights_after if record.ranks == dist.world() else None  # other ranks sum in another order
    return {"weights_identical": None if expected is None else replayed.digest == expected,
            "weights_after": replayed.digest, "metrics_identical": same, "metrics": metrics,
            "kept_rows_identical": replayed.kept_rows == record.kept_rows.tolist(),
            "old_logprobs_pass": {"recorded": record.old_logprobs_pass, "replayed": replayed.old_logprobs_pass},
            "actor_updated": {"recorded": record.update_steps is not None, "replayed": replayed.delta is not None}}


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def compare_updates(base: Replayed, other: Replayed) -> dict:
    """The what-if's update against the recorded one: norms, their cosine, and the compared losses."""
    out = {"metrics": {k: {"as_recorded": base.metrics.get(k), "what_if": other.metrics.get(k)} for k in COMPARED}}
    if base.delta is not None and other.delta is not None:  # whole [P] vectors: float64 products in blocks
        a, b = base.delta, other.delta
        na, nb = float(dot64(a, a)) ** 0.5, float(dot64(b, b)) ** 0.5
        out.update(update_norm={"as_recorded": na, "what_if": nb},
                   update_cosine=float(dot64(a, b)) / (na * nb) if na > 0 and nb > 0 else None,
                   kept_rows={"as_recorded": len(base.kept_rows), "what_if": len(other.kept_rows)})
    return out


def write_attribution(s: Session, out: Path, replayed: StepRecord, record: RecordedStep) -> None:
    """Attribute the step's gradient (at the weights before the actor update), write `attribution.json`, say
    which replies and tokens carried it and how its norm relates to the recorded one."""
    from rldynamics.analysis.attribution import attribute
    from rldynamics.analysis.objective import policy_loss_settings

    filtered, prepared = replayed.filtered, replayed.prepared
    s.console.phase("attribution")
    result = attribute(s.model, filtered.batch, prepared.inputs, policy_loss_settings(s.cfg.algo),
                       temperature=s.cfg.train.temperature, micro_batch_size=s.cfg.train.micro_batch_size)
    data = attribution_json(result, record.step, filtered.rows)
    write_file(out / ATTRIBUTION_FILE, json.dumps(data))
    print(attribution_lines(data, replayed.rollout, record.pieces))
    if record.update_steps:
        norms = [t.grad_norm for t in record.update_steps]
        dtype = compute_dtype(s.model)
        print(norm_note(data["grad_norm"], norms, len(filtered.batch), s.cfg.train, dtype))


def norm_note(norm: float, recorded: list[float], rows: int, train: TrainConfig, dtype: str) -> str:
    """One line on how the attribution's gradient norm `norm` (the whole batch of `rows` replies, at
    the weights before the step) relates to the step's optimizer steps, whose pre-clip norms were
    `recorded`: with one step over the whole batch, whether the two agree to `dtype` rounding; with
    several, why they differ."""
    if len(recorded) == 1:
        return _one_step_note(norm, recorded[0], dtype)
    size = min(train.mini_batch_size, rows)
    minis = math.ceil(rows / size)
    first = "the whole batch" if size == rows else f"{size} of the {rows} replies"
    epochs = f"{train.ppo_epochs} epoch" + ("s" if train.ppo_epochs > 1 else "")
    batches = f"{minis} mini-batch" + ("es" if minis > 1 else "")
    return (f"  the attribution's gradient is that of the whole filtered batch ({rows} replies) at "
            f"the weights before the step; the step took {len(recorded)} optimizer steps "
            f"({epochs} x {batches} of at most {size} replies), each on its own mini-batch at the "
            f"weights the one before left, and actor/grad_norm is the mean of their pre-clip norms "
            f"(the first, {recorded[0]:.6g}, is at the same weights over {first})")


def _one_step_note(norm: float, recorded: float, dtype: str) -> str:
    """`norm_note` for a step of one optimizer step over the whole batch: the attribution's norm
    against the recorded one, and whether `dtype` rounding explains their gap."""
    gap = abs(norm - recorded) / recorded if recorded else abs(norm)
    agree = (f"agree to {gap:.1e} relative ({dtype} rounding)"
             if gap <= ROUNDING.get(dtype, ROUNDING["float32"])
             else f"differ by {gap:.1e} relative, more than {dtype} rounding explains")
    return (f"  the step took one optimizer step over the whole batch, at these weights: its "
            f"gradient is the attribution's, and the norms ({norm:.6g}; recorded {recorded:.6g}) "
            f"{agree}")


def refresh_report(run_dir: Path) -> None:
    """Write the run's report.html again (its sample browser shows the new attribution) where the
    run has one; a report that cannot be written is a warning, never an error of the replay."""
    if not (run_dir / "report.html").is_file():
        return
    from rldynamics.plots.cli import report_command

    try:
        report_command(run_dir)
    except Exception as e:  # noqa: BLE001 (the replay is published; the report is a view of it)
        print(f"warning: the report of {run_dir} could not be written again "
              f"({e.__class__.__name__}); the replay is complete: retry with "
              f"`rldyn report {run_dir}`")


def attribution_json(result, step: int, kept: list[int], tokens_per_row: int = 10) -> dict:
    """The attribution in the record's row numbering (`kept[i]` is the record row of the filtered batch's row i):
    rows and groups with their share of the squared gradient norm, cosine with the gradient and norm; each row's
    `tokens_per_row` tokens of largest |score| as [position, score]."""
    rows = [{"row": kept[i], "group": int(result.row_group[i]), "share": float(result.row_share[i]),
             "cosine": _plain(result.row_cosine[i]), "norm": float(result.row_norm[i])} for i in range(len(kept))]
    groups = [{"group": int(g), "share": float(sh), "cosine": _plain(c), "norm": float(n)}
              for g, sh, c, n in zip(result.group_ids, result.group_share, result.group_cosine, result.group_norm,
                                     strict=True)]
    tokens = {str(kept[i]): [[int(p), float(result.token_scores[i, p])] for p in result.top_tokens(i, tokens_per_row)]
              for i in range(len(kept))}
    return {"step": step, "grad_norm": float(result.grad_norm), "residual": _plain(result.residual), "rows": rows,
            "groups": groups, "tokens": tokens}


def attribution_lines(data: dict, batch: RolloutBatch, pieces: dict[int, str], replies: int = 3,
                      tokens: int = 5) -> str:
    """"These replies, these tokens": the replies of largest share with their heaviest tokens."""
    top = sorted(data["rows"], key=lambda r: -r["share"])[:replies]
    total = sum(r["share"] for r in top)
    lines = [f"attribution of step {data['step']} (gradient norm {data['grad_norm']:.4g}): the top {len(top)} of "
             f"{len(data['rows'])} replies carry {total:.0%} of the squared gradient norm"]
    for r in top:
        heavy = data["tokens"][str(r["row"])][:tokens]
        words = ", ".join(f"{pieces.get(int(batch.input_ids[r['row'], p]), '?')!r} {v:+.3f}" for p, v in heavy)
        lines.append(f"  row {r['row']} (group {r['group']}, reward {batch.scores[r['row']].item():.3g}): share "
                     f"{r['share']:.1%}, cosine {_num(r['cosine'])}; tokens {words}")
    return "\n".join(lines)


def _plain(value) -> float | None:
    value = float(value)
    return None if math.isnan(value) else value


def slug(overrides: list[str]) -> str:
    """A directory-safe name for a what-if (`train.lr=1e-6` -> `train.lr-1e-6`)."""
    text = "_".join(o.replace("=", "-") for o in overrides)
    return re.sub(r"[^A-Za-z0-9._-]+", "", text)[:80] or "what_if"


def summary_lines(summary: dict) -> str:
    """What the console says about a replay."""
    ranks = summary["ranks"]
    threads = f"{summary['threads']} threads"
    on = f"{ranks['replayed']} ranks of {threads}" if ranks["replayed"] > 1 else threads
    lines = [f"replay of step {summary['step']} from {summary['start']} ({on}):"]
    for key, m in summary["metrics"].items():
        lines.append(f"  {key}: recorded {_num(m['recorded'])}, replayed {_num(m['replayed'])}")
    same = summary["weights_identical"]
    if ranks["recorded"] != ranks["replayed"]:
        words = (f"not compared (the run trained the step on {ranks['recorded']} ranks, this replay ran on "
                 f"{ranks['replayed']}, which sums its gradient in another order)")
    else:
        words = ("bit-identical to the run's" if same else "not recorded" if same is None
                 else "DIFFERENT from the run's (another machine, thread count or library version?)")
    lines.append(f"  weights after the step: {words}")
    if "what_if" in summary:
        w = summary["what_if"]
        lines.append(f"what-if {' '.join(w['overrides'])}:")
        for key, m in w["metrics"].items():
            lines.append(f"  {key}: as recorded {_num(m['as_recorded'])}, what-if {_num(m['what_if'])}")
        if "update_norm" in w:
            lines.append(f"  update norm: as recorded {_num(w['update_norm']['as_recorded'])}, what-if "
                         f"{_num(w['update_norm']['what_if'])}; cosine between the updates {_num(w['update_cosine'])}")
    return "\n".join(lines)


def _num(value) -> str:
    return "-" if value is None else f"{value:.6g}"
