"""The actor update: PPO epochs over mini-batches of the batch (`train.update.optimize`).

The loss of a micro-batch is `analysis.objective.actor_terms` (one forward, the unweighted terms `pg`, `entropy`,
`kl`) weighted by `algo.losses.weighted_total`: the loss the gradient probe differentiates is the loss trained. The
loss settings (`algo.losses.PolicyLossSettings`) are read from the config once per update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rldynamics import metric_names as names
from rldynamics.algo.losses import weighted_total
from rldynamics.analysis.objective import ActorInputs, actor_terms, policy_loss_settings
from rldynamics.config import AlgoConfig, TrainConfig
from rldynamics.models.forward import micro_batches
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.train.update import optimize

STATS = ("pg_loss", "entropy_loss", "kl_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")
TOKEN_STATS = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")  # token-level means


def single_pass(train: TrainConfig, batch_size: int) -> bool:
    """Whether the update of a `batch_size` batch is one optimizer step on the rollout policy itself.

    One epoch over one mini-batch: every micro-batch's forward sees the parameters that sampled the batch,
    so the old log-probs are the update's own log-probs, detached.
    """
    return train.ppo_epochs == 1 and train.mini_batch_size >= batch_size


@dataclass
class ActorUpdate:
    """What one actor update returns."""

    entropy: float  # mean over mini-batches of the aggregated entropy during the update (`actor/entropy_loss`)
    metrics: dict[str, float]  # `actor/*`
    logprobs: torch.Tensor | None = None  # [N, L] the update's own log-probs of the sampled tokens (`record`), read
    # by the mismatch metrics in place of an old-log-prob pass; in a single-pass update they are the rollout policy's


def update_actor(model, optimizer, batch: RolloutBatch, inputs: ActorInputs, algo: AlgoConfig, train: TrainConfig,
                 generator: torch.Generator | None = None, record: bool = False) -> ActorUpdate:
    """PPO epochs over mini-batches with gradient accumulation over micro-batches; returns the update's entropy
    and its metrics (and with `record`, the log-probs its forwards computed: one process, one pass).

    verl's names: `actor/entropy_loss` is the mean over mini-batches of the aggregated entropy during the update
    (`actor/entropy`, the rollout policy's entropy, is logged by the old-log-prob pass), `actor/kl_coef` the
    KL coefficient in use.
    """
    settings = policy_loss_settings(algo)
    weights = settings.coefs
    own = torch.zeros(batch.response_mask.shape) if record else None  # [N, L]

    def loss_of(rows: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        terms, metrics = actor_terms(model, batch, rows, inputs, settings, temperature=train.temperature,
                                     shared_prefix=train.shared_prefix, record=own)
        values = {"pg_loss": terms["pg"].item(), "entropy_loss": terms["entropy"].item(),
                  **({"kl_loss": terms["kl"].item()} if "kl" in terms else {}),
                  **{k: metrics[k] for k in TOKEN_STATS}}
        return weighted_total(terms, weights), values

    minis = []
    for _ in range(train.ppo_epochs):
        order = torch.randperm(len(batch), generator=generator) if train.shuffle else torch.arange(len(batch))
        minis += micro_batches(order, train.mini_batch_size)
    stats = optimize(model, optimizer, batch, minis, loss_of, stats=STATS, token_stats=TOKEN_STATS,
                     micro_batch_size=train.micro_batch_size,
                     max_grad_norm=train.max_grad_norm, agg_mode=settings.agg,
                     shared_prefix=train.shared_prefix)
    out = {names.actor(k): v for k, v in stats.items()}
    out[names.ACTOR_LR] = optimizer.param_groups[0]["lr"]
    out[names.KL_COEF] = settings.kl_coef
    return ActorUpdate(entropy=stats["entropy_loss"], metrics=out, logprobs=own)
