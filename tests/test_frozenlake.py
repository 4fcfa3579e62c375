"""FrozenLake env: rules on hand-built maps, slips (by hand and against gymnasium's transition table),
rendering, seeded maps (determinism across processes, solvability), the rollout on arbitrary text, the tiny
preset end to end."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import json_under_hash_seeds
from rldynamics.config import make_config
from rldynamics.envs import ENVS, make_env
from rldynamics.envs.frozenlake import (
    ACTIONS,
    FrozenLakeEnv,
    FrozenLakeState,
    generate_map,
    parse_map,
    render,
    shortest_path,
    transitions,
)

# S start, F frozen, H hole, G goal (gymnasium's letters).
SMALL = ["SFF", "FHF", "FFG"]


def _env(desc=SMALL, success_rate: float = 1.0, seed: int = 0, **kwargs) -> FrozenLakeEnv:
    env = FrozenLakeEnv(success_rate=success_rate, observation_format="grid", **kwargs)
    env.reset_from_map(desc, seed=seed)
    return env


def _at(env: FrozenLakeEnv, cell: tuple[int, int]) -> FrozenLakeEnv:
    env.set_state(FrozenLakeState(env.get_state().desc, cell))
    return env


# ---------------------------------------------------------------------------------------------------
# Rules on known maps (no slips)
# ---------------------------------------------------------------------------------------------------


def test_reach_goal_rewards_one_and_ends() -> None:
    env = _env()
    results = [env.step(a) for a in ("Right", "Right", "Down", "Down")]
    assert [r.reward for r in results] == [{"goal": 0.0}] * 3 + [{"goal": 1.0}]
    assert [r.done for r in results] == [False, False, False, True]
    assert results[-1].observation == "___\n_O_\n__√" and results[-1].info["success"] == 1.0 and env.success()
    with pytest.raises(RuntimeError, match="reset"):
        env.step("Up")


def test_hole_ends_the_episode_without_reward() -> None:
    env = _env()
    env.step("Right")
    result = env.step("Down")
    assert result.reward == {"goal": 0.0} and result.done and not env.success()
    assert result.observation == "___\n_X_\n__G" and result.info["action_is_effective"] == 1.0
    with pytest.raises(ValueError, match="hole"):
        env.solve()


@pytest.mark.parametrize(("action", "cell"), [("Left", (0, 0)), ("Up", (0, 0)), ("Right", (0, 1)), ("Down", (1, 0))])
def test_edges_keep_the_player_in_place(action: str, cell: tuple[int, int]) -> None:
    env = _env()
    result = env.step(action)
    assert env.get_state().player == cell and not result.done
    assert result.info["action_is_effective"] == float(cell != (0, 0)) and result.info["action_is_valid"] == 1.0


def test_max_steps_ends_the_episode() -> None:
    env = _env(max_steps=2)
    assert not env.step("Left").done
    last = env.step("Left")
    assert last.done and last.info["success"] == 0.0


def test_unknown_action_and_missing_reset() -> None:
    with pytest.raises(ValueError, match="Left, Down, Right, Up"):
        _env().step("left")
    with pytest.raises(RuntimeError, match="reset"):
        FrozenLakeEnv().step("Left")


# ---------------------------------------------------------------------------------------------------
# Slips
# ---------------------------------------------------------------------------------------------------

OPEN = ["FFF", "SFF", "FFG"]


def _next_cells(action: str, success_rate: float, seeds: range, start=(1, 0), desc=OPEN) -> Counter:
    """Where one move from `start` lands for each slip seed."""
    out: Counter = Counter()
    for seed in seeds:
        env = _at(_env(desc, success_rate, seed=seed), start)
        env.step(action)
        out[env.get_state().player] += 1
    return out


def test_slip_rule_by_hand() -> None:
    # From (1, 0), Right slips to Up (0, 0) or Down (2, 0); it never goes back Left.
    assert _next_cells("Right", 1.0, range(50)) == Counter({(1, 1): 50})
    never_right = _next_cells("Right", 0.0, range(400))
    assert set(never_right) == {(0, 0), (2, 0)} and abs(never_right[(0, 0)] - 200) < 4 * 10  # SE = 10
    # Success rate 0.5 from the corner (0, 0), Left: Left and Up stay put (0.5 + 0.25), Down goes to (1, 0).
    corner = FrozenLakeState(tuple(OPEN), (0, 0))
    assert transitions(corner, "Left", 0.5) == {(0, 0): 0.75, (1, 0): 0.25}
    assert transitions(FrozenLakeState(tuple(OPEN), (1, 1)), "Up", 0.2) == pytest.approx(
        {(0, 1): 0.2, (1, 0): 0.4, (1, 2): 0.4})


@pytest.mark.parametrize("success_rate", [1 / 3, 0.8, 0.5])
def test_sampled_slips_follow_the_transition_table(success_rate: float) -> None:
    n = 1200
    for action in ACTIONS:
        counts = _next_cells(action, success_rate, range(n), start=(1, 1))
        expected = transitions(FrozenLakeState(tuple(OPEN), (1, 1)), action, success_rate)
        assert set(counts) == set(expected)
        for cell, p in expected.items():
            se = (p * (1 - p) / n) ** 0.5
            assert abs(counts[cell] / n - p) < 4 * se, (action, cell)


def test_slip_draws_depend_on_seed_and_step_only() -> None:
    def walk(seed: int) -> list:
        env = _env(["FFFFF", "FFFFF", "FFSFF", "FFFFF", "FFFFG"], success_rate=0.5, seed=seed)
        return [env.step(a).observation for a in ("Up", "Left", "Down", "Right", "Up")]

    assert walk(3) == walk(3) and len({tuple(walk(s)) for s in range(10)}) > 1
    env = _env(["FFFFF", "FFFFF", "FFSFF", "FFFFF", "FFFFG"], success_rate=0.5, seed=3)
    env.step("Up")
    saved = env.get_state()
    first = [env.step(a).observation for a in ("Left", "Down")]
    env.set_state(saved)
    assert [env.step(a).observation for a in ("Left", "Down")] == first


def _gym_distribution(gym_env, state: int, action: int) -> tuple[dict[int, float], dict[int, tuple[float, bool]]]:
    probs: dict[int, float] = {}
    outcome: dict[int, tuple[float, bool]] = {}
    for p, nxt, reward, terminated in gym_env.unwrapped.P[state][action]:
        if p > 0:
            probs[nxt] = probs.get(nxt, 0.0) + p
            outcome[nxt] = (float(reward), bool(terminated))
    return probs, outcome


@pytest.mark.parametrize("success_rate", [1 / 3, 1.0, 0.8, 0.5, 0.2, 0.0])
def test_transition_table_matches_gymnasium(success_rate: float) -> None:
    from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv as GymFrozenLake

    maps = [SMALL, ["SFFH", "FHFF", "FFFH", "HFFG"]] + [list(generate_map(5, 0.7, seed).desc) for seed in range(3)]
    for desc in maps:
        kwargs = {} if success_rate == 1 / 3 else {"success_rate": success_rate}  # 1/3: gymnasium's own default
        gym_env = GymFrozenLake(desc=desc, is_slippery=True, **kwargs)
        cols = len(desc[0])
        for index in range(len(desc) * cols):
            state = FrozenLakeState(tuple(desc), divmod(index, cols))
            for a, action in enumerate(ACTIONS):  # our action order is gymnasium's LEFT, DOWN, RIGHT, UP
                probs, outcome = _gym_distribution(gym_env, index, a)
                ours = {r * cols + c: p for (r, c), p in transitions(state, action, success_rate).items()}
                assert ours == pytest.approx(probs), (desc, index, action)
                if state.is_terminal():
                    continue
                for nxt, (reward, terminated) in outcome.items():
                    letter = desc[nxt // cols][nxt % cols]
                    assert (reward, terminated) == (float(letter == "G"), letter in "GH")


def test_step_rewards_and_ends_like_gymnasium() -> None:
    """Sampled steps on a slippery map: reward and termination agree with gymnasium's table entry."""
    from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv as GymFrozenLake

    desc = ["SFFH", "FHFF", "FFFH", "HFFG"]
    gym_env = GymFrozenLake(desc=desc, is_slippery=True, success_rate=0.6)
    for seed in range(60):
        env = _env(desc, success_rate=0.6, seed=seed)
        rng = random.Random(seed)
        while not env.done():
            r, c = env.get_state().player
            a = int(rng.random() * 4)
            result = env.step(ACTIONS[a])
            nr, nc = env.get_state().player
            _, outcome = _gym_distribution(gym_env, r * 4 + c, a)
            assert (result.reward["goal"], result.done) == outcome[nr * 4 + nc]


