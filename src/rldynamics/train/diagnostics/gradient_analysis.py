"""The gradient analysis as a diagnostic of the training step (`GradientAnalysis`): which batch, which passes,
what is written.

- Cadence: analysis runs at steps 1, 1+every, 1+2*every, ... after the critic update and before the actor
  update (`BEFORE_UPDATE`), on the filtered training batch, or, when `analysis.env_groups` /
  `analysis.group_size` are set,
  on a separate batch drawn with its own env seeds (seed_base + 500000 + groups*(k-1) + g at step k; a probe
  draws those of step 1 whatever the checkpoint's step, so every probe draws the same puzzles) and sampling seed
  (inside a forked RNG, so training is unaffected) and filtered with the same filter settings.
- `analysis.prefilter` also analyses that separate batch before filtering (prefix `grad_norm_prefilter`).
- `analysis.reward_grad` also differentiates the task loss with each named reward component's own advantages
  (`train.batch_ops.component_advantages`, scaled like the trained advantages by the filter's loss scaling) and
  logs `reward_grad/<bucket>/*` (analysis/reward_grad.py).
- The gradients are over the trained parameters: every weight, or with LoRA the adapters' alone; their count is
  `grad_analysis/parameters`.
- Per analysis step, `analysis/step_<N>/` gets `groups.csv` (prefix, bucket, group_id, reward_std, the
  group's env seed and, with `analysis.per_group`, the group's own gradient norms `GROUP_NORM_COLUMNS`),
  `sketches.safetensors` (count-sketches of every bucket/component gradient, for offline cosines across buckets
  and steps), `metrics.json` (the step's analysis metrics) and, with reward components,
  `reward_grad.json` (per bucket: the component cosine matrix, cosines with the total, norms and per-layer-group
  cosine profiles).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save

from rldynamics import metric_names as names
from rldynamics.algo.filter import loss_scale
from rldynamics.algo.rollout_corr import mismatch_metrics
from rldynamics.analysis.objective import ActorInputs
from rldynamics.analysis.probe import ProbeResult, ProbeSettings, gradient_probe
from rldynamics.config import Config, ConfigError, separate_analysis_batch
from rldynamics.dist import too_few_groups
from rldynamics.models.lora import trainable
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.tracking.files import replacing, write_file
from rldynamics.tracking.grad_dump import GradientDumper
from rldynamics.train.batch_ops import Filtered, component_advantages, env_seeds, filter_batch, step_seed, train_seeds
from rldynamics.train.checkpoint import crash_point
from rldynamics.train.diagnostics.base import BEFORE_UPDATE, PROBE, Diagnostic, DiagnosticResult, Needs, StepRecord
from rldynamics.train.prepare import Prepared, prepare_update
from rldynamics.train.session import Session
from rldynamics.train.sharded import rollout_groups

EXITED = "exited_after_gradient_analysis"  # the stop reason of `analysis.exit_after`

ANALYSIS_SEED_OFFSET = 500_000  # separate analysis batches use their own env seeds
GROUP_NORM_COLUMNS = ("share", "rows", "tokens", "task", "entropy", "kl", "raw/entropy", "raw/kl", "regularizer",
                      "reg_share")  # groups.csv columns of `analysis.per_group` (empty without it)


def _norm_columns(norms: dict[str, float] | None) -> list:
    """A group's `GROUP_NORM_COLUMNS` values (blank when the group was not analysed alone or lacks the term)."""
    return [norms.get(k, "") if norms else "" for k in GROUP_NORM_COLUMNS]


def analysis_due(cfg: Config, step: int) -> bool:
    """True at the steps the analysis runs (1, 1+every, ...)."""
    return cfg.analysis.enabled and (step - 1) % cfg.analysis.every == 0


