"""The stages of a training step that sit between rollout and update, each a function of plain inputs.

- `train_seeds` / `val_seeds`: which env seeds a rollout uses (RAGEN's seeding: step s uses
  seed_base + env_groups*(s-1) + g; validation always the same puzzles); `env_seeds` moves them to training's or
  validation's side of `val.held_out` (envs/split.py); `problem_metrics`: validation's distinct problems and its
  success's standard error clustered by problem.
- `filter_batch`: score groups, keep whole groups (rldynamics.algo.filter); returns a `Filtered`: the kept batch
  with the values later stages decide on (group reward stds, their mean, the kept ratio) and its metrics.
- `advantages_and_returns` / `component_advantages`: the estimator of `algo.adv_estimator` (`ESTIMATORS`, one
  table).
- `data_metrics`: verl-style `critic/score/*`, `critic/advantages/*`, `response_length/*` summaries, and with a
  critic `critic/vf_explained_var` with its two terms (`critic/returns/var`, `critic/vf_residual_var`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from rldynamics import metric_names as names
from rldynamics.algo.advantages import gae_advantages, grpo_advantages, reinforce_pp_advantages, rloo_advantages
from rldynamics.algo.filter import filter_metrics, group_scores, group_stats, kept_ratio, mean_or_zero, select_groups
from rldynamics.algo.losses import masked_mean
from rldynamics.config import AlgoConfig, Config, FilterConfig
from rldynamics.envs.split import env_first_observation, problem_key, side_seeds
from rldynamics.rollout.batch import RolloutBatch


def train_seeds(seed_base: int, env_groups: int, step: int) -> list[int]:
    """Env seeds of the groups of training step `step` (1-based)."""
    return [seed_base + env_groups * (step - 1) + g for g in range(env_groups)]


def val_seeds(seed_base: int, env_groups: int) -> list[int]:
    """The fixed validation puzzles."""
    return [seed_base + g for g in range(env_groups)]


def validation_seeds(cfg: Config) -> list[int]:
    """The validation puzzles of a run: `val_seeds` on validation's side of `val.held_out`."""
    return env_seeds(cfg, val_seeds(cfg.val.seed_base, cfg.val.env_groups), validation=True)


def env_seeds(cfg: Config, seeds: list[int], validation: bool = False) -> list[int]:
    """`seeds` moved to training's (or validation's) side of `val.held_out`: unchanged when it is 0."""
    return side_seeds(env_first_observation(cfg.env.name, cfg.env.options()), seeds, cfg.val.held_out, validation)


def problem_metrics(batch: RolloutBatch, cfg: Config, prefix: str) -> dict[str, float]:
    """`<prefix>/problems` (distinct first observations) and `<prefix>/success_se`: the standard error of the mean
    success with trajectories clustered by problem (a problem drawn k times counts once, not k times):
    sqrt(P / (P - 1) * sum_p (sum_{i in p} (y_i - mean))^2) / N over P problems and N trajectories."""
    if not batch.env_metrics:
        return {}
    first = env_first_observation(cfg.env.name, cfg.env.options())
    keys = [problem_key(first(seed)) for seed in batch.seeds]
    return {f"{prefix}/{names.PROBLEMS}": float(len(set(keys))),
            f"{prefix}/{names.SUCCESS_SE}": clustered_se([m[names.SUCCESS] for m in batch.env_metrics], keys)}


def clustered_se(values: list[float], clusters: list[str]) -> float:
    """Standard error of mean(values) with the values grouped in `clusters` (CR1: the P / (P - 1) correction);
    0 for a single cluster."""
    n, mean = len(values), sum(values) / len(values)
    sums: dict[str, float] = {}
    for v, c in zip(values, clusters, strict=True):
        sums[c] = sums.get(c, 0.0) + v - mean
    p = len(sums)
    return 0.0 if p < 2 else (p / (p - 1) * sum(d * d for d in sums.values())) ** 0.5 / n


def step_seed(seed: int, step: int, stream: int = 0) -> int:
    """A distinct, reproducible sampling seed per (run seed, step, stream)."""
    return (seed * 1_000_003 + step * 7919 + stream * 104_729) % (2**63 - 1)


@contextmanager
def timed(metrics: dict[str, float], name: str):
    """Add the wall time of the block to `metrics[timing(name)]` (`timing_s/<name>`)."""
    start = time.perf_counter()
    yield
    metrics[names.timing(name)] = metrics.get(names.timing(name), 0.0) + time.perf_counter() - start


@dataclass
class Filtered:
    """A rollout after the filter: the kept batch and the values the later stages decide on."""

    batch: RolloutBatch  # the kept groups, whole
    rows: list[int]  # the rows of the rollout it kept, in batch order (a step record's kept rows)
    group_std: dict[int, float]  # reward std of every group id, kept or not (the analysis buckets)
    reward_std: float  # mean group reward std before filtering (early stopping's reward-variance rule)
    kept_ratio: float  # kept groups / all groups (the advantages' loss scaling)
    metrics: dict[str, float]  # the filter's `<prefix>/...` metrics


@dataclass
class Validation:
    """A validation's success rate (None when it has none: non-finite sampling scores) and its metrics."""

    success: float | None
    metrics: dict[str, float]
    trajectories: int = 0  # how many were sampled (the success rate's standard error)


