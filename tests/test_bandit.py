"""Bandit env: payoffs and success on known arms, RAGEN's arm names and odds, determinism across processes,
the rollout on arbitrary text, the tiny preset end to end."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import json_under_hash_seeds
from rldynamics.config import ConfigError, make_config
from rldynamics.envs import ENVS
from rldynamics.envs.bandit import RAGEN_PAIRS, BanditEnv


def test_safe_arm_pays_its_fixed_payoff_and_misses_success() -> None:
    env = BanditEnv(arm_pairs=[["Clerk", "Pilot"]])
    observation = env.reset(0)
    assert set(env.actions) == {"Clerk", "Pilot"} and f"{env.actions[0]} and {env.actions[1]}" in observation
    result = env.step("Clerk")
    assert result.reward == {"payoff": 0.1} and result.done and result.observation == "Clerk: 0.1 points"
    assert not env.success() and result.info == {"action_is_effective": 1.0, "action_is_valid": 1.0, "success": 0.0}
    with pytest.raises(RuntimeError, match="already pulled"):
        env.step("Pilot")


@pytest.mark.parametrize(("hit_prob", "payoff"), [(1.0, 5.0), (0.0, -1.0)])
def test_risky_arm_pays_hit_or_miss(hit_prob: float, payoff: float) -> None:
    env = BanditEnv(arm_pairs=[["Clerk", "Pilot"]], risky_payoff=5.0, risky_miss_payoff=-1.0, risky_hit_prob=hit_prob,
                    safe_payoff=0.5)
    for seed in range(10):
        env.reset(seed)
        assert env.step("Pilot").reward == {"payoff": payoff}
        assert env.success() == (hit_prob == 1.0)  # the better arm: risky at mean 5, safe (0.5) at mean -1


def test_ragen_defaults_odds_and_names() -> None:
    env = BanditEnv()
    pairs, first, hits = Counter(), Counter(), 0
    n = 2000
    for seed in range(n):
        env.reset(seed)
        pairs[(env.safe, env.risky)] += 1
        first[env.actions[0] == env.risky] += 1
        assert env.solve() == [env.risky]
        payoff = env.step(env.risky).reward["payoff"]
        assert payoff in (0.0, 1.0) and env.success()
        hits += payoff == 1.0
    assert set(pairs) == set(RAGEN_PAIRS["train"]) and min(pairs.values()) > n / 12 / 2
    assert abs(hits / n - 0.25) < 4 * (0.25 * 0.75 / n) ** 0.5
    assert abs(first[True] / n - 0.5) < 4 * (0.25 / n) ** 0.5


def test_group_members_share_the_payoff_draw() -> None:
    a, b = BanditEnv(), BanditEnv()
    for seed in range(50):
        a.reset(seed), b.reset(seed)
        assert a.actions == b.actions and a.step(a.risky).reward == b.step(b.risky).reward


def test_test_split_and_case_insensitive_actions_through_the_parser() -> None:
    from rldynamics.rollout.parse import parse_response

    env = BanditEnv(split="test")
    env.reset(3)
    assert (env.safe, env.risky) in RAGEN_PAIRS["test"]
    parsed = parse_response(f"<answer> {env.risky.upper()} </answer>", env.actions, max_actions=1)
    assert parsed.actions == [env.risky] and parsed.format_ok


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"split": "val"}, "unknown split"), ({"arm_pairs": [["A"]]}, "pairs"), ({"arm_pairs": [["A", "a"]]}, "different"),
     ({"arm_pairs": [["A", " B"]]}, "outer spaces"), ({"arm_pairs": [["A||B", "C"]]}, "'\\|\\|'"),
     ({"risky_hit_prob": 2}, "risky_hit_prob"), ({"safe_payoff": 0.25}, "both arms have expected payoff 0.25")],
)
def test_bad_constructor_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BanditEnv(**kwargs)


def test_bad_config_value_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="env.bandit.*unknown split"):
        make_config(overrides=["env.name=bandit", "env.bandit.split=dev"])
    cfg = make_config(overrides=["env.name=bandit", "env.bandit.arm_pairs=[[Clerk,Pilot]]"])
    assert ENVS["bandit"](**cfg.env.options()).pairs == (("Clerk", "Pilot"),)


def test_unknown_arm_and_missing_reset() -> None:
    env = BanditEnv()
    with pytest.raises(RuntimeError, match="reset"):
        env.step("Teacher")
    env.reset(0)
    other = next(name for name in env.pairs[-1] if name not in env.actions)
    with pytest.raises(ValueError, match="unknown arm"):
        env.step(other)


def _episodes(seeds: range) -> list:
    env = BanditEnv()
    out = []
    for seed in seeds:
        out.append(env.reset(seed))
        out.append(env.step(env.actions[0]).observation)
    return out


def test_same_seed_same_episode_across_processes() -> None:
    code = (
        "import json\nfrom rldynamics.envs.bandit import BanditEnv\nenv = BanditEnv()\nout = []\n"
        "for s in range(40):\n    out.append(env.reset(s))\n    out.append(env.step(env.actions[0]).observation)\n"
        "print(json.dumps(out))"
    )
    assert all(out == _episodes(range(40)) for out in json_under_hash_seeds(code))


@pytest.fixture(scope="module")
def tokenizer():
    from rldynamics.models.tiny import build_tiny_tokenizer
    from rldynamics.train.warmstart import tiny_corpus

    return build_tiny_tokenizer(tiny_corpus(make_config("bandit-tiny").env, num_seeds=20))


NAMES = st.sampled_from(["<answer>", "</answer>", "||", "Teacher", "trader", " Pilot ", "Nurse", "<|im_end|>", "x"])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.text(max_size=40), st.lists(NAMES, max_size=10).map("".join)), st.integers(0, 10_000))
def test_rollout_never_raises_on_arbitrary_replies(tokenizer, reply: str, seed: int) -> None:
    from rldynamics.rollout.agent import rollout

    cfg = make_config("bandit-tiny")
    ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    batch = rollout(None, tokenizer, [seed], 2, cfg.env, respond=lambda trajs: [ids for _ in trajs])
    payoff, penalty = batch.reward_components[:, 0], batch.reward_components[:, 1]
    assert batch.reward_names == ("payoff", "format_penalty") and len(batch) == 2
    assert ((payoff == 0) | (payoff == 1) | (payoff - 0.1).abs().lt(1e-6)).all()
    assert ((penalty == 0) | (penalty == cfg.env.format_penalty)).all()


def test_bandit_tiny_preset_trains(fast_overrides) -> None:
    from rldynamics.train.trainer import train

    cfg = make_config("bandit-tiny", overrides=[*fast_overrides, "env.max_turns=1", "log.name=bandit"])
    run = train(cfg)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert {"reward/payoff/mean", "reward/payoff/zero_std_group_frac", "train/bandit/success"} <= set(rows[1])
    assert rows[1]["train/bandit/num_turns"] == 1.0 and "val-env/bandit/success" in rows[2]
