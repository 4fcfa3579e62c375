"""The environment protocol every rldynamics env implements.

Design choices:
- Envs speak text. `reset` and `step` return observation strings; the rollout loop owns prompts, chat
  templates and action parsing (`rldynamics.rollout.parse`), so an env never sees raw model output.
- Two kinds of action: envs with action *words* (`actions = ("Up", "Down", ...)`) receive one checked
  word per `step` call (a turn with several actions is several calls); free-form envs (`actions = ()`,
  e.g. Countdown) receive the whole stripped `<answer>` text as one action.
- Envs that grade the whole reply (math: step indicators and `\\boxed{}` live outside `<answer>`) set the
  class attribute `full_reply = True`. The rollout then calls `step(reply, num_tokens=n)` once per turn with
  the whole decoded reply (special tokens skipped, the prompt's `<think>` opener put back in front) and its
  number of sampled tokens (stop token included), parses no `<answer>` tags and adds no `format_penalty`:
  the env judges format with its own reward components. Other envs keep `step(action)`.
- Rewards are named components: `step` returns `dict[str, float]` over the env's `reward_names`
  (a missing name counts 0). They stay separate until the rollout forms the trained score, their weighted
  sum (weights: `reward_weights`, overridable with `env.reward_weights`). `info` holds float diagnostics.
- Each env declares its own config dataclass (`Config`, one docstring per field); its fields are the
  constructor's keyword arguments and the user's `env.<name>.<field>` keys.
- `reset(seed)` is deterministic: the same seed gives the same initial state in every process and on
  every machine. Envs in a group share a seed and therefore a starting state.
- Two optional hooks: `rollout_scope()` returns a context manager the rollout holds around all the turns of
  one rollout (math: the time budget its answer checks share), and `metrics()` returns extra per-episode
  diagnostics (floats, the same names in every episode) that the rollout logs as their means,
  `<stage>/<env>/<name>`, next to `success` and the others.
- Three optional hooks serve the user's reward functions (`env.reward_funcs`, `envs.reward_funcs`) on single-turn
  envs: `columns()` returns the current row's data set columns (the functions' keyword arguments), `location()`
  its place in the data set ("line 7", named when a function fails on it), and `graded(reward)` receives the
  trajectory's trained reward once the functions have run (the prompts env defines success by it).
- `solve`, `random_action` and `corpus_extras` serve the embedded tiny model only (its tokenizer corpus
  and supervised warm start); an env used with a real model may leave them out.
- Helpers for env authors below the protocol: `randbelow` (version-stable seeded draws), `int_at_least`
  and `probability` (constructor checks with one-line errors).
"""

from __future__ import annotations

import numbers
import random
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass
class StepResult:
    """What one `Env.step` call returns.

    Attributes:
        observation: text rendering of the state after the action.
        reward: named reward components of this action (names from the env's `reward_names`).
        done: True when the episode is over (solved, failed, or out of env steps).
        info: float-valued diagnostics; at least `action_is_effective` (1.0 if the action changed the
            state), `action_is_valid` (1.0 if the action was legal) and `success` (1.0 if solved).
    """

    observation: str
    reward: dict[str, float]
    done: bool
    info: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
    """A text environment driven one action at a time.

    Attributes:
        actions: the valid action words, spelled as the model should write them (e.g. "Up"); an empty
            tuple means the whole answer text is the action (free-form answers).
        reward_names: the names of the reward components `step` reports.
        reward_weights: default weight of each component in the trained score (missing names: 1.0).
    """

    actions: tuple[str, ...]
    reward_names: tuple[str, ...]
    reward_weights: dict[str, float]

    def instructions(self) -> str:
        """Task description for the system prompt: rules, symbols and the available actions."""
        ...

    def reset(self, seed: int) -> str:
        """Start a new episode whose initial state is a deterministic function of `seed`; return its text."""
        ...

    def step(self, action: str) -> StepResult:
        """Execute one action (a word in `actions`, or the answer text of a free-form env)."""
        ...

    def success(self) -> bool:
        """True when the current state counts as solved."""
        ...


def own_reward_names(env: Env, format_penalty: float) -> tuple[str, ...]:
    """The reward components of a rollout of `env` before the user's `env.reward_funcs`: the env's own, then
    `format_penalty` when it is non-zero (never for an env that grades the whole reply, `full_reply`: it judges format
    itself)."""
    penalty = format_penalty != 0 and not getattr(env, "full_reply", False)
    return tuple(env.reward_names) + (("format_penalty",) if penalty else ())


def demonstrable(env_cls: type) -> bool:
    """Whether the tiny model's warm start can play noisy solver episodes of this env: a `solve()`, and random
    answers for the noise (its own `random_action`, else its action words: an env that sets them per instance, as
    bandit does, is taken to have them; only a class-level empty tuple says it has none). `prompts` has neither."""
    return hasattr(env_cls, "solve") and (hasattr(env_cls, "random_action") or getattr(env_cls, "actions", None) != ())


def random_action(env: Env, rng: random.Random) -> str:
    """A random action for noisy demonstrations: the env's own `random_action`, else a random action word."""
    own = getattr(env, "random_action", None)
    return own(rng) if own is not None else rng.choice(env.actions)


def randbelow(rng: random.Random, n: int) -> int:
    """Uniform int in [0, n) drawn from `rng.random()` only: the one stream Python guarantees across versions
    (`randrange`, `choice` and `shuffle` may change), so seeded generators give the same result everywhere."""
    return min(int(rng.random() * n), n - 1)


def int_at_least(name: str, value: object, minimum: int = 1) -> int:
    """`value` as a plain int (numpy integers accepted), or ValueError naming `name` and the bound."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def probability(name: str, value: object) -> float:
    """`value` as a float in [0, 1], or ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)
