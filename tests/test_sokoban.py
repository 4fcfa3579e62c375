"""Sokoban env: rewards on hand-built rooms, rendering, determinism, solvability, registry."""

from __future__ import annotations

import hashlib

import pytest

from conftest import json_under_hash_seeds
from rldynamics.config import make_config
from rldynamics.envs import ENVS, Env, make_env
from rldynamics.envs.sokoban import (
    SokobanEnv,
    SokobanState,
    generate_puzzle,
    parse_grid,
    render,
    render_grid,
    solve,
)

TWO_BOXES = """
######
#PXO_#
#_XO_#
######
"""

PUSH_OFF = "######\n#P√_O#\n#__X_#\n######"

ALL_SYMBOLS = """
######
#PXO_#
#_√__#
######
"""


def _env(grid: str, **kwargs: object) -> SokobanEnv:
    env = SokobanEnv(observation_format="grid", **kwargs)
    env.reset_from_grid(grid)
    return env


# ---------------------------------------------------------------------------------------------------
# Dynamics and rewards
# ---------------------------------------------------------------------------------------------------


def test_push_onto_target_then_solve_rewards() -> None:
    env = _env(TWO_BOXES)
    first = env.step("Right")
    assert first.reward == {"step": -0.1, "box": 1.0, "solved": 0.0}
    assert not first.done and first.info == {"action_is_effective": 1.0, "action_is_valid": 1.0, "success": 0.0}
    assert first.observation == "######\n#_P√_#\n#_XO_#\n######"
    assert [sum(env.step(a).reward.values()) for a in ("Left", "Down")] == pytest.approx([-0.1, -0.1])
    last = env.step("Right")
    assert last.reward == {"step": -0.1, "box": 1.0, "solved": 10.0}
    assert last.done and last.info["success"] == 1.0 and env.success()


def test_push_off_target_is_penalised_and_player_shows_on_target() -> None:
    env = _env(PUSH_OFF)
    result = env.step("Right")
    assert result.reward == {"step": -0.1, "box": -1.0, "solved": 0.0}
    assert result.observation == "######\n#_SXO#\n#__X_#\n######"
    assert not result.done and result.info["action_is_effective"] == 1.0


@pytest.mark.parametrize(
    ("grid", "action"),
    [(PUSH_OFF, "Left"), ("####\n#PX#\n#O_#\n####", "Right"), ("######\n#PXXO#\n#__O_#\n######", "Right")],
    ids=["wall", "box-into-wall", "box-into-box"],
)
def test_blocked_moves_are_ineffective(grid: str, action: str) -> None:
    env = _env(grid)
    before = env.get_state()
    result = env.step(action)
    assert result.reward == {"step": -0.1, "box": 0.0, "solved": 0.0}
    assert result.info["action_is_effective"] == 0.0 and result.info["action_is_valid"] == 1.0
    assert (env.get_state().player, env.get_state().boxes) == (before.player, before.boxes)
    assert env.get_state().num_env_steps == 1


def test_done_at_max_steps_and_step_after_done_raises() -> None:
    env = _env(PUSH_OFF, max_steps=2)
    assert not env.step("Left").done
    last = env.step("Left")
    assert last.done and last.info["success"] == 0.0
    with pytest.raises(RuntimeError, match="reset"):
        env.step("Left")


def test_unknown_action_raises_with_allowed_list() -> None:
    env = _env(TWO_BOXES)
    with pytest.raises(ValueError, match="Up, Down, Left, Right"):
        env.step("up")


def test_get_set_state_round_trip() -> None:
    env = SokobanEnv()
    env.reset(7)
    saved = env.get_state()
    first = [env.step(a) for a in ("Up", "Left", "Down")]
    env.set_state(saved)
    again = [env.step(a) for a in ("Up", "Left", "Down")]
    assert [(r.observation, r.reward, r.done) for r in first] == [(r.observation, r.reward, r.done) for r in again]