# ---------------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------------

COORD = "Board size: 3 rows x 3 cols (zero-indexed).\nHoles: (1, 1)\nGoal: (2, 2)\nPlayer: (0, 0)"


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [("grid", "P__\n_O_\n__G"), ("coord", COORD), ("grid_coord", f"Coordinates: \n{COORD}\nGrid Map: \nP__\n_O_\n__G")],
)
def test_render_formats(fmt: str, expected: str) -> None:
    assert render(parse_map(SMALL), fmt) == expected


def test_coord_lists_player_in_hole_and_on_goal_once() -> None:
    size = "Board size: 3 rows x 3 cols (zero-indexed).\n"
    assert render(FrozenLakeState(tuple(SMALL), (1, 1)), "coord") == size + "Goal: (2, 2)\nPlayer in hole: (1, 1)"
    assert render(FrozenLakeState(tuple(SMALL), (2, 2)), "coord") == size + "Holes: (1, 1)\nPlayer on goal: (2, 2)"


def test_instructions_describe_slips_symbols_and_actions() -> None:
    slippery = FrozenLakeEnv(success_rate=0.8).instructions()
    assert "slips sideways with probability 0.2" in slippery and "O: hole" in slippery
    assert "Left, Down, Right, Up" in slippery and "Coordinates are (row, col)" in slippery
    assert "Moves never slip" in FrozenLakeEnv(success_rate=1.0, observation_format="grid").instructions()


