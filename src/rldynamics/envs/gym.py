"""Any Gymnasium environment as an rldynamics env: `env.name=gym env.gym.id=FrozenLake-v1`.

Design choices:
- One `gymnasium.make(id, **kwargs)` per env instance (the rollout builds one per trajectory; a
  toy-text env takes well under a millisecond), with the registration's time limit unless
  `max_episode_steps` is given.
- The observation text, first that applies: the user's function `render` (`module:function` or
  `path/file.py:function`, imported as `env.reward_funcs` are; called as `fn(env, observation)`
  with the Gymnasium env and its raw observation; `rldynamics.envs.gym:frozenlake_text` is one),
  the observation itself when it is a string (a `Text` space), else the env's own `render()` in
  `ansi` mode (an env without that mode is refused when built, in one line naming
  `env.gym.render`).
- Actions: a `Discrete(n)` space takes `n` action words, `env.gym.actions` in the space's order
  (default: the numbers start .. start + n - 1). The rollout parses them out of the reply as for
  every env with action words (`rollout.parse`: `<answer>Left || Up</answer>`, case-insensitive,
  at most `env.max_actions_per_turn` a turn) and the env steps with the word's number. A `Text`
  space takes the whole answer text (`actions = ()`); a text the space does not contain (too
  long, a character outside its charset) is an invalid action that leaves the state as it was.
  Other spaces are refused.
- Reward: the one component `reward`, Gymnasium's reward. The episode ends when the env
  terminates or truncates, and succeeds when the last step's info says `is_success` (the
  robotics envs' key) or, without that key, when the return reaches `success_threshold`.
  Per-episode metrics: `terminated`, `truncated`, `invalid_actions`.
- Seeds: `reset(seed)` is `env.reset(seed=seed)`, deterministic where the env is. The held-out
  split (`val.held_out`) hashes the first observation's text, so it splits envs whose initial
  state depends on the seed; a fixed map (FrozenLake-v1's) is one problem and cannot be split.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from rldynamics.envs.base import StepResult, int_at_least
from rldynamics.envs.frozenlake import FrozenLakeState, render_grid
from rldynamics.envs.reward_funcs import load_function
from rldynamics.rollout.parse import _action_lookup

INSTALL = 'pip install "rldynamics[gym]" (gymnasium)'


@dataclass
class GymConfig:
    """The Gymnasium adapter's keys (`env.gym.<key>`)."""

    id: str = ""
    """Gymnasium env id, e.g. FrozenLake-v1 (any registered id; gymnasium.make)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of gymnasium.make, e.g. {is_slippery: false, map_name: 8x8}."""
    actions: list[str] = field(default_factory=list)
    """Names of a Discrete space's actions in order, e.g. [Left, Down, Right, Up] ([] = numbers)."""
    render: str | None = None
    """module:function(env, observation) -> text (None: a text observation, else ansi render())."""
    instructions: str | None = None
    """Task description in the system prompt (None: one naming the env id and its actions)."""
    max_episode_steps: int | None = None
    """Env steps before the episode is truncated (None = the registration's limit)."""
    success_threshold: float = 1.0
    """An episode succeeds when its return reaches this (unless the env's info has is_success)."""


class GymEnv:
    """A Gymnasium env speaking text; see the module docstring.

    Args: the fields of `GymConfig`.
    """

    Config = GymConfig
    actions: tuple[str, ...] = ()
    actions_help = ("the words of env.gym.actions (a Discrete space; default: its numbers), or the "
                    "answer text (a Text space)")  # `rldyn envs`
    reward_names: tuple[str, ...] = ("reward",)
    reward_weights: dict[str, float] = {}

    def __init__(self, id: str = "", kwargs: dict[str, Any] | None = None,
                 actions: list[str] | tuple = (), render: str | None = None,
                 instructions: str | None = None,
                 max_episode_steps: int | None = None, success_threshold: float = 1.0) -> None:
        if not id:
            raise ValueError("set env.gym.id to a Gymnasium env id, e.g. env.gym.id=FrozenLake-v1")
        self.id, self.success_threshold = id, float(success_threshold)
        self._instructions = instructions
        self._render = load_function(render, "env.gym.render") if render else None
        self.env = _make(id, dict(kwargs or {}), max_episode_steps, ansi=self._render is None)
        self.actions, self._values = _action_table(self.env.action_space, tuple(actions))
        self._episode: dict[str, float] | None = None

    def instructions(self) -> str:
        """`env.gym.instructions`, else a line naming the env and its actions."""
        if self._instructions:
            return self._instructions
        act = (f"Actions: {', '.join(self.actions)}." if self.actions
               else "Answer with the action as text.")
        return f"You are playing the Gymnasium environment {self.id}. {act}"

    def reset(self, seed: int) -> str:
        """`env.reset(seed=seed)`; the text of the first observation."""
        observation, info = self.env.reset(seed=int(seed))
        self._observation, self._text = observation, self._to_text(observation)
        self._episode = {"return": 0.0, "terminated": 0.0, "truncated": 0.0,
                         "invalid_actions": 0.0}
        self._is_success = info.get("is_success")
        return self._text

    def step(self, action: str) -> StepResult:
        """One Gymnasium step with the action word's number (or the answer text)."""
        episode = self._current()
        if episode["terminated"] or episode["truncated"]:
            raise RuntimeError("the episode is over (terminated or truncated); call reset() first")
        value = self._value(action)
        if value is None:
            episode["invalid_actions"] += 1
            return StepResult(self._text, {"reward": 0.0}, False, self._info(False, False))
        observation, reward, terminated, truncated, info = self.env.step(value)
        episode["return"] += float(reward)
        episode["terminated"], episode["truncated"] = float(terminated), float(truncated)
        self._is_success = info.get("is_success", self._is_success)
        effective = _changed(self._observation, observation)
        self._observation, self._text = observation, self._to_text(observation)
        return StepResult(self._text, {"reward": float(reward)}, bool(terminated or truncated),
                          self._info(effective, True))

    def success(self) -> bool:
        """The env's `is_success` when its info has one, else return >= `success_threshold`."""
        episode = self._current()
        if self._is_success is not None:
            return bool(self._is_success)
        return episode["return"] >= self.success_threshold

    def metrics(self) -> dict[str, float]:
        """Per-episode diagnostics: whether the env terminated or truncated it; invalid actions."""
        return {k: v for k, v in self._current().items() if k != "return"}

    def _current(self) -> dict[str, float]:
        if self._episode is None:
            raise RuntimeError("no episode yet; call reset(seed) first")
        return self._episode

    def _value(self, action: str) -> Any:
        """The argument of `env.step`: an action word's number, or a text the space contains
        (None: a text it does not contain)."""
        if self._values is None:
            return action if self.env.action_space.contains(action) else None
        if action not in self._values:
            raise ValueError(f"unknown action {action!r}; allowed: {', '.join(self.actions)}")
        return self._values[action]

    def _info(self, effective: bool, valid: bool) -> dict[str, float]:
        return {"action_is_effective": float(effective), "action_is_valid": float(valid),
                "success": float(self.success())}

    def _to_text(self, observation: Any) -> str:
        if self._render is not None:
            text = self._render(self.env, observation)
        elif isinstance(observation, str):
            text = observation
        else:
            text = self.env.render()
        if not isinstance(text, str):
            raise TypeError(f"env.gym: the observation text of {self.id} is a "
                            f"{type(text).__name__}, not a str; name a function writing it in "
                            "env.gym.render")
        return text