# ---------------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------------

EXPECTED_GRID = "######\n#PXO_#\n#_√__#\n######"
EXPECTED_COORD = (
    "Board size: 4 rows x 6 cols (zero-indexed).\n"
    "Targets: (1, 3)\n"
    "Boxes: (1, 2)\n"
    "Boxes on target: (2, 2)\n"
    "Player: (1, 1)"
)


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        ("grid", EXPECTED_GRID),
        ("coord", EXPECTED_COORD),
        ("grid_coord", "Coordinates: \n" + EXPECTED_COORD + "\nGrid Map: \n" + EXPECTED_GRID),
    ],
)
def test_render_formats(fmt: str, expected: str) -> None:
    assert render(parse_grid(ALL_SYMBOLS), fmt) == expected


def test_coord_omits_empty_categories_and_shows_player_on_target() -> None:
    state = parse_grid("#####\n#S_X#\n#___#\n#####")
    assert render(state, "coord") == (
        "Board size: 4 rows x 5 cols (zero-indexed).\nBoxes: (1, 3)\nPlayer on target: (1, 1)"
    )


def test_grid_round_trips_through_parse() -> None:
    state = generate_puzzle((6, 6), 2, 300, seed=3)
    assert parse_grid(render(state, "grid")) == state


def test_unknown_observation_format_lists_allowed() -> None:
    with pytest.raises(ValueError, match="grid, coord, grid_coord"):
        SokobanEnv(observation_format="image")
    with pytest.raises(ValueError, match="grid, coord, grid_coord"):
        render(parse_grid(ALL_SYMBOLS), "rgb")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dim_room": (2, 6)}, "dim_room"),
        ({"dim_room": "66"}, "dim_room"),
        ({"num_boxes": 0}, "num_boxes"),
        ({"max_steps": 1.5}, "max_steps"),
        ({"dim_room": (3, 4), "num_boxes": 2}, "too few"),
    ],
)
def test_bad_constructor_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SokobanEnv(**kwargs)


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ("#####\n#PXZ#\n#####", "unknown grid symbols"),
        ("#####\n#_XO#\n#####", "one player"),
        ("#####\n#PXO_\n#####", "border"),
        ("#####\n#PXX#\n#O__#\n#####", "as many boxes"),
    ],
)
def test_parse_grid_rejects_bad_rooms(grid: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_grid(grid)


def test_instructions_name_actions_and_symbols() -> None:
    text = SokobanEnv().instructions()
    assert "Up, Down, Left, Right" in text and "√: box on target" in text and "S: player on target" in text


# ---------------------------------------------------------------------------------------------------
# Generation: determinism, validity, solvability
# ---------------------------------------------------------------------------------------------------


def _renders(seeds: range) -> list[str]:
    env = SokobanEnv(dim_room=[6, 6], num_boxes=1)
    return [env.reset(seed) for seed in seeds]


def test_same_seed_same_room_in_process() -> None:
    assert _renders(range(20)) == _renders(range(20))
    assert len(set(_renders(range(20)))) > 10


def test_same_seed_same_room_across_processes_with_different_hash_seeds() -> None:
    code = (
        "import json\nfrom rldynamics.envs.sokoban import SokobanEnv\n"
        "env = SokobanEnv(dim_room=[6, 6])\nprint(json.dumps([env.reset(s) for s in range(20)]))"
    )
    assert all(out == _renders(range(20)) for out in json_under_hash_seeds(code))


@pytest.mark.parametrize(("dim_room", "num_boxes"), [((6, 6), 1), ((7, 7), 2), ((8, 8), 3)])
def test_generated_rooms_are_valid_and_unsolved(dim_room: tuple[int, int], num_boxes: int) -> None:
    for seed in range(50):
        state = generate_puzzle(dim_room, num_boxes, 300, seed)
        assert state.shape == dim_room and len(state.boxes) == len(state.targets) == num_boxes
        assert not state.is_solved() and state.num_env_steps == 0


@pytest.mark.parametrize(("num_boxes", "seeds"), [(2, 1000), (3, 500)])
def test_multi_box_puzzles_start_with_every_box_off_target(num_boxes: int, seeds: int) -> None:
    """As gym_sokoban's generator: no box starts on a target (a start with one there would score its first
    step differently from RAGEN, whose env counts boxes on targets from 0); same puzzle for the same seed."""
    starts = [generate_puzzle((6, 6), num_boxes, 300, seed) for seed in range(seeds)]
    assert sum(len(state.boxes & state.targets) for state in starts) == 0
    assert starts[:50] == [generate_puzzle((6, 6), num_boxes, 300, seed) for seed in range(50)]


def test_default_preset_puzzles_are_pinned() -> None:
    """The default preset's training puzzles of seeds 10000..10100 and its validation puzzles, byte for byte:
    published results depend on them."""
    cfg = make_config()
    o = cfg.env.sokoban
    seeds = [*range(10000, 10101), *range(cfg.val.seed_base, cfg.val.seed_base + cfg.val.env_groups)]
    text = "\n\n".join(render_grid(generate_puzzle(tuple(o.dim_room), o.num_boxes, o.search_depth, s)) for s in seeds)
    assert (o.num_boxes, len(seeds)) == (1, 613)
    digest = "5b80292661711867e30cb9c9cd1b9db0f62aa1aa767b2c61fb774f299271c107"
    assert hashlib.sha256(text.encode()).hexdigest() == digest


@pytest.mark.parametrize(("dim_room", "num_boxes", "seeds"), [((6, 6), 1, 200), ((7, 7), 2, 40)])
def test_solver_solutions_solve_generated_puzzles(dim_room: tuple[int, int], num_boxes: int, seeds: int) -> None:
    env = SokobanEnv(dim_room=dim_room, num_boxes=num_boxes, observation_format="grid")
    for seed in range(seeds):
        env.reset(seed)
        plan = env.solve()
        results = [env.step(action) for action in plan]
        assert plan and env.success(), f"seed {seed}"
        assert results[-1].done and sum(results[-1].reward.values()) == pytest.approx(-0.1 + 1.0 + 10.0)
        assert not any(r.done for r in results[:-1])


def test_solver_is_shortest_and_handles_edge_cases() -> None:
    assert solve(parse_grid("######\n#PX_O#\n######")) == ["Right", "Right"]
    assert solve(parse_grid("#####\n#P_√#\n#####")) == []
    with pytest.raises(ValueError, match="unsolvable"):
        solve(parse_grid("#####\n#__X#\n#P_O#\n#####"))


def test_seed_must_be_non_negative_int() -> None:
    with pytest.raises(ValueError, match="seed"):
        SokobanEnv().reset(-1)


def test_state_invariants_are_checked() -> None:
    state = parse_grid(ALL_SYMBOLS)
    with pytest.raises(ValueError, match="player and a box"):
        SokobanState(state.shape, state.walls, state.targets, state.boxes, player=(1, 2))


# ---------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------


def test_make_env_builds_registered_env() -> None:
    env = make_env("sokoban", dim_room=[6, 6], num_boxes=1)
    assert isinstance(env, SokobanEnv) and isinstance(env, Env) and ENVS["sokoban"] is SokobanEnv


def test_make_env_unknown_name_suggests_and_lists() -> None:
    with pytest.raises(ValueError, match=r"'sokobn'.*Did you mean 'sokoban'.*Registered envs: .*sokoban"):
        make_env("sokobn")


def test_step_penalty_is_configurable():
    env = _env(PUSH_OFF, step_penalty=0.0)
    assert sum(env.step("Down").reward.values()) == 0.0  # an ordinary move costs nothing
    assert _env(PUSH_OFF).step("Down").reward["step"] == pytest.approx(-0.1)
