"""Held-out problems (`val.held_out`, envs/split.py): validation shares no problem with training, by content, and its
standard error counts distinct problems (train/batch_ops.py)."""

from __future__ import annotations

import json
import statistics

import pytest

from rldynamics import metric_names as names
from rldynamics.config import make_config
from rldynamics.envs.split import env_first_observation, on_validation_side, problem_key, side_seeds
from rldynamics.tracking.run_dir import read_metrics
from rldynamics.train.batch_ops import clustered_se, env_seeds, train_seeds, val_seeds
from rldynamics.train.trainer import train
from rldynamics.train.warmstart import demo_seeds, warm_start_key


def _keys(first, seeds):
    return {problem_key(first(s)) for s in seeds}


def test_math_smollm2_validation_problems_are_never_trained_on():
    cfg = make_config("math-smollm2")
    assert cfg.val.held_out > 0
    first = env_first_observation(cfg.env.name, cfg.env.options())
    val = env_seeds(cfg, val_seeds(cfg.val.seed_base, cfg.val.env_groups), validation=True)
    trained = [s for step in range(1, 201) for s in env_seeds(cfg, train_seeds(cfg.train.seed_base, 4, step))]
    val_keys, train_keys = _keys(first, val), _keys(first, trained)
    assert not val_keys & train_keys
    assert len(val_keys | train_keys) >= 78  # of 81 (1..9 + 1..9): nearly every problem is drawn on its side
    assert 15 <= len(val_keys) <= 35  # about 30 % of 81
    # without the split the two overlap, as RAGEN's seeding does on a small problem space
    plain = make_config("math-smollm2", overrides=["val.held_out=0"])
    assert env_seeds(plain, [5, 6]) == [5, 6]
    assert _keys(first, val_seeds(123, 96)) & _keys(first, range(120))


def test_a_problem_is_on_one_side_whatever_seed_reaches_it():
    cfg = make_config("math-smollm2")
    first = env_first_observation(cfg.env.name, cfg.env.options())
    by_text: dict[str, set[bool]] = {}
    for seed in range(2000):
        text = first(seed)
        by_text.setdefault(text, set()).add(on_validation_side(problem_key(text), 0.3))
    assert all(len(sides) == 1 for sides in by_text.values())
    moved = side_seeds(first, list(range(50)), 0.3, validation=False)
    assert all(not on_validation_side(problem_key(first(s)), 0.3) for s in moved)
    assert [s for s in range(50) if s in moved] == [s for s in range(50) if not on_validation_side(
        problem_key(first(s)), 0.3)]  # seeds already on their side are kept


def test_an_env_with_one_problem_cannot_be_split():
    side = on_validation_side(problem_key("the same board"), 0.5)
    assert side_seeds(lambda seed: "the same board", [0], 0.5, validation=side) == [0]  # it is on one side...
    with pytest.raises(ValueError, match=r"val.held_out=0.5: .*one problem only.*val.held_out=0"):
        side_seeds(lambda seed: "the same board", [0], 0.5, validation=not side)  # ...and never on the other


def test_clustered_standard_error_by_hand():
    # two problems drawn twice each, one always solved, one never: mean 0.5; per-problem sums of deviations +1, -1;
    # CR1: sqrt(2 / 1 * (1 + 1)) / 4 = 0.5, twice the binomial sqrt(0.25 / 4) that treats the four as independent
    assert clustered_se([1, 1, 0, 0], ["a", "a", "b", "b"]) == pytest.approx(0.5)
    values = [1, 0, 1, 1, 0, 1, 0, 0, 1]
    assert clustered_se(values, [str(i) for i in range(9)]) == pytest.approx(statistics.stdev(values) / 3)
    assert clustered_se([1, 0, 1], ["a", "a", "a"]) == 0.0


def test_a_run_with_held_out_problems_logs_their_count_and_standard_error(fast_overrides):
    run = train(make_config(overrides=[*fast_overrides, "log.name=held", "val.held_out=0.5", "val.env_groups=12",
                                       "val.group_size=2"]))
    cfg = make_config(overrides=[*fast_overrides, "val.held_out=0.5", "val.env_groups=12"])
    first = env_first_observation(cfg.env.name, cfg.env.options())
    val_keys = _keys(first, env_seeds(cfg, val_seeds(cfg.val.seed_base, 12), validation=True))
    trained = {json.loads(line)["prompt"] for line in (run / "rewards.jsonl").read_text().splitlines()}
    assert trained and not _keys(first, trained) & val_keys
    row = read_metrics(run)[0]
    assert row[names.env_metric("sokoban", names.PROBLEMS, validation=True)] == len(val_keys)
    assert row[names.env_metric("sokoban", names.SUCCESS_SE, validation=True)] >= 0


def test_the_tiny_models_warm_start_never_demonstrates_a_validation_problem():
    cfg = make_config("countdown-tiny")
    first = env_first_observation(cfg.env.name, cfg.env.options())
    val_keys = _keys(first, env_seeds(cfg, val_seeds(cfg.val.seed_base, cfg.val.env_groups), validation=True))
    assert val_keys and not _keys(first, demo_seeds(cfg)) & val_keys
    plain = make_config("countdown-tiny", overrides=["val.held_out=0"])
    assert _keys(first, demo_seeds(plain)) & val_keys  # without the split the demonstrations include them
    assert warm_start_key("base", cfg) != warm_start_key("base", plain)  # and the two are cached apart
