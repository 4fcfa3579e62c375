"""Critic update for GAE: clipped value loss over the same mini/micro-batch split as the actor (`train.update`)."""

from __future__ import annotations

import torch

from rldynamics import metric_names as names
from rldynamics.algo.losses import value_loss
from rldynamics.config import AlgoConfig, CriticConfig, TrainConfig
from rldynamics.models.forward import micro_batches, token_values
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.train.update import optimize

STATS = ("vf_loss", "vf_clipfrac", "vpred_mean")
TOKEN_STATS = ("vf_clipfrac", "vpred_mean")  # token-level means


def update_critic(critic, optimizer, batch: RolloutBatch, old_values: torch.Tensor, returns: torch.Tensor,
                  algo: AlgoConfig, critic_cfg: CriticConfig, train: TrainConfig) -> dict[str, float]:
    """`critic.ppo_epochs` (default `train.ppo_epochs`) epochs of value regression; returns `critic/*` metrics.

    A step whose gradient norm is not finite is skipped and counted in `critic/skipped_steps`.

    Args:
        old_values: [N, L] values from before the update (for clipping).
        returns: [N, L] GAE returns (targets).
    """
    device = next(critic.parameters()).device

    def loss_of(rows: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        values = token_values(critic, batch.input_ids[rows].to(device), batch.attention_mask[rows].to(device),
                              pack=train.shared_prefix)  # [n, L]
        loss, metrics = value_loss(values, old_values[rows].to(device), returns[rows].to(device),
                                   batch.response_mask[rows].to(device), clip_range=critic_cfg.clip_range,
                                   agg=algo.loss_agg_mode)
        return loss, {"vf_loss": loss.item(), **metrics}

    epochs = critic_cfg.ppo_epochs if critic_cfg.ppo_epochs is not None else train.ppo_epochs
    minis = [mini for _ in range(epochs) for mini in micro_batches(torch.arange(len(batch)), train.mini_batch_size)]
    stats, _ = optimize(critic, optimizer, batch, minis, loss_of, stats=STATS, token_stats=TOKEN_STATS,
                        micro_batch_size=train.micro_batch_size,
                        max_grad_norm=critic_cfg.max_grad_norm, agg_mode=algo.loss_agg_mode, sort_by_length=False)
    return {names.critic(k): v for k, v in stats.items() if k != "num_updates"}
