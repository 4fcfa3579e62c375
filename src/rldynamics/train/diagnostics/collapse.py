"""The template-collapse diagnostics as a diagnostic of the training step (`Collapse`; `collapse.*`,
docs/collapse.md).

- Schedule (RAGEN's): step 1, then every step divisible by `collapse.compute_freq`; on the unfiltered training
  batch, right after the rollout (`ROLLOUT`).
- Modes: first turn (one column per group; `collapse/first_turn_num_total|num_valid|valid_rate`) and
  trajectory-uniform pairs (each pair its own column); metrics under `collapse_first_turn_sample/` and
  `collapse_trajectory_sample/` (`analysis/collapse.py`), with `timing_s/collapse_first_turn_step` and
  `timing_s/collapse_multi_turn_step`. With `env.enable_think`, `collapse/valid_thinking_rate` is the share of
  turns whose reply holds a non-empty `<think>` text.
- State: the running EMA of the marginal std per mode (`collapse_metrics`' `ema_std`), saved with the checkpoint.
- Read-only: the pairs and the bootstrap draw from their own generators seeded from (seed, step), the scoring
  runs without gradients, so a run with the stage on ends bit-identical to the run without it (parameters and
  every RNG stream).
- Several ranks: the cross-scoring rows are split over the ranks (`train.sharded.row_pass`) and gathered; every
  rank computes the same metrics, rank 0 logs them.
"""

from __future__ import annotations

import copy
import re
import time
from dataclasses import dataclass

import torch

from rldynamics import metric_names as names
from rldynamics.analysis.collapse import bootstrap_intervals, collapse_metrics
from rldynamics.analysis.cross_scoring import (
    Pairs,
    cross_loglik,
    first_turn_pairs,
    reply_lengths,
    trajectory_pairs,
    turn_spans,
)
from rldynamics.config import Config
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.train.batch_ops import step_seed
from rldynamics.train.diagnostics.base import ROLLOUT, Diagnostic, DiagnosticResult, StepRecord
from rldynamics.train.session import Session
from rldynamics.train.sharded import row_pass

SAMPLE_STREAM = 5  # step_seed stream of the pair sampling and the bootstrap
THINK = re.compile(r"^(.*?)</think>", re.DOTALL)


def collapse_due(cfg: Config, step: int) -> bool:
    """RAGEN's schedule: never at step 0, always at step 1, then when step % compute_freq == 0."""
    return cfg.collapse.enabled and step >= 1 and (step == 1 or step % cfg.collapse.compute_freq == 0)


@dataclass
class CollapseResult(DiagnosticResult):
    """The collapse metrics, and the first-turn MI estimate the health monitor's template-collapse rule reads."""

    mi: float | None = None  # RAGEN's `mi_estimate` of the first-turn pairs (None: not measured this step)


class Collapse(Diagnostic):
    """RAGEN's template-collapse diagnostics: cross-scored replies give the conditional entropy, the mutual
    information between prompt and reply and their retrieval accuracy; state: the EMA of the marginal std."""

    name, point, phase = "collapse", ROLLOUT, "collapse"

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.ema: dict[str, dict] = {}  # mode prefix -> `collapse_metrics`' running EMA of the marginal std

    @staticmethod
    def enabled(cfg: Config) -> bool:
        return cfg.collapse.enabled

    def due(self, step: int) -> bool:
        return collapse_due(self.cfg, step)

    def run(self, s: Session, record: StepRecord) -> CollapseResult:
        metrics, mi = run_collapse(s, record.step, record.rollout, self.ema)
        return CollapseResult(metrics, mi=mi)

    def state_dict(self) -> dict:
        return {"ema": self.ema}

    def load_state_dict(self, state: dict) -> None:
        self.ema = copy.deepcopy(state.get("ema", {}))