class GradientAnalysis(Diagnostic):
    """RAGEN's gradient analysis (`analysis.*`): per reward-variance bucket, the task / entropy / KL gradient norms
    of the step's batch under the rollout policy, without an optimizer step. Needs the old-log-prob and reference
    passes on its steps (and the reference model even with the KL term off); its state is none (gradient dumps are
    written in the background and flushed by `close`). A probe is this analysis on a checkpoint: it turns it on,
    at every step, ending the job after it."""

    name, point, phase = "gradient_analysis", BEFORE_UPDATE, "analysis"
    job_settings = {PROBE: ("analysis.enabled=true", "analysis.every=1", "analysis.exit_after=true")}
    needs_reference = True  # the KL gradient is measured even at algo.kl_coef 0

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.dumper: GradientDumper | None = None  # analysis.dump_gradients: started by the first dump

    @staticmethod
    def enabled(cfg: Config) -> bool:
        return cfg.analysis.enabled

    @staticmethod
    def check_world(cfg: Config, ranks: int) -> None:
        a = cfg.analysis
        if a.dump_gradients:
            raise ConfigError(f"analysis.dump_gradients=true writes whole gradients, which {ranks} ranks never "
                              "gather; set analysis.dump_gradients=false or run without torchrun")
        if a.memory_chunks > 1:
            raise ConfigError(f"analysis.memory_chunks={a.memory_chunks} streams whole gradients in one process; on "
                              f"{ranks} ranks each holds 1/{ranks} of every probe gradient already: set "
                              "analysis.memory_chunks=1 (with model.shard=true) or run without torchrun")
        if a.env_groups is not None and a.env_groups < ranks:
            raise ConfigError(too_few_groups("analysis.env_groups", a.env_groups, ranks))

    def due(self, step: int) -> bool:
        return analysis_due(self.cfg, step)

    def needs(self, step: int) -> Needs:
        return Needs(old_logprobs=True, ref_logprobs=True)

    def run(self, s: Session, record: StepRecord) -> DiagnosticResult:
        metrics = run_analysis(s, record.step, record.filtered, record.prepared, record.seed_step, self.submit)
        crash_point("analysis", record.step)
        if not self.cfg.analysis.exit_after:
            return DiagnosticResult(metrics)
        return DiagnosticResult({**metrics, names.EXITED_AFTER_ANALYSIS: 1.0}, stop=EXITED, exit_line=(
            f"[yellow]exited after the gradient analysis of step {record.step} (analysis.exit_after=true)"))

    def submit(self, file: Path, arrays: dict[str, np.ndarray]) -> None:
        """Queue a gradient dump (written in the background)."""
        if self.dumper is None:
            self.dumper = GradientDumper(self.cfg.analysis.dump_max_pending)
        self.dumper.submit(file, arrays)

    def close(self) -> None:
        if self.dumper is not None:
            self.dumper.close()  # every queued gradient dump is on disk (or its error raised) before the run ends


def run_analysis(s: Session, step: int, filtered: Filtered | None, prepared: Prepared | None, seed_step: int,
                 submit: Callable[[Path, dict], None]) -> dict[str, float]:
    """Analyse the filtered training batch, prepared for its update (or a separate batch drawn with the seeds of step
    `seed_step` and prepared here by the same stages), and write the artefacts of `step` (gradient dumps through
    `submit`); returns the metrics."""
    cfg = s.cfg
    metrics: dict[str, float] = {_own("uses_training_batch"): float(not separate_analysis_batch(cfg)),
                                 _own("parameters"): float(sum(p.numel() for p in trainable(s.model)))}
    passes: list[tuple[str, RolloutBatch, ActorInputs, dict[int, float], float]] = []
    if separate_analysis_batch(cfg):
        passes, drawn = _separate_batch_passes(s, seed_step)
        metrics.update(drawn)
    elif filtered is not None and len(filtered.batch) > 0:
        passes = [(names.GRAD_NORM, filtered.batch, prepared.inputs, filtered.group_std, filtered.kept_ratio)]
    rows, sketches, reward_grad, dump = [], {}, {}, {}
    for prefix, b, inp, stds, kept in passes:
        result = probe(s, b, inp, stds, prefix, kept)
        metrics.update(result.metrics)
        metrics.update(bucket_mismatch(cfg, b, inp, result.groups, prefix))
        dump.update(per_parameter(s.model, result.gradients, prefix))
        seeds = dict(zip(b.group_ids.tolist(), b.seeds, strict=False))  # group id -> env seed
        rows += [(prefix, bucket, gid, std, seeds.get(gid, ""), *_norm_columns(result.group_norms.get(gid)))
                 for bucket, gid, std in result.groups]
        sketches.update({f"{prefix}/{k}": v.contiguous() for k, v in result.sketches.items()})
        if result.reward_grad:
            reward_grad[prefix] = result.reward_grad
    if not s.main:  # every rank took part in the probe; rank 0 writes
        return metrics
    out_dir = s.writer.analysis_dir(step)
    write_artefacts(out_dir, metrics, rows, sketches, reward_grad)
    if dump:
        submit(out_dir / "gradients.npz", dump)
    return metrics


def bucket_mismatch(cfg: Config, batch: RolloutBatch, inputs: ActorInputs, groups: list[tuple[str, int, float]],
                    prefix: str) -> dict[str, float]:
    """The sampler/trainer mismatch (`rollout/corr/*`) of each bucket's trajectories, keyed
    `<prefix>/<bucket>/rollout/corr/<name>`: whether the buckets the analysis compares were sampled equally far
    off-policy. {} without the trainer's old log-probs or the sampler's."""
    if inputs.old_logprobs is None or batch.rollout_logprobs is None:
        return {}
    out = {}
    for bucket in dict.fromkeys(name for name, _, _ in groups):  # in the probe's order
        ids = torch.tensor([gid for name, gid, _ in groups if name == bucket])  # [G_b]
        rows = torch.isin(batch.group_ids, ids)  # [N]
        found = mismatch_metrics(inputs.old_logprobs[rows], batch.rollout_logprobs[rows], batch.response_mask[rows],
                                 band=cfg.algo.mismatch_band, tis_cap=cfg.algo.tis_cap, mis=cfg.algo.mis)
        out.update({names.bucket_metric(prefix, bucket, key): value for key, value in found.items()})
    return out


