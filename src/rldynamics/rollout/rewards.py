"""Named reward components: their weights, the trained score (their weighted sum), per-component statistics.

This module is the one place the weighted reward is formed (DESIGN.md §4.11): the rollout calls
`weighted_sum` for every trajectory score and for the per-turn "Reward:" line of the prompt.
"""

from __future__ import annotations

import torch

from rldynamics.config import EnvConfig


def resolve_weights(env, cfg: EnvConfig, names: tuple[str, ...]) -> dict[str, float]:
    """Weight of each component: `env.reward_weights` from the config, else the env's default, else 1.0."""
    return {name: float(cfg.reward_weights.get(name, env.reward_weights.get(name, 1.0))) for name in names}


def weighted_sum(components: dict[str, float], weights: dict[str, float]) -> float:
    """The trained reward: Σ_k weight_k · component_k (components in their declared order)."""
    return sum(weights[name] * value for name, value in components.items())


def reward_component_metrics(components: torch.Tensor, names: tuple[str, ...], group_ids: torch.Tensor,
                             prefix: str = "reward") -> dict[str, float]:
    """`<prefix>/<name>/mean|std|zero_std_group_frac` of each raw component over a batch.

    Args:
        components: [N, K] raw (unweighted) component values.
        group_ids: [N] group of each row; `zero_std_group_frac` is the fraction of groups in which the
            component is constant (it then gives no GRPO signal).
    """
    out: dict[str, float] = {}
    if components.shape[0] == 0:
        return out
    groups = [group_ids == g for g in torch.unique(group_ids)]  # G x [N] bool
    for k, name in enumerate(names):
        values = components[:, k].double()  # [N]
        constant = [bool((values[m] == values[m][0]).all()) for m in groups]
        out[f"{prefix}/{name}/mean"] = values.mean().item()
        out[f"{prefix}/{name}/std"] = values.std().item() if len(values) > 1 else 0.0
        out[f"{prefix}/{name}/zero_std_group_frac"] = sum(constant) / len(constant)
    return out