def run_collapse(s: Session, step: int, batch: RolloutBatch,
                 ema: dict[str, dict]) -> tuple[dict[str, float], float | None]:
    """The collapse metrics of `batch` (the step's unfiltered rollout) under the current actor, and the first-turn
    MI estimate (None when there were no first-turn pairs).

    `s` is the training session (`train.setup.Session`): its model, tokenizer and config; `ema` the running EMA of
    the marginal std per mode, updated here."""
    cfg = s.cfg.collapse
    generator = torch.Generator().manual_seed(step_seed(s.cfg.seed, step, stream=SAMPLE_STREAM))
    out: dict[str, float] = {}
    mi = None
    if cfg.first_turn_enabled:
        start = time.perf_counter()
        pairs, valid = first_turn_pairs(batch.input_ids, batch.response_mask, batch.group_ids, cfg.num_samples,
                                        generator)
        total = len(batch)
        out.update({f"{names.COLLAPSE}/first_turn_num_total": float(total),
                    f"{names.COLLAPSE}/first_turn_num_valid": float(valid),
                    f"{names.COLLAPSE}/first_turn_valid_rate": valid / total if total else 0.0})
        if pairs is not None:
            found, mi = _diagnose(s, pairs, names.COLLAPSE_FIRST_TURN, generator, ema)
            out.update(found)
        out[names.timing("collapse_first_turn_step")] = time.perf_counter() - start
    if cfg.multi_turn_enabled:
        start = time.perf_counter()
        pairs = trajectory_pairs(batch.input_ids, batch.response_mask, cfg.num_samples, generator)
        if pairs is not None:
            out.update(_diagnose(s, pairs, names.COLLAPSE_TRAJECTORY, generator, ema)[0])
        out[names.timing("collapse_multi_turn_step")] = time.perf_counter() - start
    if s.cfg.env.enable_think:
        out[f"{names.COLLAPSE}/valid_thinking_rate"] = valid_thinking_rate(batch, s.tokenizer)
    return out, mi


def _diagnose(s: Session, pairs: Pairs, prefix: str, generator: torch.Generator,
              ema: dict) -> tuple[dict[str, float], float]:
    """Cross-score `pairs`; their metrics (and bootstrap intervals) under `prefix/`, and their MI estimate."""
    cfg = s.cfg.collapse

    def split(ids, attn, positions, compute):
        rows = RolloutBatch(ids, attn, positions, scores=torch.zeros(len(ids)),
                            group_ids=torch.zeros(len(ids), dtype=torch.long))
        return row_pass((s.model,), rows, lambda r: (compute(r),))[0]  # [U·N, W]

    loglik = cross_loglik(s.model, pairs, pad_id=s.tokenizer.pad_token_id, micro_batch_size=cfg.micro_batch_size,
                          temperature=s.cfg.train.temperature, shared_prefix=s.cfg.train.shared_prefix,
                          row_pass=split)  # [N, C]
    lengths = reply_lengths(pairs)  # [N]
    metrics = collapse_metrics(loglik, lengths, pairs.column, pairs.classes, std_eps=cfg.std_eps,
                               ema_std=ema.setdefault(prefix, {}), ema_decay=cfg.ema_decay)
    metrics["num_samples"] = float(len(pairs.replies))
    metrics["num_prompts"] = float(int(pairs.classes.max()) + 1)
    if cfg.bootstrap_resamples >= 2:
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        metrics.update(bootstrap_intervals(loglik, lengths, pairs.column, pairs.classes,
                                           resamples=cfg.bootstrap_resamples, seed=seed))
    return {f"{prefix}/{k}": v for k, v in metrics.items()}, metrics["mi_estimate"]


def valid_thinking_rate(batch: RolloutBatch, tokenizer) -> float:
    """Share of the batch's turns (replies) whose text before `</think>` is non-empty (the prompt opened `<think>`)."""
    turns = valid = 0
    for r in range(len(batch)):
        for start, end in turn_spans(batch.response_mask[r]):
            turns += 1
            found = THINK.match(tokenizer.decode(batch.input_ids[r, start:end], skip_special_tokens=True))
            valid += bool(found and found.group(1).strip())
    return valid / turns if turns else 0.0