def per_parameter(model, gradients: dict[str, torch.Tensor], prefix: str) -> dict[str, np.ndarray]:
    """Split the probe's flat gradients (`"<bucket>/<term>"` -> [P]) into `"<prefix>/<bucket>/<term>/<param>"`
    arrays of each trainable parameter's shape (the probe's flat layout is `model.parameters()` order)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    out = {}
    for key, flat in gradients.items():
        parts = flat.split([p.numel() for _, p in named])
        out.update({f"{prefix}/{key}/{n}": part.view(p.shape).numpy()
                    for (n, p), part in zip(named, parts, strict=True)})
    return out


def probe(s: Session, batch: RolloutBatch, inputs: ActorInputs, group_std: dict[int, float], prefix: str,
          kept_ratio: float) -> ProbeResult:
    """One gradient probe with the run's settings (and the reward components, when `analysis.reward_grad`)."""
    cfg = s.cfg
    components = weights = None
    if cfg.analysis.reward_grad and batch.reward_names:
        scale = loss_scale(kept_ratio, cfg.filter.loss_scaling)
        components = {k: a * scale for k, a in component_advantages(batch, cfg.algo).items()}  # name -> [N, L]
        weights = dict(zip(batch.reward_names, batch.reward_weights, strict=True))
    return gradient_probe(s.model, batch, inputs, group_std, probe_settings(cfg, prefix), components, weights)


def probe_settings(cfg: Config, prefix: str) -> ProbeSettings:
    """The probe's settings of a run, for the pass named `prefix`."""
    a = cfg.analysis
    return ProbeSettings(algo=cfg.algo, micro_batch_size=cfg.train.micro_batch_size, temperature=cfg.train.temperature,
                         num_buckets=a.num_buckets, bucket_mode=a.bucket_mode, prefix=prefix, sketch_seed=cfg.seed,
                         keep_gradients=a.dump_gradients, terms=tuple(a.terms), zero_bucket=a.zero_bucket,
                         per_group=a.per_group, resamples=a.bootstrap_resamples, shared_prefix=cfg.train.shared_prefix,
                         memory_chunks=a.memory_chunks)


def _separate_batch_passes(s: Session, k: int) -> tuple[list, dict[str, float]]:
    """Roll out, filter and prepare the separate analysis batch (and its unfiltered copy if asked); returns the
    passes and the batch's metrics."""
    cfg = s.cfg
    groups = cfg.analysis.env_groups or cfg.train.env_groups
    size = cfg.analysis.group_size or cfg.train.group_size
    with torch.random.fork_rng(devices=[]):
        raw = rollout_groups(cfg, s.model, s.tokenizer,
                             env_seeds(cfg, train_seeds(cfg.train.seed_base + ANALYSIS_SEED_OFFSET, groups, k)), size,
                             cfg.train.temperature, step_seed(cfg.seed, k, stream=3), engine=s.engine)
    filtered = filter_batch(raw, cfg.filter, prefix=names.GRAD_ANALYSIS)
    metrics = {_own("source_env_groups"): float(groups), _own("source_group_size"): float(size),
               _own("source_batch_size"): float(len(raw)), **filtered.metrics,
               _own("empty_after_filter"): float(len(filtered.batch) == 0)}
    passes = []
    if cfg.analysis.prefilter:
        passes.append((names.GRAD_NORM_PREFILTER, raw, prepare_update(s, raw, 1.0).inputs, filtered.group_std, 1.0))
    if len(filtered.batch) > 0:
        inputs = prepare_update(s, filtered.batch, filtered.kept_ratio).inputs
        passes.append((names.GRAD_NORM, filtered.batch, inputs, filtered.group_std, filtered.kept_ratio))
    return passes, metrics


def _own(metric: str) -> str:
    """A metric of the analysis's own bookkeeping: `grad_analysis/<metric>`."""
    return names.filter_metric(names.GRAD_ANALYSIS, metric)


def write_artefacts(out_dir: Path, metrics: dict[str, float], groups: list[tuple], sketches: dict,
                    reward_grad: dict | None = None) -> None:
    """`groups.csv`, `sketches.safetensors`, `metrics.json` (and `reward_grad.json`) of one analysis step (each
    written atomically, never through a link: `tracking.files`)."""
    with replacing(out_dir / "groups.csv", "w") as f:
        writer = csv.writer(f)
        writer.writerow(["prefix", "bucket", "group_id", "reward_std", "seed", *GROUP_NORM_COLUMNS])
        writer.writerows(groups)
    if sketches:
        write_file(out_dir / "sketches.safetensors", save(sketches))
    write_file(out_dir / "metrics.json", json.dumps(metrics, indent=2, sort_keys=True))
    if reward_grad:
        write_file(out_dir / "reward_grad.json", json.dumps(reward_grad, indent=1, allow_nan=False))
