"""Named reward components: which a rollout has (`reward_names`), their weights, the trained score (their weighted
sum), per-component statistics, and the per-trajectory reward-tracking rows.

This module is the one place the weighted reward is formed (docs/design.md §4.11): the rollout calls
`weighted_sum` for every trajectory score and for the per-turn "Reward:" line of the prompt. It also writes the
metrics `reward/<name>/*` and `reward_stats/*` (rldynamic's per-step statistics; their names: `metric_names`).
"""

from __future__ import annotations

import torch

from rldynamics import metric_names
from rldynamics.config import EnvConfig
from rldynamics.envs.base import own_reward_names
from rldynamics.envs.reward_funcs import load_reward_funcs


def reward_names(env, cfg: EnvConfig) -> tuple[str, ...]:
    """The reward components of a rollout, in order: the env's own, then `format_penalty` when it is non-zero (never
    for envs that grade the whole reply: `envs.base.own_reward_names`), then one per `env.reward_funcs`."""
    return own_reward_names(env, cfg.format_penalty) + tuple(f.name for f in load_reward_funcs(cfg.reward_funcs))


def resolve_weights(env, cfg: EnvConfig, names: tuple[str, ...]) -> dict[str, float]:
    """Weight of each component: `env.reward_weights` from the config, else the env's default, else 1.0."""
    return {name: float(cfg.reward_weights.get(name, env.reward_weights.get(name, 1.0))) for name in names}


def weighted_sum(components: dict[str, float], weights: dict[str, float]) -> float:
    """The trained reward: Σ_k weight_k · component_k (components in their declared order)."""
    return sum(weights[name] * value for name, value in components.items())


def reward_component_metrics(components: torch.Tensor, names: tuple[str, ...], group_ids: torch.Tensor,
                             prefix: str = metric_names.REWARD) -> dict[str, float]:
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
        out[metric_names.reward_component(name, "mean", prefix)] = values.mean().item()
        out[metric_names.reward_component(name, "std", prefix)] = values.std().item() if len(values) > 1 else 0.0
        out[metric_names.reward_component(name, "zero_std_group_frac", prefix)] = sum(constant) / len(constant)
    return out


def reward_rows(batch, step: int, tokenizer) -> list[dict]:
    """One reward-tracking row per trajectory of a rollout batch (written to `rewards.jsonl`).

    Each row: `step`, `traj` (row in the batch), `group`, `prompt` (the env seed), `reward` (raw components),
    `weighted` (weight x component), `total` (the trained score), `response_tokens` (sampled tokens, stop
    token included), `response_chars` (characters of the decoded sampled tokens, special tokens skipped) and
    `correct` (the env's success flag).
    """
    names, weights = batch.reward_names, batch.reward_weights
    rows = []
    for i in range(len(batch)):
        sampled = batch.input_ids[i][batch.response_mask[i] > 0]  # [R]
        raw = [float(v) for v in batch.reward_components[i].tolist()]
        rows.append({
            "step": step, "traj": i, "group": int(batch.group_ids[i]), "prompt": int(batch.seeds[i]),
            "reward": dict(zip(names, raw, strict=True)),
            "weighted": {n: w * v for n, w, v in zip(names, weights, raw, strict=True)},
            "total": float(batch.scores[i]), "response_tokens": int(sampled.numel()),
            "response_chars": len(tokenizer.decode(sampled.tolist(), skip_special_tokens=True)),
            "correct": bool(batch.env_metrics[i][metric_names.SUCCESS]),
        })
    return rows


def reward_stats(rows: list[dict], names: tuple[str, ...], prefix: str = metric_names.REWARD_STATS) -> dict[str, float]:
    """rldynamic's per-step reward statistics from reward-tracking rows.

    `<prefix>/avg_<name>` (mean raw component), `avg_actual_length` (mean response characters),
    `correct_count`, `format_valid_count` (rows whose `format` component is > 0; only when the env has one)
    and `total_samples`.
    """
    if not rows:
        return {}
    n = len(rows)
    out = {f"{prefix}/avg_{name}": sum(r["reward"][name] for r in rows) / n for name in names}
    out[f"{prefix}/avg_actual_length"] = sum(r["response_chars"] for r in rows) / n
    out[f"{prefix}/correct_count"] = float(sum(r["correct"] for r in rows))
    if "format" in names:
        out[f"{prefix}/format_valid_count"] = float(sum(r["reward"]["format"] > 0 for r in rows))
    out[f"{prefix}/total_samples"] = float(n)
    return out