# ---------------------------------------------------------------------------------------------------
# Generation and solver
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "frozen_prob"), [(4, 0.9), (6, 0.8), (8, 0.6)])
def test_generated_maps_are_valid_and_solvable(size: int, frozen_prob: float) -> None:
    for seed in range(100):
        state = generate_map(size, frozen_prob, seed)
        assert state.shape == (size, size) and state.letter(state.player) == "S"
        env = FrozenLakeEnv(size=size, frozen_prob=frozen_prob, success_rate=1.0)
        env.reset(seed)
        plan = env.solve()
        results = [env.step(a) for a in plan]
        assert plan and env.success() and results[-1].reward == {"goal": 1.0}, f"seed {seed}"


def test_no_frozen_cells_leaves_start_next_to_goal() -> None:
    for seed in range(20):
        state = generate_map(4, 0.0, seed)
        assert len(state.cells("H")) == 14 and len(shortest_path(state)) == 1


def test_holes_appear_at_the_configured_rate_and_start_goal_vary() -> None:
    maps = [generate_map(4, 0.75, seed) for seed in range(400)]
    holes = sum(len(m.cells("H")) for m in maps) / (400 * 14)
    assert 0.15 < holes < 0.25  # 1 - 0.75, lowered a little by redrawing unsolvable maps
    assert len({(m.player, m.cells("G")[0]) for m in maps}) > 100


def test_solver_is_shortest_and_handles_goal() -> None:
    assert shortest_path(parse_map(["SHG", "FFF"])) == ["Down", "Right", "Right", "Up"]
    assert shortest_path(FrozenLakeState(("SFG",), (0, 2))) == []
    assert shortest_path(parse_map(["SHG"])) is None


def _maps(seeds: range) -> list[str]:
    env = FrozenLakeEnv(size=5, frozen_prob=0.8)
    return [env.reset(seed) for seed in seeds]


def test_same_seed_same_map_and_slips_across_processes() -> None:
    code = (
        "import json\nfrom rldynamics.envs.frozenlake import FrozenLakeEnv\n"
        "env = FrozenLakeEnv(size=5, frozen_prob=0.8)\nout = [env.reset(s) for s in range(20)]\n"
        "env = FrozenLakeEnv(success_rate=0.5)\nenv.reset(7)\nout += [env.step(a).observation for a in "
        "['Up', 'Left', 'Up', 'Left'] if not env.done()]\nprint(json.dumps(out))"
    )
    env = FrozenLakeEnv(success_rate=0.5)
    env.reset(7)
    expected = _maps(range(20)) + [env.step(a).observation for a in ["Up", "Left", "Up", "Left"] if not env.done()]
    assert len(set(expected[:20])) > 15
    assert all(out == expected for out in json_under_hash_seeds(code))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"size": 1}, "size"), ({"frozen_prob": 1.5}, "frozen_prob"), ({"success_rate": -0.1}, "success_rate"),
     ({"max_steps": 0}, "max_steps"), ({"observation_format": "image"}, "grid, coord, grid_coord")],
)
def test_bad_constructor_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FrozenLakeEnv(**kwargs)


