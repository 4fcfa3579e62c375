"""The Gymnasium adapter (`env.name=gym`): Gymnasium's own FrozenLake through it moves, rewards and
ends as our FrozenLake does on the same maps, seeds and moves (exactly without slips; within our
transition table with them); text observations and Text actions; seeds and the held-out split;
config keys and errors; a short training run."""

from __future__ import annotations

import json
import random
import string

import gymnasium
import pytest
import torch

from rldynamics.cli import envs_help, main
from rldynamics.config import ConfigError, load_config, make_config, save_config, to_dict
from rldynamics.envs import ENVS, make_env
from rldynamics.envs.frozenlake import (
    ACTIONS,
    FrozenLakeEnv,
    FrozenLakeState,
    generate_map,
    parse_map,
    shortest_path,
    transitions,
)
from rldynamics.envs.split import (
    env_first_observation,
    on_validation_side,
    problem_key,
    side_seeds,
)
from rldynamics.models.tiny import build_tiny_tokenizer
from rldynamics.rollout.agent import rollout
from rldynamics.tracking.run_dir import read_rewards

GYM_LAKE = ("SFFF", "FHFH", "FFFH", "HFFG")  # FrozenLake-v1's own 4x4 map
RENDER = "rldynamics.envs.gym:frozenlake_text"  # our FrozenLake's grid symbols


def lake_maps() -> list[tuple[int, tuple[str, ...]]]:
    """(seed, map): gymnasium's map, and our FrozenLake's maps of seeds 0..5 (frozen_prob 0.8)."""
    return [(7, GYM_LAKE)] + [(s, generate_map(4, 0.8, s).desc) for s in range(6)]


def gym_lake(desc, slippery: bool, success_rate: float = 0.8):
    kwargs = {"desc": list(desc), "is_slippery": slippery, "success_rate": success_rate}
    return make_env("gym", id="FrozenLake-v1", kwargs=kwargs, actions=list(ACTIONS), render=RENDER)


def player_cell(text: str) -> tuple[int, int]:
    """The player's cell in a grid observation (P, X in a hole, √ on the goal)."""
    rows = text.split("\n")
    return next((r, c) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch in "PX√")


def test_without_slips_gymnasium_frozenlake_moves_rewards_and_ends_exactly_as_ours():
    """Same maps, seeds and move sequences (random ones, the solver's path, 110 bumps into a wall):
    the same observation after every move, the same reward, the same end (goal, hole, or the
    100-step limit) at the same move."""
    endings = set()
    for seed, desc in lake_maps():
        plans = [random.Random(seed * 100 + k).choices(ACTIONS, k=110) for k in range(12)]
        plans += [shortest_path(parse_map(desc)), ["Left"] * 110]
        for plan in plans:
            ours = FrozenLakeEnv(success_rate=1.0, observation_format="grid")
            theirs = gym_lake(desc, False)
            assert theirs.reset(seed) == ours.reset_from_map(desc, seed)
            for action in plan:
                mine, gym = ours.step(action), theirs.step(action)
                assert gym.observation == mine.observation and gym.done == mine.done
                assert gym.reward == {"reward": mine.reward["goal"]}
                assert theirs.success() == ours.success()
                assert gym.info["action_is_effective"] == mine.info["action_is_effective"]
                if mine.done:
                    break
            assert theirs.success() == ours.success() and gym.done == mine.done
            end = theirs.metrics()
            kind = "goal" if ours.success() else "hole" if end["terminated"] else "truncated"
            steps = ours.get_state().num_env_steps
            assert kind != "truncated" or (end["truncated"] and steps == 100)
            endings.add(kind if mine.done else "open")
    assert endings >= {"goal", "hole", "truncated"}


def test_with_slips_every_move_lands_where_our_table_allows_with_its_frequencies():
    """Slips draw from gymnasium's generator (seeded by reset(seed)), ours from (seed, step): not
    the same draws, so each move is checked against our transition table, and the landing
    frequencies of one move over 3,000 seeds against its probabilities."""
    for seed, desc in lake_maps()[:3]:
        theirs = gym_lake(desc, True)
        for episode in range(40):
            state = parse_map(desc)
            theirs.reset(seed * 1000 + episode)
            for action in random.Random(episode).choices(ACTIONS, k=30):
                allowed = transitions(state, action, 0.8)
                result = theirs.step(action)
                cell = player_cell(result.observation)
                assert cell in allowed
                state = FrozenLakeState(desc=desc, player=cell)
                assert result.reward["reward"] == float(state.letter(cell) == "G")
                assert result.done == (state.is_terminal() or theirs.metrics()["truncated"] == 1)
                if result.done:
                    break
    theirs, counts = gym_lake(GYM_LAKE, True), {}
    for seed in range(3000):
        theirs.reset(seed)
        cell = player_cell(theirs.step("Right").observation)
        counts[cell] = counts.get(cell, 0) + 1
    expected = transitions(parse_map(GYM_LAKE), "Right", 0.8)  # (0,1): 0.8, (1,0), (0,0): 0.1 each
    assert set(counts) == set(expected)
    for cell, p in expected.items():
        assert abs(counts[cell] / 3000 - p) < 4 * (p * (1 - p) / 3000) ** 0.5