def filter_batch(batch: RolloutBatch, cfg: FilterConfig, prefix: str = names.ROLLOUT) -> Filtered:
    """Keep whole groups by `cfg`; its metrics are named under `prefix`.

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
    kept_ids = {group_ids[i] for i in kept.tolist()}
    rows = [i for i, g in enumerate(batch.group_ids.tolist()) if g in kept_ids]
    return Filtered(batch=batch.select(rows), rows=rows,
                    group_std=dict(zip(group_ids, stats["std"].tolist(), strict=True)),
                    reward_std=mean_or_zero(stats["std"].detach().cpu()), kept_ratio=kept_ratio(kept, len(group_ids)),
                    metrics=filter_metrics(rewards, kept, scores, prefix))


def advantages_and_returns(batch: RolloutBatch, values: torch.Tensor | None,
                           cfg: AlgoConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Advantages [N, L] (and GAE returns [N, L], else None) by `cfg.adv_estimator` (`ESTIMATORS`)."""
    return ESTIMATORS[cfg.adv_estimator].advantages(batch, values, cfg)


def component_advantages(batch: RolloutBatch, cfg: AlgoConfig) -> dict[str, torch.Tensor]:
    """The advantages of each raw reward component alone, by the training estimator. name -> [N, L]

    GRPO / RLOO / REINFORCE++ use the component's own scores and group statistics. GAE has no per-component
    critic, so each component gets the GRPO group-relative advantage (`algo.norm_adv_by_std` as set).
    """
    component = ESTIMATORS[cfg.adv_estimator].component
    return {name: component(batch, batch.reward_components[:, k], cfg)  # [N] scores -> [N, L]
            for k, name in enumerate(batch.reward_names)}


def _gae(batch: RolloutBatch, values: torch.Tensor | None, cfg: AlgoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    return gae_advantages(batch.token_rewards, values, batch.response_mask, gamma=cfg.gamma, lam=cfg.lam, whiten=True)


def _grpo(batch: RolloutBatch, values: torch.Tensor | None, cfg: AlgoConfig) -> tuple[torch.Tensor, None]:
    return _grpo_of(batch, batch.scores, cfg), None


def _grpo_of(batch: RolloutBatch, scores: torch.Tensor, cfg: AlgoConfig) -> torch.Tensor:
    return grpo_advantages(scores, batch.group_ids, batch.response_mask, norm_by_std=cfg.norm_adv_by_std)


def _rloo(batch: RolloutBatch, values: torch.Tensor | None, cfg: AlgoConfig) -> tuple[torch.Tensor, None]:
    return _rloo_of(batch, batch.scores, cfg), None


def _rloo_of(batch: RolloutBatch, scores: torch.Tensor, cfg: AlgoConfig) -> torch.Tensor:
    return rloo_advantages(scores, batch.group_ids, batch.response_mask)


def _reinforce_pp(batch: RolloutBatch, values: torch.Tensor | None, cfg: AlgoConfig) -> tuple[torch.Tensor, None]:
    return reinforce_pp_advantages(batch.token_rewards, batch.response_mask, gamma=cfg.gamma), None


def _reinforce_pp_of(batch: RolloutBatch, scores: torch.Tensor, cfg: AlgoConfig) -> torch.Tensor:
    return reinforce_pp_advantages(batch.last_token(scores), batch.response_mask, gamma=cfg.gamma)


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator: the trained advantages (and returns) of a batch, and those of one reward component's
    scores alone (`component_advantages`). Whether it needs a critic: `AlgoConfig.has_critic`."""

    advantages: Callable[[RolloutBatch, torch.Tensor | None, AlgoConfig], tuple[torch.Tensor, torch.Tensor | None]]
    component: Callable[[RolloutBatch, torch.Tensor, AlgoConfig], torch.Tensor]


# `algo.adv_estimator` -> its functions; its choices are the config field's (a test holds the two together)
ESTIMATORS: dict[str, Estimator] = {
    "gae": Estimator(_gae, _grpo_of),  # no per-component critic: components get GRPO's advantages
    "grpo": Estimator(_grpo, _grpo_of),
    "rloo": Estimator(_rloo, _rloo_of),
    "reinforce_pp": Estimator(_reinforce_pp, _reinforce_pp_of),
}


def data_metrics(batch: RolloutBatch, advantages: torch.Tensor, returns: torch.Tensor | None,
                 values: torch.Tensor | None) -> dict[str, float]:
    """Batch summaries with verl's names."""
    mask = batch.response_mask  # [N, L]
    lengths = mask.sum(dim=1)  # [N]
    out = {
        names.score("mean"): batch.scores.mean().item(),
        names.score("max"): batch.scores.max().item(),
        names.score("min"): batch.scores.min().item(),
        names.advantages("mean"): masked_mean(advantages, mask).item(),
        names.advantages("max"): advantages[mask > 0].max().item() if mask.any() else 0.0,
        names.advantages("min"): advantages[mask > 0].min().item() if mask.any() else 0.0,
        names.response_length("mean"): lengths.mean().item(),
        names.response_length("max"): lengths.max().item(),
        names.response_length("min"): lengths.min().item(),
        names.BATCH_SIZE: float(len(batch)),
    }
    if returns is not None and values is not None:
        out[names.RETURNS_MEAN] = masked_mean(returns, mask).item()
        out[names.VALUES_MEAN] = masked_mean(values, mask).item()
        resid = masked_mean((returns - values - masked_mean(returns - values, mask)) ** 2, mask)  # []
        var = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)  # []
        out[names.VF_EXPLAINED_VAR] = (1 - resid / (var + 1e-8)).item()
        # the two terms, so explained variance can be pooled over steps (1 - Σ residual / Σ returns var): a batch
        # of 64 with few successes has a tiny return variance and a per-step ratio far below 0
        out[names.RETURNS_VAR] = var.item()
        out[names.VF_RESIDUAL_VAR] = resid.item()
    return out