@pytest.mark.parametrize(
    ("desc", "message"),
    [(["SFX", "FFG"], "unknown map letters"), (["SFF", "FFF"], "exactly one G"), (["SF", "FGF"], "equal length"),
     (["FFF", "FFG"], "exactly one S")],
)
def test_parse_map_rejects_bad_maps(desc: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_map(desc)


def test_unreachable_generation_fails_with_advice(monkeypatch) -> None:
    monkeypatch.setattr("rldynamics.envs.frozenlake.MAX_ATTEMPTS", 3)  # 12x12 without ice: ~2 % of maps work
    with pytest.raises(RuntimeError, match="after 3 attempts; raise frozen_prob"):
        generate_map(12, 0.0, 0)


def test_registered_and_configurable() -> None:
    assert ENVS["frozenlake"] is FrozenLakeEnv
    cfg = make_config(overrides=["env.name=frozenlake", "env.frozenlake.success_rate=0.5", "env.frozenlake.size=6"])
    env = make_env(cfg.env.name, **cfg.env.options())
    assert (env.size, env.success_rate) == (6, 0.5)


# ---------------------------------------------------------------------------------------------------
# The agent loop on arbitrary text, and the tiny preset end to end
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from rldynamics.models.tiny import build_tiny_tokenizer
    from rldynamics.train.warmstart import tiny_corpus

    return build_tiny_tokenizer(tiny_corpus(make_config("frozenlake-tiny").env, num_seeds=20))


@pytest.mark.parametrize("size", [4, 6])
def test_tiny_tokenizer_reads_every_coordinate_as_one_token(size: int) -> None:
    """Each cell coordinate, written as the coord observation writes it, is one token of the tiny tokenizer: goal
    and player then sit at fixed offsets from the end of the prompt (the tiny model could not learn the board
    while some coordinates were two tokens)."""
    from rldynamics.models.tiny import build_tiny_tokenizer
    from rldynamics.train.warmstart import tiny_corpus

    cfg = make_config("frozenlake-tiny", overrides=[f"env.frozenlake.size={size}"])
    tok = build_tiny_tokenizer(tiny_corpus(cfg.env))
    env = make_env(cfg.env.name, **cfg.env.options())
    env.reset(0)
    assert "Player: (" in env.render()
    pieces = [tok.tokenize(f"Goal: ({r}, {c})") for r in range(size) for c in range(size)]
    assert all(len(p) == 3 for p in pieces), [p for p in pieces if len(p) != 3]


WORDS = st.sampled_from(["<answer>", "</answer>", "<think>", "</think>", "||", "Left", "down", " Up ", "RIGHT",
                         "<|im_end|>", "\n", "X"])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.text(max_size=30), st.lists(WORDS, max_size=12).map("".join)), min_size=1, max_size=4),
       st.booleans())
def test_rollout_never_raises_on_arbitrary_replies(tokenizer, replies: list[str], think: bool) -> None:
    from rldynamics.rollout.agent import rollout

    cfg = make_config("frozenlake-tiny", overrides=[f"env.enable_think={str(think).lower()}"])
    closing = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    turn = iter(range(1000))

    def respond(trajs):
        return [tokenizer(replies[next(turn) % len(replies)], add_special_tokens=False)["input_ids"] + closing
                for _ in trajs]

    batch = rollout(None, tokenizer, [0, 1], 2, cfg.env, respond=respond)
    assert len(batch) == 4 and batch.reward_names == ("goal", "format_penalty")
    goal, penalty = batch.reward_components[:, 0], batch.reward_components[:, 1]
    assert ((goal == 0) | (goal == 1)).all() and (penalty <= 0).all() and (penalty >= -cfg.env.max_turns).all()


def test_rollout_survives_huge_adversarial_reply(tokenizer) -> None:
    from rldynamics.rollout.agent import rollout

    cfg = make_config("frozenlake-tiny", overrides=["env.max_turns=1"])
    text = "<answer>" * 3000 + "Left ||" * 3000 + "</think>" * 1000
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    batch = rollout(None, tokenizer, [0], 1, cfg.env, respond=lambda trajs: [ids for _ in trajs])
    assert batch.env_metrics[0]["num_turns"] == 1.0


def test_frozenlake_tiny_preset_trains(fast_overrides) -> None:
    from rldynamics.train.trainer import train

    cfg = make_config("frozenlake-tiny", overrides=[*fast_overrides, "log.name=fl"])
    run = train(cfg)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert {"reward/goal/mean", "reward/format_penalty/zero_std_group_frac", "train/frozenlake/success"} <= set(rows[1])
    assert "val-env/frozenlake/success" in rows[2]
