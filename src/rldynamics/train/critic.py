"""Critic update for GAE: clipped value loss over the same mini/micro-batch split as the actor."""

from __future__ import annotations

import math

import torch

from rldynamics.algo.losses import value_loss
from rldynamics.config import AlgoConfig, CriticConfig, TrainConfig
from rldynamics.models.forward import micro_batches, token_values
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.train.actor import sub_batch_share


def update_critic(critic, optimizer, batch: RolloutBatch, old_values: torch.Tensor, returns: torch.Tensor,
                  algo: AlgoConfig, critic_cfg: CriticConfig, train: TrainConfig) -> dict[str, float]:
    """`critic.ppo_epochs` (default `train.ppo_epochs`) epochs of value regression; returns `critic/*` metrics.

    Args:
        old_values: [N, L] values from before the update (for clipping).
        returns: [N, L] GAE returns (targets).
    """
    device = next(critic.parameters()).device
    params = [p for p in critic.parameters() if p.requires_grad]
    sums = {"vf_loss": 0.0, "vf_clipfrac": 0.0, "vpred_mean": 0.0, "grad_norm": 0.0}
    count = 0
    epochs = critic_cfg.ppo_epochs if critic_cfg.ppo_epochs is not None else train.ppo_epochs
    for _ in range(epochs):
        for mini in micro_batches(torch.arange(len(batch)), train.mini_batch_size):
            optimizer.zero_grad(set_to_none=True)
            for positions in micro_batches(torch.arange(len(mini)), train.micro_batch_size):
                rows = mini[positions]  # [n]
                share = sub_batch_share(batch.response_mask[mini], positions, algo.loss_agg_mode)
                if share == 0.0:
                    continue
                values = token_values(critic, batch.input_ids[rows].to(device),
                                      batch.attention_mask[rows].to(device))  # [n, L]
                loss, metrics = value_loss(values, old_values[rows].to(device), returns[rows].to(device),
                                           batch.response_mask[rows].to(device), clip_range=critic_cfg.clip_range,
                                           agg=algo.loss_agg_mode)
                (share * loss).backward()
                sums["vf_loss"] += share * loss.item()
                sums["vf_clipfrac"] += share * metrics["vf_clipfrac"]
                sums["vpred_mean"] += share * metrics["vpred_mean"]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, critic_cfg.max_grad_norm).item()
            sums["grad_norm"] += grad_norm
            if math.isfinite(grad_norm):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            count += 1
    return {f"critic/{k}": v / max(count, 1) for k, v in sums.items()}