def test_a_seed_replays_its_slips():
    theirs = gym_lake(GYM_LAKE, True, 1 / 3)
    moves = ["Right", "Down", "Down", "Right", "Down", "Right"] * 3

    def play(seed: int) -> list[str]:
        theirs.reset(seed)
        out = []
        for action in moves:
            out.append(theirs.step(action).observation)
            if theirs.metrics()["terminated"]:
                break
        return out

    assert play(3) == play(3) and play(4) == play(4)
    assert len({tuple(play(s)) for s in range(10)}) > 1


class FixedLake(FrozenLakeEnv):
    """Our FrozenLake on gymnasium's map, without slips: the rollout's reference."""

    def __init__(self, **kwargs) -> None:
        super().__init__(success_rate=1.0, observation_format="grid")

    def reset(self, seed: int) -> str:
        return self.reset_from_map(GYM_LAKE, seed)


SCRIPTS = [["Down || Down", "Right || Right", "Down || Right"],  # the goal in three turns
           ["Right || Down"],  # a hole
           ["Down", "junk", "Left || Up || Right"]]  # a malformed turn, a third action cut off


def test_rollouts_through_the_adapter_match_our_frozenlake_turn_by_turn():
    tokenizer = build_tiny_tokenizer(["<answer>Down || Right</answer> P _ O G"])
    closing = [tokenizer.convert_tokens_to_ids("<|im_end|>")]

    def respond(trajs):
        texts = [SCRIPTS[t.row % 3][min(t.turns, len(SCRIPTS[t.row % 3]) - 1)] for t in trajs]
        texts = [t if t == "junk" else f"<answer>{t}</answer>" for t in texts]
        return [tokenizer(t, add_special_tokens=False)["input_ids"] + closing for t in texts]

    keys = ["env.max_turns=3", "env.max_actions_per_turn=2", "env.format_penalty=-0.5"]
    ENVS["fixedlake"] = FixedLake
    try:
        cfg = make_config(overrides=[*keys, "env.name=fixedlake"])
        ours = rollout(None, tokenizer, [0, 1], 3, cfg.env, respond=respond)
    finally:
        del ENVS["fixedlake"]
    gym_keys = ["env.name=gym", "env.gym.id=FrozenLake-v1", "env.gym.kwargs={is_slippery: false}",
                "env.gym.actions=[Left,Down,Right,Up]", f"env.gym.render={RENDER}"]
    cfg = make_config(overrides=[*keys, *gym_keys])
    theirs = rollout(None, tokenizer, [0, 1], 3, cfg.env, respond=respond)
    assert ours.reward_names == ("goal", "format_penalty")
    assert theirs.reward_names == ("reward", "format_penalty")
    assert torch.equal(ours.reward_components, theirs.reward_components)
    assert ours.reward_components[:, 0].tolist() == [1.0, 0.0, 0.0] * 2
    assert ours.reward_components[:, 1].tolist() == [0.0, 0.0, -0.5] * 2
    shared = ["success", "num_actions", "action_is_effective", "action_is_valid", "num_turns",
              "reward"]
    assert [{k: m[k] for k in shared} for m in ours.env_metrics] == \
           [{k: m[k] for k in shared} for m in theirs.env_metrics]
    assert [m["terminated"] for m in theirs.env_metrics] == [1.0, 1.0, 0.0] * 2


class SpellEnv(gymnasium.Env):
    """Spell the word the seed picks: Text observations and Text actions; info has is_success."""

    metadata = {"render_modes": []}
    WORDS = ("cat", "dog", "sun", "map", "ice", "owl")

    def __init__(self) -> None:
        self.observation_space = gymnasium.spaces.Text(40, charset=string.ascii_letters + " .")
        self.action_space = gymnasium.spaces.Text(5, charset=string.ascii_lowercase)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.word = self.WORDS[int(self.np_random.integers(len(self.WORDS)))]
        return f"Spell the word {self.word}.", {}

    def step(self, action):
        right = action == self.word
        text = "Right." if right else "Wrong."
        return text, float(right) * 2, right, False, {"is_success": right}


if "RldynSpell-v0" not in gymnasium.registry:
    gymnasium.register(id="RldynSpell-v0", entry_point=SpellEnv, max_episode_steps=3)


