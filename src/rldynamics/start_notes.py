"""Warnings printed once, in one line each, when a run starts with settings that will not do what they seem to.

- `actor_never_updates`: the settings mean no actor update ever happens (critic warm-up that lasts the whole run,
  a filter that keeps no group whatever the rewards), so the run would end with the weights it started from.
- `preset_env_switch`: `env.name` set to another env than the preset's. The preset's settings of the shared env keys
  (`env.format_penalty`, `env.max_turns`, ...) still apply to the new env, and its `env.<old env>.*` keys do not;
  the warning names both, with the preset made for the new env when there is one. Nothing is reset: the run keeps
  exactly the config it prints and saves (resetting would make `--preset P env.name=E` mean something else than
  "P with env E").

- `no_warm_start`: the embedded tiny model with `model.warm_start_episodes` > 0 on an env with no solver to imitate
  (`prompts`): the model starts untrained (`warm_starts`).
- `game_without_sft`: the packaged SmolLM2 itself (not a fine-tuned checkpoint of it) on an agent game: it does not
  answer in the env's format (FrozenLake: 0 of 64 maps, no valid action; docs/sft.md), so every reward is the format
  penalty; `rldyn sft` first.

Pure functions of the config (and the preset's file); no torch, so the CLI can say it before any work.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rldynamics.config import Config, EnvConfig, parse_overrides, preset_dict, preset_names, read_config_file
from rldynamics.envs import ENVS
from rldynamics.envs.base import demonstrable


def actor_never_updates(cfg: Config) -> str | None:
    """Why no actor update can happen in this run, or None. (`train.steps=0`, a validation only, is meant not to update
    and gets no warning.)"""
    if cfg.train.steps == 0:
        return None
    if cfg.critic.warmup_steps >= cfg.train.steps:
        what = "train only the critic" if cfg.algo.has_critic else "skip the actor update (and, without a " \
            f"critic under algo.adv_estimator={cfg.algo.adv_estimator}, train nothing)"
        return (f"critic.warmup_steps={cfg.critic.warmup_steps} >= train.steps={cfg.train.steps}: the actor is never "
                f"updated (the first {cfg.critic.warmup_steps} steps {what}); set train.steps > "
                f"{cfg.critic.warmup_steps} or critic.warmup_steps < {cfg.train.steps}")
    f = cfg.filter
    if f.strategy == "top_p" and f.prob_mode == "linear" and f.value == 0:
        return ("filter.strategy=top_p with filter.value=0 (prob_mode linear) keeps no group: the actor is never "
                "updated and the run stops after filter.empty_stop_steps empty steps; set filter.value > 0 (1.0 keeps "
                "every group)")
    if (f.strategy != "none" and not f.include_zero and f.metric in ("reward_std", "reward_variance")
            and cfg.train.group_size == 1):
        return ("train.group_size=1 gives every group a reward std of 0, and filter.include_zero=false drops such "
                "groups: the filter keeps nothing and the actor is never updated; set filter.include_zero=true, "
                "filter.strategy=none or train.group_size > 1")
    return None


def preset_env_switch(preset: str | None, cfg: Config, user_env: dict[str, Any]) -> str | None:
    """The warning for a run whose `env.name` is not its preset's env, or None (no preset, or the same env).
    `user_env`: the env keys the user set (their own values are not the preset's, so they are not listed)."""
    if not preset:
        return None
    env = preset_dict(preset).get("env") or {}
    old = env.get("name", EnvConfig.name)
    if old == cfg.env.name:
        return None
    graded_whole = getattr(ENVS.get(cfg.env.name), "full_reply", False)  # such envs take no format_penalty
    shared = [k for k in env if k != "name" and k not in ENVS and k not in user_env
              and not (k == "format_penalty" and graded_whole)]
    kept = [f"env.{k}={_get(cfg.env, k)}" for k in shared if _get(cfg.env, k) is not None]
    dropped = f"env.{old}.*" if old in env else None
    made = [p for p in preset_names() if (preset_dict(p).get("env") or {}).get("name", EnvConfig.name) == cfg.env.name]
    same_model = [p for p in made if (preset_dict(p).get("model") or {}).get("path") == cfg.model.path]
    own = (same_model or made or [None])[0]
    parts = [f"env.name={cfg.env.name} replaces the env of preset {preset} ({old})"]
    parts.append(f"its env settings that still apply: {', '.join(kept)}" if kept else
                 "none of its shared env settings apply")
    if dropped:
        parts.append(f"its {dropped} keys do not")
    if own:
        parts.append(f"a preset made for {cfg.env.name}: --preset {own}")
    return "; ".join(parts)


def warm_starts(cfg: Config) -> bool:
    """Whether the run warm-starts the embedded tiny model (imitating the env's solver) before training."""
    return cfg.model.path == "tiny" and cfg.model.warm_start_episodes > 0 and demonstrable(ENVS[cfg.env.name])


def no_warm_start(cfg: Config) -> str | None:
    """Why `model.warm_start_episodes` is ignored in this run, or None."""
    if cfg.model.path != "tiny" or cfg.model.warm_start_episodes == 0 or warm_starts(cfg):
        return None
    return (f"env {cfg.env.name!r} has no solver for the tiny model's warm start to imitate: model.warm_start_episodes="
            f"{cfg.model.warm_start_episodes} is ignored and training starts from the untrained tiny model "
            "(model.warm_start_episodes=0 says so)")


GAMES = ("sokoban", "frozenlake", "bandit")  # the multi-turn agent games: actions named in <answer>...</answer>


def game_without_sft(cfg: Config) -> str | None:
    """Why RL on this game will see only format penalties, or None."""
    if cfg.model.path != "smollm2" or cfg.env.name not in GAMES:
        return None
    return (f"model.path=smollm2 is the base model, which does not answer {cfg.env.name} in its format (FrozenLake: 0 "
            "of 64 maps, no valid action), so RL sees only the format penalty; fine-tune it on the env's solver first: "
            "rldyn sft --preset <this preset> log.name=<name>, then model.path=<its checkpoint>/actor (docs/sft.md)")


def user_env(file: str | Path | None, overrides: list[str]) -> dict[str, Any]:
    """The `env` keys the user's config file and overrides set (raw values, merged in that order)."""
    sources = [read_config_file(file)] if file else []
    merged: dict[str, Any] = {}
    for data in [*sources, parse_overrides(overrides)]:
        if isinstance(data, dict) and isinstance(data.get("env"), dict):
            merged.update(data["env"])
    return merged


def start_warnings(cfg: Config, preset: str | None, file: str | Path | None, overrides: list[str]) -> list[str]:
    """Every warning for a run started with this preset, config file and overrides (one line each)."""
    env = user_env(file, overrides)
    out = [preset_env_switch(preset, cfg, env) if "name" in env else None, actor_never_updates(cfg),
           no_warm_start(cfg), game_without_sft(cfg)]
    return [f"warning: {line}" for line in out if line]


def _get(section: Any, key: str) -> Any:
    return getattr(section, key, None)
