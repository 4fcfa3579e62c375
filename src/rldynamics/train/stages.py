"""The stages of a training step that sit between rollout and update, each a function of plain inputs.

- `train_seeds` / `val_seeds`: which env seeds a rollout uses (RAGEN's seeding: step s uses
  seed_base + env_groups*(s-1) + g; validation always the same puzzles); `seed_step`: which step's seeds
  a step uses (its own, except in probe mode).
- `filter_batch`: score groups, keep whole groups (rldynamics.algo.filter), return the kept batch.
- `advantages_and_returns`: dispatch to the estimator of `algo.adv_estimator`.
- `data_metrics`: verl-style `critic/score/*`, `critic/advantages/*`, `response_length/*` summaries, and with a
  critic `critic/vf_explained_var` with its two terms (`critic/returns/var`, `critic/vf_residual_var`).
"""

from __future__ import annotations

import torch

from rldynamics.algo.advantages import gae_advantages, grpo_advantages, reinforce_pp_advantages, rloo_advantages
from rldynamics.algo.filter import filter_metrics, group_scores, group_stats, select_groups
from rldynamics.algo.losses import masked_mean
from rldynamics.config import AlgoConfig, FilterConfig
from rldynamics.rollout.batch import RolloutBatch


def train_seeds(seed_base: int, env_groups: int, step: int) -> list[int]:
    """Env seeds of the groups of training step `step` (1-based)."""
    return [seed_base + env_groups * (step - 1) + g for g in range(env_groups)]


def seed_step(step: int, first_step: int, probe: bool) -> int:
    """The step whose env seeds and sampling seed step `step` uses.

    Training: its own, so a resumed run replays exactly the steps an uninterrupted one takes. Probe mode
    (`analysis.only`): the k-th step of the run uses those of step k, whatever step it is logged at, so probes
    of different checkpoints analyse the same puzzles with the same sampling seeds (RAGEN's probe restarts its
    seed counter at the base seed in the same way).
    """
    return step - first_step + 1 if probe else step


def val_seeds(seed_base: int, env_groups: int) -> list[int]:
    """The fixed validation puzzles."""
    return [seed_base + g for g in range(env_groups)]


def step_seed(seed: int, step: int, stream: int = 0) -> int:
    """A distinct, reproducible sampling seed per (run seed, step, stream)."""
    return (seed * 1_000_003 + step * 7919 + stream * 104_729) % (2**63 - 1)


def filter_batch(batch: RolloutBatch, cfg: FilterConfig) -> tuple[RolloutBatch, dict[str, float], dict[int, float]]:
    """Keep whole groups by `cfg`; returns (kept batch, filter metrics, reward std of every group id).

    The group reward std is always computed (it drives the analysis buckets and early stopping),
    even when the strategy is `none`.
    """
    group_ids, rewards = batch.group_matrix()  # [G, n]
    stats = group_stats(rewards)
    if cfg.strategy == "none":
        kept = torch.arange(len(group_ids))  # [G]
        scores = stats["std"]  # [G]
    else:
        scores = group_scores(rewards, cfg.metric)  # [G]
        kept = select_groups(scores, strategy=cfg.strategy, value=cfg.value, keep=cfg.keep,
                             prob_mode=cfg.prob_mode, include_zero=cfg.include_zero)  # [K]
    metrics = filter_metrics(rewards, kept, scores)
    kept_ids = {group_ids[i] for i in kept.tolist()}
    rows = [i for i, g in enumerate(batch.group_ids.tolist()) if g in kept_ids]
    return batch.select(rows), metrics, dict(zip(group_ids, stats["std"].tolist(), strict=True))


def advantages_and_returns(batch: RolloutBatch, values: torch.Tensor | None,
                           cfg: AlgoConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Advantages [N, L] (and GAE returns [N, L], else None) by `cfg.adv_estimator`."""
    mask = batch.response_mask  # [N, L]
    if cfg.adv_estimator == "gae":
        return gae_advantages(batch.token_rewards, values, mask, gamma=cfg.gamma, lam=cfg.lam, whiten=True)
    if cfg.adv_estimator == "grpo":
        return grpo_advantages(batch.scores, batch.group_ids, mask, norm_by_std=cfg.norm_adv_by_std), None
    if cfg.adv_estimator == "rloo":
        return rloo_advantages(batch.scores, batch.group_ids, mask), None
    return reinforce_pp_advantages(batch.token_rewards, mask, gamma=cfg.gamma), None


def component_advantages(batch: RolloutBatch, cfg: AlgoConfig) -> dict[str, torch.Tensor]:
    """The advantages of each raw reward component alone, by the training estimator. name -> [N, L]

    GRPO / RLOO / REINFORCE++ use the component's own scores and group statistics. GAE has no per-component
    critic, so each component gets the GRPO group-relative advantage (`algo.norm_adv_by_std` as set).
    """
    out = {}
    for k, name in enumerate(batch.reward_names):
        scores = batch.reward_components[:, k]  # [N]
        if cfg.adv_estimator == "rloo":
            out[name] = rloo_advantages(scores, batch.group_ids, batch.response_mask)
        elif cfg.adv_estimator == "reinforce_pp":
            out[name] = reinforce_pp_advantages(batch.last_token(scores), batch.response_mask, gamma=cfg.gamma)
        else:
            out[name] = grpo_advantages(scores, batch.group_ids, batch.response_mask, norm_by_std=cfg.norm_adv_by_std)
    return out


def data_metrics(batch: RolloutBatch, advantages: torch.Tensor, returns: torch.Tensor | None,
                 values: torch.Tensor | None) -> dict[str, float]:
    """Batch summaries with verl's names."""
    mask = batch.response_mask  # [N, L]
    lengths = mask.sum(dim=1)  # [N]
    out = {
        "critic/score/mean": batch.scores.mean().item(),
        "critic/score/max": batch.scores.max().item(),
        "critic/score/min": batch.scores.min().item(),
        "critic/advantages/mean": masked_mean(advantages, mask).item(),
        "critic/advantages/max": advantages[mask > 0].max().item() if mask.any() else 0.0,
        "critic/advantages/min": advantages[mask > 0].min().item() if mask.any() else 0.0,
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response_length/min": lengths.min().item(),
        "train/batch_size": float(len(batch)),
    }
    if returns is not None and values is not None:
        out["critic/returns/mean"] = masked_mean(returns, mask).item()
        out["critic/values/mean"] = masked_mean(values, mask).item()
        resid = masked_mean((returns - values - masked_mean(returns - values, mask)) ** 2, mask)  # []
        var = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)  # []
        out["critic/vf_explained_var"] = (1 - resid / (var + 1e-8)).item()
        # the two terms, so explained variance can be pooled over steps (1 - Σ residual / Σ returns var): a batch
        # of 64 with few successes has a tiny return variance and a per-step ratio far below 0
        out["critic/returns/var"] = var.item()
        out["critic/vf_residual_var"] = resid.item()
    return out
