"""The env layer as a user meets it: per-env config sections, named reward components end to end, and an env
defined outside the package, registered and trained."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest
import torch

from rldynamics.cli import envs_help
from rldynamics.config import ConfigError, load_config, make_config, save_config, to_dict
from rldynamics.envs import ENVS
from rldynamics.envs.base import StepResult
from rldynamics.rollout.agent import rollout
from rldynamics.rollout.rewards import reward_component_metrics
from rldynamics.train.sft_data import solver_policy
from rldynamics.train.trainer import train


@dataclass
class GuessConfig:
    sides: int = 3
    """Faces of the die to guess."""
    bonus: float = 0.5
    """Reward component `fast` of a right first guess."""


class GuessEnv:
    """Guess the face of a seeded die in up to two turns; components `right` (1 on a right guess) and `fast`."""

    Config = GuessConfig
    reward_names = ("right", "fast")
    reward_weights = {"fast": 2.0}

    def __init__(self, sides: int = 3, bonus: float = 0.5) -> None:
        if sides < 2:
            raise ValueError(f"sides must be >= 2, got {sides}")
        self.sides, self.bonus = sides, bonus
        self.actions = tuple(str(i) for i in range(1, sides + 1))

    def instructions(self) -> str:
        return f"Guess the face of a {self.sides}-sided die. Actions: {', '.join(self.actions)}."

    def reset(self, seed: int) -> str:
        self.face, self.guesses, self.won = str(random.Random(seed).randint(1, self.sides)), 0, False
        return "The die is cast."

    def step(self, action: str) -> StepResult:
        self.guesses += 1
        self.won = action == self.face
        reward = {"right": float(self.won), "fast": self.bonus if self.won and self.guesses == 1 else 0.0}
        return StepResult("right" if self.won else "wrong", reward, self.won, {"action_is_effective": 1.0})

    def success(self) -> bool:
        return self.won

    def solve(self) -> list[str]:
        return [self.face]


@pytest.fixture
def guess_env():
    ENVS["guess"] = GuessEnv
    yield
    del ENVS["guess"]


def test_env_sections_and_errors(guess_env):
    cfg = make_config(overrides=["env.name=guess", "env.guess.sides=4", "env.reward_weights.right=3"])
    assert cfg.env.guess.sides == 4 and cfg.env.options() == {"sides": 4, "bonus": 0.5}
    with pytest.raises(ConfigError, match=r"env.sokoban.num_boxes .* key of env 'sokoban', but env.name='guess'"):
        make_config(overrides=["env.name=guess", "env.sokoban.num_boxes=2"])
    with pytest.raises(ConfigError, match="env.guess.*sides must be >= 2"):
        make_config(overrides=["env.name=guess", "env.guess.sides=1"])
    with pytest.raises(ConfigError, match=r"unknown reward components \['box'\]; env 'guess' has right, fast"):
        make_config(overrides=["env.name=guess", "env.reward_weights.box=1"])
    with pytest.raises(ConfigError, match="not a registered env.*did you mean guess"):
        make_config(overrides=["env.name=gues"])
    assert "env.guess.sides=3" in envs_help() and "fast (weight 2)" in envs_help()


def test_saved_config_keeps_only_the_selected_env_section(guess_env, tmp_path):
    cfg = make_config(overrides=["env.name=guess", "env.guess.bonus=0.25"])
    save_config(cfg, tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    assert "guess:" in text and "sokoban:" not in text
    assert to_dict(load_config(tmp_path / "config.yaml")) == to_dict(cfg)


def test_named_rewards_end_to_end(guess_env, tmp_path):
    """Components are summed per trajectory; the score is their weighted sum (right 3, fast 2, format 1)."""
    from rldynamics.models.tiny import build_tiny_tokenizer

    cfg = make_config(overrides=["env.name=guess", "env.reward_weights.right=3", "env.max_turns=2",
                                 "env.max_actions_per_turn=1", "env.format_penalty=-0.5"])
    tokenizer = build_tiny_tokenizer(["guess 1 2 3"])
    closing = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    replies = iter(["<answer>1</answer>", "junk", "<answer>2</answer>", "<answer>3</answer>"] * 10)

    def respond(trajs):
        return [tokenizer(next(replies), add_special_tokens=False)["input_ids"] + closing for _ in trajs]

    batch = rollout(None, tokenizer, [0, 1], 2, cfg.env, respond=respond)
    assert batch.reward_names == ("right", "fast", "format_penalty") and batch.reward_weights == (3.0, 2.0, 1.0)
    expected = batch.reward_components @ torch.tensor([3.0, 2.0, 1.0])  # [N]
    assert torch.equal(batch.scores, expected)
    penalties = batch.reward_components[:, 2]  # [N]: -0.5 per malformed ("junk") turn
    assert (penalties < 0).any() and torch.equal(penalties, (penalties / -0.5).round() * -0.5)
    metrics = reward_component_metrics(batch.reward_components, batch.reward_names, batch.group_ids)
    stats = ("mean", "std", "zero_std_group_frac")
    assert set(metrics) == {f"reward/{n}/{s}" for n in batch.reward_names for s in stats}


def test_reward_component_metrics_by_hand():
    components = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 2.0], [1.0, 0.0]])  # [N=4, K=2]
    groups = torch.tensor([0, 0, 1, 1])
    m = reward_component_metrics(components, ("a", "b"), groups)
    assert m["reward/a/mean"] == 0.75 and m["reward/b/mean"] == 0.5
    assert m["reward/a/std"] == pytest.approx(0.5) and m["reward/b/std"] == pytest.approx(1.0)
    assert m["reward/a/zero_std_group_frac"] == 0.5 and m["reward/b/zero_std_group_frac"] == 0.5


def test_user_env_trains_two_steps(guess_env, fast_overrides):
    cfg = make_config(overrides=[*fast_overrides, "env.name=guess", "env.max_actions_per_turn=1", "log.name=guess"])
    run = train(cfg)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert {"reward/right/mean", "reward/fast/zero_std_group_frac", "train/guess/success"} <= set(rows[1])
    assert "val-env/guess/success" in rows[2]


def test_solver_policy_falls_back_to_random_actions_without_a_solver(guess_env):
    from rldynamics.models.tiny import build_tiny_tokenizer

    del GuessEnv.solve
    try:
        cfg = make_config(overrides=["env.name=guess", "env.max_turns=1"])
        tokenizer = build_tiny_tokenizer(["guess 1 2 3"])
        batch = rollout(None, tokenizer, [0, 1, 2], 1, cfg.env, respond=solver_policy(tokenizer, cfg.env, 0.0,
                                                                                       random.Random(0)))
        assert all(m["action_is_valid"] == 1.0 for m in batch.env_metrics)
    finally:
        GuessEnv.solve = lambda self: [self.face]
