"""Countdown env: answer rules on known instances, the safe evaluator on arbitrary text, the solver against a
slow independent search, determinism across processes, rewards through the rollout, the tiny preset trained."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import json_under_hash_seeds
from rldynamics.config import ConfigError, make_config
from rldynamics.envs import ENVS, Env, make_env
from rldynamics.envs.countdown import (
    MAX_ANSWER_CHARS,
    CountdownEnv,
    Instance,
    evaluate,
    generate_instance,
    parse_expression,
    reachable_targets,
    score_answer,
    solve_instance,
)
from rldynamics.rollout.agent import rollout
from rldynamics.train.sft_data import solver_policy

SIX_FOUR_TWO = Instance(numbers=(6, 4, 2), target=3)
RIGHT, WRONG, INVALID = ({"format": 1.0, "correct": 1.0}, {"format": 1.0, "correct": 0.0},
                         {"format": 0.0, "correct": 0.0})


def _env(instance: Instance, **kwargs: object) -> CountdownEnv:
    env = CountdownEnv(**kwargs)
    env.set_instance(instance)
    return env


# ---------------------------------------------------------------------------------------------------
# Rules on a known instance: nums [6, 4, 2], target 3
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "reward", "verdict"),
    [
        ("6 / 2", RIGHT, "Correct"),
        ("6 / 4 * 2", RIGHT, "Correct"),  # exact rationals: 6/4 = 3/2, times 2
        ("  6/4*2 ", RIGHT, "Correct"),
        ("6 /\n4\t* 2", RIGHT, "Correct"),  # newlines and tabs are spaces
        ("((6)) / (2)", RIGHT, "Correct"),
        ("6 / -(2 - 4)", RIGHT, "Correct"),  # unary minus
        ("6 × 2 ÷ 4", RIGHT, "Correct"),  # the printed operator signs
        ("6 * 4 / 2", WRONG, "equals 12, not 3"),
        ("4 - 6", WRONG, "equals -2"),
        ("2 / 4", WRONG, "equals 1/2"),
        ("6 + 6 / 4", INVALID, "uses 6 beyond"),  # a number used twice
        ("6 - 3", INVALID, "uses 3 beyond"),  # a number not given
        ("63 / 21", INVALID, "uses 21, 63 beyond"),  # digits are not glued into new numbers
        ("2 ** 3", INVALID, "only + - * /"),
        ("6 // 2", INVALID, "only + - * /"),
        ("+6 / 2", INVALID, "only + - * /"),  # unary plus is not allowed
        ("6 / 2.0", INVALID, "only digits"),
        ("0x6 / 2", INVALID, "only digits"),
        ("6 / 2 = 3", INVALID, "only digits"),
        ("__import__('os').system('true')", INVALID, "only digits"),
        ("6 / (2", INVALID, "not an arithmetic expression"),
        ("6 2", INVALID, "not an arithmetic expression"),
        ("", INVALID, "empty"),
        (" \n ", INVALID, "empty"),
    ],
)
def test_answers_on_a_known_instance(answer: str, reward: dict, verdict: str) -> None:
    env = _env(SIX_FOUR_TWO)
    result = env.step(answer)
    assert result.reward == reward and result.done and verdict in result.observation
    assert env.success() == (reward == RIGHT)
    assert result.info == {"action_is_effective": reward["format"], "action_is_valid": reward["format"],
                           "success": reward["correct"]}


def test_division_by_zero_is_a_valid_wrong_answer() -> None:
    result = _env(Instance((5, 3, 3), 2)).step("5 / (3 - 3)")
    assert result.reward == WRONG and "undefined (division by zero)" in result.observation
    assert _env(Instance((5, 3, 3), 2)).step("5 - 3 / 3 - 3 + 0 * 0").reward == INVALID  # 0 is not given


def test_numbers_given_twice_may_be_used_twice_and_use_all_requires_every_number() -> None:
    assert _env(Instance((3, 3, 1), 6)).step("3 + 3").reward == RIGHT
    assert _env(Instance((3, 3, 1), 6)).step("3 + 3 + 3").reward == INVALID
    strict = _env(SIX_FOUR_TWO, use_all_numbers=True)
    result = strict.step("6 / 2")
    assert result.reward == INVALID and "does not use 4" in result.observation
    assert _env(SIX_FOUR_TWO, use_all_numbers=True).step("6 / 4 * 2").reward == RIGHT


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ("9" * 100_000, "longer than"),
        ("-(" * 60 + "6" + ")" * 60, "nested deeper"),
        ("-" * 150 + "6", "nested deeper"),
        ("9" * 150 + " * " + "9" * 40, "beyond the given numbers"),  # huge literals: rejected before arithmetic
        ("(" * 100 + ")" * 100, "only + - * /"),  # an empty tuple
    ],
)
def test_huge_and_deep_answers_are_rejected(answer: str, reason: str) -> None:
    reward, verdict = score_answer(answer, SIX_FOUR_TWO)
    assert reward == INVALID and reason in verdict and len(verdict) < 120


def test_redundant_parentheses_are_harmless() -> None:
    assert score_answer("(" * 95 + "6 / 2" + ")" * 95, SIX_FOUR_TWO)[0] == RIGHT  # they make no tree nodes


def test_one_answer_per_episode() -> None:
    env = _env(SIX_FOUR_TWO)
    env.step("6 / 2")
    with pytest.raises(RuntimeError, match="one answer"):
        env.step("6 / 2")
    with pytest.raises(RuntimeError, match="reset"):
        CountdownEnv().step("1 + 2")


# ---------------------------------------------------------------------------------------------------
# The evaluator: random expression trees against their value computed independently; arbitrary text
# ---------------------------------------------------------------------------------------------------

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
        "/": lambda a, b: None if b == 0 else a / b}

_trees = st.recursive(
    st.integers(0, 30),
    lambda sub: st.one_of(st.tuples(st.sampled_from(sorted(_OPS)), sub, sub), st.tuples(st.just("neg"), sub)),
    max_leaves=6,
)


def _render(tree, space: str) -> tuple[str, Fraction | None, list[int]]:
    """Fully parenthesised text, exact value (None after a division by zero) and the leaves of a tree."""
    if isinstance(tree, int):
        return str(tree), Fraction(tree), [tree]
    if tree[0] == "neg":
        text, value, leaves = _render(tree[1], space)
        return f"-({text})", None if value is None else -value, leaves
    (lt, lv, ll), (rt, rv, rl) = _render(tree[1], space), _render(tree[2], space)
    value = None if lv is None or rv is None else _OPS[tree[0]](lv, rv)
    return f"({lt}{space}{tree[0]}{space}{rt})", value, ll + rl


@settings(max_examples=300, deadline=None)
@given(tree=_trees, space=st.sampled_from(["", " ", "\n"]))
def test_random_expressions_evaluate_exactly(tree, space: str) -> None:
    text, value, leaves = _render(tree, space)
    if len(text) > MAX_ANSWER_CHARS:
        return
    assert evaluate(parse_expression(text, leaves, use_all=True)) == value
    target = 7 if value is None or value.denominator != 1 else int(value) + 1
    expected = WRONG if value is None or value != target else RIGHT
    assert score_answer(text, Instance(tuple(leaves), target))[0] == expected


_ARITHMETIC_TEXT = st.text(alphabet="0123456789+-*/() .\n×÷−=e_xj", max_size=80)


@settings(max_examples=400, deadline=None)
@given(text=st.one_of(st.text(max_size=300), _ARITHMETIC_TEXT), use_all=st.booleans())
def test_scoring_arbitrary_text_never_raises(text: str, use_all: bool) -> None:
    reward, verdict = score_answer(text, SIX_FOUR_TWO, use_all=use_all)
    assert reward in (RIGHT, WRONG, INVALID) and verdict and "\n" not in verdict


# ---------------------------------------------------------------------------------------------------
# Solver and generator
# ---------------------------------------------------------------------------------------------------


def _slow_reachable(values: tuple[Fraction, ...]) -> set[Fraction]:
    """Every value of every expression using each of `values` exactly once (pick two, combine, recurse)."""
    out = set(values) if len(values) == 1 else set()
    for i, j in itertools.combinations(range(len(values)), 2):
        a, b, rest = values[i], values[j], tuple(v for k, v in enumerate(values) if k not in (i, j))
        made = {a + b, a - b, b - a, a * b} | ({a / b} if b else set()) | ({b / a} if a else set())
        for value in made:
            out |= _slow_reachable(rest + (value,))
    return out


@pytest.mark.parametrize("numbers", [(2, 3, 4), (1, 1, 7), (6, 4, 2), (5, 5, 5, 1), (3, 8, 9, 2)])
def test_reachable_targets_match_a_slow_independent_search(numbers: tuple[int, ...]) -> None:
    full = _slow_reachable(tuple(map(Fraction, numbers)))
    subsets = set().union(*(_slow_reachable(tuple(map(Fraction, c)))
                            for k in range(1, len(numbers) + 1) for c in itertools.combinations(numbers, k)))

    def ints(values: set[Fraction]) -> list[int]:
        return sorted(int(v) for v in values if v.denominator == 1 and -50 <= v <= 200 and v not in numbers)

    assert reachable_targets(numbers, -50, 200, use_all=True) == ints(full)
    assert reachable_targets(numbers, -50, 200) == ints(subsets)


def test_solver_known_answers() -> None:
    assert solve_instance((2, 3, 4), 20) == "(2 + 3) * 4"
    assert solve_instance((1, 5, 5, 5), 24, use_all=True) == "(5 - 1 / 5) * 5"  # needs a fraction on the way
    assert solve_instance((6, 4, 2), 3) == "6 / 2"  # fewest numbers first
    assert solve_instance((1, 1), 5) is None


@pytest.mark.parametrize(
    ("knobs", "seeds"),
    [({}, 40), ({"num_numbers": [2, 2], "number_range": [1, 9], "target_range": [1, 30]}, 40),
     ({"num_numbers": [4, 4], "number_range": [1, 13], "target_range": [24, 24], "use_all_numbers": True}, 40),
     ({"num_numbers": [5, 5], "number_range": [1, 1000], "target_range": [-100, 1000]}, 4)],
)
def test_every_generated_instance_is_solved_by_the_solver(knobs: dict, seeds: int) -> None:
    env = CountdownEnv(**knobs)
    for seed in range(seeds):
        env.reset(seed)
        inst = env.get_instance()
        assert env.num_numbers[0] <= len(inst.numbers) <= env.num_numbers[1]
        assert all(env.number_range[0] <= n <= env.number_range[1] for n in inst.numbers)
        assert env.target_range[0] <= inst.target <= env.target_range[1] and inst.target not in inst.numbers
        result = env.step(env.solve()[0])
        assert result.reward == RIGHT and env.success(), (seed, inst, env.solve())


def test_generation_that_cannot_succeed_says_which_knob() -> None:
    with pytest.raises(RuntimeError, match="widen target_range"):
        CountdownEnv(num_numbers=[2, 2], number_range=[1, 2], target_range=[50, 60]).reset(0)


def _observations(seeds: range) -> list[str]:
    env = CountdownEnv()
    return [env.reset(seed) + " -> " + env.solve()[0] for seed in seeds]


def test_same_seed_same_instance_across_processes_with_different_hash_seeds() -> None:
    generate_instance.cache_clear()
    here = _observations(range(20))
    assert len(set(here)) == 20 and here[0].startswith("Target: ")
    code = ("import json\nfrom rldynamics.envs.countdown import CountdownEnv\nenv = CountdownEnv()\n"
            "print(json.dumps([env.reset(s) + ' -> ' + env.solve()[0] for s in range(20)]))")
    assert all(out == here for out in json_under_hash_seeds(code))


def test_random_actions_are_valid_and_seeded() -> None:
    env = CountdownEnv()
    env.reset(3)
    first = [env.random_action(random.Random(7)) for _ in range(3)]
    assert len(set(first)) == 1  # the same rng state gives the same answer
    rng = random.Random(0)
    answers = [env.random_action(rng) for _ in range(50)]
    assert all(score_answer(a, env.get_instance())[0]["format"] == 1.0 for a in answers)
    assert len(set(answers)) > 10


# ---------------------------------------------------------------------------------------------------
# Registry, config, rollout rewards, training
# ---------------------------------------------------------------------------------------------------


def test_registered_and_configurable() -> None:
    env = make_env("countdown", num_numbers=[2, 3])
    assert isinstance(env, Env) and ENVS["countdown"] is CountdownEnv and env.actions == ()
    cfg = make_config("countdown-tiny")
    assert cfg.env.name == "countdown" and cfg.env.max_turns == 1
    with pytest.raises(ConfigError, match=r"env.countdown: num_numbers must be .* 2 <= lo <= hi <= 5"):
        make_config("countdown-tiny", overrides=["env.countdown.num_numbers=[3,9]"])
    with pytest.raises(ConfigError, match=r"number_range must be .* 1 <= lo <= hi"):
        make_config("countdown-tiny", overrides=["env.countdown.number_range=[5,1]"])
    with pytest.raises(ConfigError, match="env.sokoban.num_boxes .* key of env 'sokoban'"):
        make_config("countdown-tiny", overrides=["env.sokoban.num_boxes=2"])


@pytest.fixture(scope="module")
def tokenizer():
    from rldynamics.models.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer(["Target: 1, nums: [2, 3] <answer>2 + 3</answer>"])


def test_rollout_scores_reproduce_ragen_scale(tokenizer) -> None:
    """Correct 1.0, valid but wrong 0.1, invalid 0, no <answer> tags -0.1 (format_penalty)."""
    cfg = make_config("countdown-tiny", overrides=["env.format_penalty=-0.1"])
    env = CountdownEnv(**cfg.env.options())
    env.reset(0)
    one_number = env.get_instance().numbers[0]  # valid, and wrong: the target is never a given number
    replies = [f"<answer>{env.solve()[0]}</answer>", f"<answer>{one_number}</answer>", "<answer>1 +</answer>",
               "no tags"]
    closing = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    batch = rollout(None, tokenizer, [0], 4, cfg.env, respond=lambda trajs: [
        tokenizer(r, add_special_tokens=False)["input_ids"] + closing for r in replies])
    assert batch.reward_names == ("format", "correct", "format_penalty")
    assert batch.scores.tolist() == pytest.approx([1.0, 0.1, 0.0, -0.1])
    assert [m["success"] for m in batch.env_metrics] == [1.0, 0.0, 0.0, 0.0]


@settings(max_examples=30, deadline=None)
@given(texts=st.lists(st.one_of(st.text(max_size=60), _ARITHMETIC_TEXT.map(lambda t: f"<answer>{t}</answer>")),
                      min_size=1, max_size=3))
def test_rollout_on_arbitrary_replies_never_raises(tokenizer, texts: list[str]) -> None:
    cfg = make_config("countdown-tiny")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    batch = rollout(None, tokenizer, [5], 3, cfg.env, respond=lambda trajs: [
        tokenizer(texts[i % len(texts)], add_special_tokens=False)["input_ids"] + [eos] for i in range(len(trajs))])
    assert {round(s, 6) for s in batch.scores.tolist()} <= {1.0, 0.1, 0.0, cfg.env.format_penalty}


def test_solver_demonstrations_and_their_noise(tokenizer) -> None:
    cfg = make_config("countdown-tiny")
    clean = rollout(None, tokenizer, list(range(10)), 1, cfg.env,
                    respond=solver_policy(tokenizer, cfg.env, 0.0, random.Random(0)))
    assert clean.scores.tolist() == [1.0] * 10
    noisy = rollout(None, tokenizer, list(range(40)), 1, cfg.env,
                    respond=solver_policy(tokenizer, cfg.env, 1.0, random.Random(0)))
    assert all(s in (pytest.approx(0.1), 1.0) for s in noisy.scores.tolist())  # random but valid expressions
    assert noisy.scores.mean() < 0.6


def test_tiny_preset_trains(fast_overrides) -> None:
    from rldynamics.tracking.run_dir import read_metrics
    from rldynamics.train.trainer import train

    run = train(make_config("countdown-tiny", overrides=[*fast_overrides, "log.name=countdown",
                                                         "env.max_new_tokens=12"]))
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert {"reward/format/mean", "reward/correct/zero_std_group_frac", "train/countdown/success"} <= set(rows[1])
    assert 0.0 <= rows[2]["val-env/countdown/success"] <= 1.0
