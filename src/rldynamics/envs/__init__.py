"""Environments: the `Env` protocol, the registry dict, and `make_env`.

Adding an environment takes two steps and no framework:

1. Write a class that satisfies `rldynamics.envs.base.Env`: an `actions` tuple of action words,
   `instructions()`, a deterministic `reset(seed) -> str`, `step(action) -> StepResult` and `success()`.
   Its constructor takes the env-specific config keys as keyword arguments.
2. Insert it into `ENVS` under the name users type as `env.name`, either below or at runtime:

       from rldynamics.envs import ENVS
       ENVS["my_env"] = MyEnv

The registry is a plain dict on purpose (docs/reference/style_anchors.md §7.9): no decorators, no plugin discovery.
"""

from __future__ import annotations

import difflib

from rldynamics.envs.bandit import BanditEnv
from rldynamics.envs.base import Env, StepResult
from rldynamics.envs.countdown import CountdownEnv
from rldynamics.envs.frozenlake import FrozenLakeEnv
from rldynamics.envs.gym import GymEnv
from rldynamics.envs.math import MathEnv
from rldynamics.envs.openenv import OpenEnvEnv
from rldynamics.envs.prompts import PromptsEnv
from rldynamics.envs.sokoban import SokobanEnv

ENVS: dict[str, type] = {"sokoban": SokobanEnv, "frozenlake": FrozenLakeEnv, "countdown": CountdownEnv,
                         "bandit": BanditEnv, "math": MathEnv, "prompts": PromptsEnv,
                         "gym": GymEnv, "openenv": OpenEnvEnv}


def make_env(name: str, **kwargs: object) -> Env:
    """Instantiate the env registered as `name` with its keyword config; unknown names raise ValueError."""
    if name not in ENVS:
        close = difflib.get_close_matches(str(name), list(ENVS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown env {name!r}.{hint} Registered envs: {', '.join(sorted(ENVS))}")
    return ENVS[name](**kwargs)


__all__ = ["ENVS", "BanditEnv", "CountdownEnv", "Env", "FrozenLakeEnv", "GymEnv", "MathEnv",
           "OpenEnvEnv", "PromptsEnv", "SokobanEnv", "StepResult", "make_env"]
