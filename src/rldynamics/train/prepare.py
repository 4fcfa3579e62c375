"""The stage between the filter and the updates: old / reference log-probs, critic values, advantages, returns.

`prepare_update` is the one place these are computed, for the training step and for a separate analysis batch
(`train/diagnostics/gradient_analysis.py`) alike, so an analysed batch is prepared exactly as a trained one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rldynamics import metric_names as names
from rldynamics.algo.filter import loss_scale
from rldynamics.algo.losses import aggregate, masked_mean
from rldynamics.analysis.objective import ActorInputs
from rldynamics.config import Config
from rldynamics.models.forward import batch_logprobs, batch_values
from rldynamics.models.lora import as_reference
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.train.batch_ops import advantages_and_returns, timed
from rldynamics.train.sharded import row_pass

if TYPE_CHECKING:  # the session is built in train/setup.py, which builds the diagnostics that prepare batches
    from rldynamics.train.setup import Session


@dataclass
class Prepared:
    """The inputs of the updates (and of the gradient analysis) of one batch."""

    inputs: ActorInputs  # old / reference log-probs and the (loss-scaled) advantages, [N, L] each
    values: torch.Tensor | None  # critic values [N, L] (None without a critic)
    returns: torch.Tensor | None  # GAE returns [N, L] (None for the other estimators)
    entropy: float | None  # the rollout policy's aggregated entropy (None when the old-log-prob pass was skipped)
    token_entropy: torch.Tensor | None = None  # [N, L] its entropy at each sampled token (None likewise)
    later_old: tuple[torch.Tensor, torch.Tensor] | None = None  # [N, L] each: old log-probs and entropies of only the
    # rows after the update's first optimizer step (0 elsewhere), when the update takes the first step's own
    metrics: dict[str, float] = field(default_factory=dict)  # timings, `actor/entropy`, `rollout/ref_log_prob`


def prepare_update(s: Session, batch: RolloutBatch, kept_ratio: float, *, old_pass: bool = True,
                   ref_pass: bool = True, later_rows: torch.Tensor | None = None) -> Prepared:
    """Old / reference log-probs, critic values, advantages (scaled by the filter's `kept_ratio`) and returns.

    `old_pass=False` skips the old-log-prob forward over the whole batch: the update takes its first optimizer
    step's own detached log-probs as the old ones of that step's rows (`ActorInputs.old_logprobs` None), and
    `actor/entropy` comes from it. `later_rows` [K]: the rows after that first step, whose old log-probs and
    entropies a pass over them alone gives the update (`Prepared.later_old`), also when the whole pass runs too.
    `ref_pass=False` skips the reference forward where nothing reads it (KL off and no analysis this step).
    """
    cfg, m = s.cfg, {}
    micro = cfg.train.micro_batch_size
    inputs = ActorInputs(old_logprobs=None, advantages=torch.zeros_like(batch.response_mask))
    entropy = token_entropy = None
    if old_pass:
        with timed(m, "old_log_prob"):
            inputs.old_logprobs, token_entropy = logprob_pass(cfg, s.model, batch, with_entropy=True)  # [N, L] each
        entropy = aggregate(token_entropy, batch.response_mask, cfg.algo.loss_agg_mode).item()
        m[names.ENTROPY] = entropy
    later_old = None
    if later_rows is not None:
        with timed(m, "old_log_prob"):
            later_old = rows_logprob_pass(cfg, s.model, batch, later_rows)  # [N, L] each
    if s.ref_model is not None and ref_pass:
        with timed(m, "ref"), as_reference(s.ref_model):  # with LoRA: the actor with its adapters off
            inputs.ref_logprobs, = logprob_pass(cfg, s.ref_model, batch, with_entropy=False)  # [N, L]
        m[names.REF_LOG_PROB] = masked_mean(inputs.ref_logprobs, batch.response_mask).item()
    values = None
    if s.critic is not None:
        with timed(m, "values"):
            values, = row_pass((s.critic,), batch, lambda rows: (batch_values(
                s.critic, batch.input_ids[rows], batch.attention_mask[rows], micro_batch_size=micro,
                pack=cfg.train.shared_prefix),))  # [N, L]
    with timed(m, "adv"):
        advantages, returns = advantages_and_returns(batch, values, cfg.algo)  # [N, L]
        inputs.advantages = advantages * loss_scale(kept_ratio, cfg.filter.loss_scaling)  # [N, L]
    return Prepared(inputs=inputs, values=values, returns=returns, entropy=entropy, token_entropy=token_entropy,
                    later_old=later_old, metrics=m)


def rows_logprob_pass(cfg: Config, model, batch: RolloutBatch, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`logprob_pass` with entropies over the `rows` [K] of `batch` alone; 0 at the other rows. ([N, L], [N, L])"""
    logprobs, entropy = torch.zeros(batch.response_mask.shape), torch.zeros(batch.response_mask.shape)  # [N, L]
    if len(rows):
        logprobs[rows], entropy[rows] = logprob_pass(cfg, model, batch.select(rows), with_entropy=True)  # [K, L]
    return logprobs, entropy


def logprob_pass(cfg: Config, model, batch: RolloutBatch, *, with_entropy: bool) -> tuple[torch.Tensor, ...]:
    """The log-probs (and entropies) of `batch`'s response tokens under `model`, without gradients, the rows split
    over the ranks (`row_pass`). ([N, L], and [N, L] with `with_entropy`)"""

    def compute(rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logprobs, entropy = batch_logprobs(
            model, batch.input_ids[rows], batch.attention_mask[rows], micro_batch_size=cfg.train.micro_batch_size,
            temperature=cfg.train.temperature, with_entropy=with_entropy, positions=batch.response_mask[rows],
            shared_prefix=cfg.train.shared_prefix)  # [n, L], [n, L] | None
        return (logprobs, entropy) if with_entropy else (logprobs,)

    return row_pass((model,), batch, compute)