def test_text_observations_and_text_actions():
    env = make_env("gym", id="RldynSpell-v0", success_threshold=5.0)
    assert env.actions == () and "Answer with the action as text" in env.instructions()
    first = env.reset(3)
    word = first.split()[-1].rstrip(".")
    assert env.reset(3) == first  # reset(seed) is deterministic
    bad = env.step("CAT!")  # outside the space's charset: nothing happens
    assert bad.info["action_is_valid"] == 0 and bad.observation == first and not bad.done
    wrong = env.step("zzz")
    assert wrong.observation == "Wrong." and wrong.reward == {"reward": 0.0} and not env.success()
    right = env.step(word)
    assert right.done and right.reward == {"reward": 2.0}
    assert env.success()  # info's is_success decides, not the return (2) against the threshold (5)
    assert env.metrics() == {"terminated": 1.0, "truncated": 0.0, "invalid_actions": 1.0}
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step(word)


def test_the_held_out_split_separates_problems_of_a_seeded_env():
    first = env_first_observation("gym", {"id": "RldynSpell-v0"})
    val = {problem_key(first(s)) for s in side_seeds(first, list(range(60)), 0.5, validation=True)}
    train = {problem_key(first(s))
             for s in side_seeds(first, list(range(100, 160)), 0.5, validation=False)}
    assert val and train and not val & train
    fixed = env_first_observation("gym", {"id": "FrozenLake-v1"})  # a fixed map: one problem
    its_side = on_validation_side(problem_key(fixed(0)), 0.5)
    assert side_seeds(fixed, [0, 1], 0.5, validation=its_side) == [0, 1]
    with pytest.raises(ValueError, match="one problem only"):
        side_seeds(fixed, [0, 1], 0.5, validation=not its_side)


def test_config_keys_and_their_errors(tmp_path):
    keys = ["env.name=gym", "env.gym.id=FrozenLake-v1",
            "env.gym.kwargs={map_name: 8x8, is_slippery: no}",
            "env.gym.actions=[Left,Down,Right,Up]"]
    cfg = make_config(overrides=keys)
    assert cfg.env.gym.kwargs == {"map_name": "8x8", "is_slippery": False}
    one = make_config(overrides=[*keys[:2], "env.gym.kwargs.success_rate=0.5",
                                 "env.gym.kwargs.desc=[SG]"])
    assert one.env.gym.kwargs == {"success_rate": 0.5, "desc": ["SG"]}
    save_config(cfg, tmp_path / "config.yaml")
    assert to_dict(load_config(tmp_path / "config.yaml")) == to_dict(cfg)
    env = make_env("gym", **cfg.env.options())
    assert "\x1b[41mS" in env.reset(0)  # no render function: gymnasium's own ansi text
    bad = {"env.gym.id=NoSuchEnv-v0": "env.gym: gymnasium.make.*NoSuchEnv",
           "env.gym.id=CartPole-v1": "no ansi render mode; name a function .* env.gym.render",
           "env.gym.actions=[Left,Right]": "names 2 actions, but the space Discrete.4. has 4",
           "env.gym.actions=[Up,up,Left,Right]": "differ only by case",
           "env.gym.render=rldynamics.envs.gym:nothing": "env.gym.render .* no function 'nothing'",
           "env.gym.kwargs.slippery=true": "unexpected keyword argument 'slippery'",
           "env.gym.max_episode_steps=0": "max_episode_steps must be an integer >= 1"}
    for key, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            make_config(overrides=[*keys[:2], key])
    with pytest.raises(ConfigError, match="action space Box.* is not supported"):
        make_config(overrides=["env.name=gym", "env.gym.id=Pendulum-v1",
                               f"env.gym.render={RENDER}"])
    with pytest.raises(ConfigError, match="set env.gym.id"):
        make_config(overrides=["env.name=gym"])
    listed = envs_help()  # `rldyn envs`
    assert "gym  (rldynamics.envs.gym.GymEnv)" in listed and "env.gym.kwargs={}" in listed
    assert "actions: the words of env.gym.actions" in listed
    assert "openenv  (rldynamics.envs.openenv.OpenEnvEnv)" in listed
    assert "env.openenv.url=" in listed


def test_gymnasium_frozenlake_trains_a_few_steps(fast_overrides, tmp_path):
    code = main(["train", *fast_overrides, "env.name=gym", "env.gym.id=FrozenLake-v1",
                 "env.gym.kwargs={is_slippery: false}", "env.gym.actions=[Left,Down,Right,Up]",
                 f"env.gym.render={RENDER}", "env.max_actions_per_turn=1", "log.name=g"])
    assert code == 0
    run = tmp_path / "runs" / "g"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    logged = {"reward/reward/mean", "train/gym/terminated", "train/gym/invalid_actions"}
    assert logged <= set(rows[1])
    assert "val-env/gym/success" in rows[2]
    rewards = read_rewards(run)
    assert rewards and all(set(r["reward"]) == {"reward", "format_penalty"} for r in rewards)
    assert load_config(run / "config.yaml").env.gym.kwargs == {"is_slippery": False}