def _gymnasium():
    try:
        import gymnasium
    except ImportError as e:
        raise ValueError(f"env.name=gym needs gymnasium: {INSTALL}") from e
    return gymnasium


def _make(id: str, kwargs: dict[str, Any], max_episode_steps: int | None, ansi: bool):
    """`gymnasium.make`, in `ansi` render mode when the text must come from `render()`
    (ValueError naming the key when the id, the arguments or the render mode do not fit)."""
    gym = _gymnasium()
    if max_episode_steps is not None:
        kwargs["max_episode_steps"] = int_at_least("env.gym.max_episode_steps", max_episode_steps)
    env = _made(gym, id, kwargs)
    text_space = isinstance(env.observation_space, gym.spaces.Text)
    if not ansi or text_space or "render_mode" in kwargs:
        return env
    if "ansi" not in env.metadata.get("render_modes", ()):
        raise ValueError(f"env.gym.id={id}: its observations are not text and it has no ansi "
                         "render mode; name a function writing the text in "
                         "env.gym.render=module:function (called as fn(env, observation))")
    env.close()
    return _made(gym, id, {**kwargs, "render_mode": "ansi"})


def _made(gym, id: str, kwargs: dict[str, Any]):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the env checker's notes on toy envs' observations
            return gym.make(id, **kwargs)
    except (gym.error.Error, TypeError, ValueError) as e:
        raise ValueError(f"env.gym: gymnasium.make({id!r}, **{kwargs}) failed: {e}") from e


def _action_table(space, names: tuple[str, ...]) -> tuple[tuple[str, ...], dict[str, int] | None]:
    """(action words, word -> the space's number) of a Discrete space; ((), None) for Text."""
    from gymnasium import spaces

    if isinstance(space, spaces.Text):
        if names:
            raise ValueError("env.gym.actions names actions, but the action space is Text "
                             "(free-form answers); leave env.gym.actions empty")
        return (), None
    if not isinstance(space, spaces.Discrete):
        raise ValueError(f"env.gym: the action space {space} is not supported; a Discrete space "
                         "(action words, env.gym.actions) or a Text space (the answer text) is")
    n, start = int(space.n), int(space.start)
    names = names or tuple(str(start + i) for i in range(n))
    if len(names) != n:
        raise ValueError(f"env.gym.actions names {len(names)} actions, but the space {space} "
                         f"has {n}")
    _action_lookup(names)  # the rollout's own checks: distinct, no separator, no outer spaces
    return names, {name: start + i for i, name in enumerate(names)}


def _changed(before: Any, after: Any) -> bool:
    """Whether a step changed the observation (arrays by value; a failed comparison: changed)."""
    import numpy as np

    try:
        return not bool(np.array_equal(before, after))
    except (TypeError, ValueError):
        return True


def frozenlake_text(env, observation) -> str:
    """Gymnasium's FrozenLake in rldynamics' FrozenLake symbols, one line per row
    (`envs.frozenlake.render_grid`): P player, _ frozen (the start too), O hole, G goal,
    X player in a hole, √ player on the goal.
    Use: `env.gym.render=rldynamics.envs.gym:frozenlake_text`."""
    lake = env.unwrapped
    desc = tuple(b"".join(row).decode() for row in lake.desc)
    return render_grid(FrozenLakeState(desc=desc, player=divmod(int(observation), int(lake.ncol))))
