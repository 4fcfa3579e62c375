"""Any single-turn prompt data set, graded only by the user's reward functions (`env.reward_funcs`).

Design choices:
- One turn: `reset(seed)` shows the prompt of a data set row, `step(reply)` ends the episode. The env grades
  nothing itself (`reward_names = ()`): the trained reward is the weighted sum of the reward functions named in
  `env.reward_funcs` (`envs.reward_funcs`), which receive the reply as `completions` and every column of the row as a
  keyword argument, TRL's `reward_funcs` convention. A run of this env without reward functions is refused.
- Rows come from any data source `envs.data_source` reads (JSONL / JSON / Parquet / CSV file, `save_to_disk`
  directory, cached hub id), split and prompt column chosen by the user; seeds reach rows as in the math env (seeds
  below `holdout` pick the held-out rows 0..holdout-1, larger seeds cycle through the others).
- Success has no meaning of its own here, so it is defined by the reward: a trajectory succeeds when its trained
  reward reaches `success_threshold` (the rollout reports the reward through the optional `graded` hook, Env
  protocol). Validation success, pass@k and early stopping on low validation success then follow that threshold.
- `full_reply = True`: the rollout passes the whole decoded reply (no `<answer>` parsing, no format penalty).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rldynamics.envs.base import StepResult
from rldynamics.envs.data_source import read_rows


@dataclass
class PromptsConfig:
    source: str = ""
    """The data set: a .jsonl / .json / .parquet / .csv file, a datasets save_to_disk directory or a cached hub id."""
    split: str = "train"
    """The split of a DatasetDict directory or a hub data set (single files: train)."""
    prompt_key: str = "prompt"
    """The column holding the prompt text (the user message); every column goes to the reward functions."""
    holdout: int = 0
    """Rows 0..holdout-1 go to seeds below holdout only (set val.seed_base=0, val.env_groups<=holdout)."""
    success_threshold: float = 1.0
    """A trajectory counts as a success when its trained reward (weighted sum of the reward functions) is >= this."""


class PromptsEnv:
    """Single-turn prompts from a data set; rewards only from `env.reward_funcs`."""

    Config = PromptsConfig
    actions: tuple[str, ...] = ()
    full_reply = True
    reward_names: tuple[str, ...] = ()
    reward_weights: dict[str, float] = {}

    def __init__(self, source: str = "", split: str = "train", prompt_key: str = "prompt", holdout: int = 0,
                 success_threshold: float = 1.0) -> None:
        if not source:
            raise ValueError("source is empty: set env.prompts.source to a data file, a save_to_disk directory or a "
                             "cached hub data set id")
        if holdout < 0 or not math.isfinite(success_threshold):
            raise ValueError(f"holdout must be >= 0 and success_threshold finite, got {holdout} and {success_threshold}")
        self.rows = read_rows(source, split)
        for where, row in self.rows:
            if prompt_key not in row:
                raise ValueError(f"{source}: {where} has no column {prompt_key!r} (columns: {', '.join(map(str, row))})"
                                 "; set env.prompts.prompt_key to the prompt column")
            if not isinstance(row[prompt_key], str) or not row[prompt_key].strip():
                raise ValueError(f"{source}: {where}'s {prompt_key!r} is not a non-empty text")
        if holdout >= len(self.rows):
            raise ValueError(f"holdout={holdout} leaves no training rows in {source!r} ({len(self.rows)} rows)")
        self.prompt_key, self.holdout, self.success_threshold = prompt_key, holdout, success_threshold
        self.where, self.current = "", {}
        self.passed = False

    def instructions(self) -> str:
        return "Answer the request."

    def reset(self, seed: int) -> str:
        n, h = len(self.rows), self.holdout
        self.where, self.current = self.rows[seed % n if seed < h or h == 0 else h + (seed - h) % (n - h)]
        self.passed = False
        return self.current[self.prompt_key]

    def step(self, reply: str, num_tokens: int | None = None) -> StepResult:
        """End the episode; the reward functions grade the reply after the rollout (`envs.reward_funcs`)."""
        info = {"success": 0.0, "action_is_valid": 1.0, "action_is_effective": 1.0}
        return StepResult(observation="", reward={}, done=True, info=info)

    def columns(self) -> dict:
        """The current row's columns (the reward functions' keyword arguments)."""
        return dict(self.current)

    def location(self) -> str:
        """The current row's place in the data set ("line 7", "row 3")."""
        return self.where

    def graded(self, reward: float) -> None:
        """The trajectory's trained reward, once the reward functions have run: success when it reaches the threshold."""
        self.passed = reward >= self.success_threshold

    def success(self) -> bool:
        return self.passed
