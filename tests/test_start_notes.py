"""Start warnings: a run whose actor can never update, and an env switched away from its preset's, say so in one line."""

from __future__ import annotations

import json

import pytest

from rldynamics.cli import main
from rldynamics.config import make_config
from rldynamics.start_notes import (
    actor_never_updates,
    game_without_sft,
    no_warm_start,
    start_warnings,
    warm_starts,
)


def warnings_of(preset: str, overrides: list[str]) -> list[str]:
    return start_warnings(make_config(preset, None, overrides), preset, None, overrides)


def test_env_switch_names_the_preset_settings_that_still_apply():
    [line] = warnings_of("sokoban-tiny", ["env.name=countdown"])
    assert "\n" not in line and line.startswith("warning: env.name=countdown")
    assert "env.format_penalty=-1.0" in line  # the Sokoban preset's penalty still applies to Countdown
    assert "env.sokoban.*" in line and "--preset countdown-tiny" in line
    [line] = warnings_of("sokoban-tiny", ["env.name=math"])
    assert "none of its shared env settings apply" in line  # math grades the whole reply: no format_penalty
    [line] = warnings_of("math-tiny", ["env.name=sokoban"])
    assert "env.max_turns=1" in line and "env.max_new_tokens=40" in line and "env.math.*" in line


def test_env_switch_leaves_out_what_the_user_set_and_says_nothing_without_a_switch():
    [line] = warnings_of("sokoban-tiny", ["env.name=countdown", "env.format_penalty=-0.5"])
    assert "format_penalty" not in line and "none of its shared env settings apply" in line
    assert warnings_of("sokoban-tiny", []) == []
    assert warnings_of("sokoban-tiny", ["env.name=sokoban"]) == []
    assert warnings_of("countdown-tiny", ["env.countdown.target_range=[1,20]"]) == []


def test_settings_that_never_update_the_actor_are_named():
    line = actor_never_updates(make_config("sokoban-tiny-ppo", None, ["train.steps=2"]))
    assert line.startswith("critic.warmup_steps=20 >= train.steps=2")
    assert "filter.value=0" in actor_never_updates(make_config("sokoban-tiny", None, ["filter.value=0"]))
    kept_nothing = make_config("sokoban-tiny-ppo", None, ["filter.include_zero=false"])  # size 1
    assert "include_zero" in actor_never_updates(kept_nothing)
    for fine in (["train.steps=21"], ["train.steps=0"]):
        assert actor_never_updates(make_config("sokoban-tiny-ppo", None, fine)) is None
    assert actor_never_updates(make_config("sokoban-tiny", None, ["filter.value=0", "filter.prob_mode=softmax"])) is None


@pytest.mark.slow
def test_train_prints_the_warnings_once_at_start_and_the_actor_indeed_never_updates(fast_overrides, capsys, tmp_path):
    code = main(["train", *fast_overrides, "algo.adv_estimator=gae", "critic.warmup_steps=2", "log.name=warm"])
    assert code == 0
    err = capsys.readouterr().err.splitlines()
    warnings = [line for line in err if line.startswith("warning:")]
    assert len(warnings) == 1 and "critic.warmup_steps=2 >= train.steps=2" in warnings[0]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "warm" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["step"] > 0]
    assert trained and all("actor/pg_loss" not in r and r.get("critic/warmup") == 1.0 for r in trained)


def test_a_warm_start_with_no_solver_to_imitate_is_named_and_skipped(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"prompt": "Say 1."}\n')
    prompts = ["env.name=prompts", "env.max_turns=1", f"env.prompts.source={tmp_path / 'x.jsonl'}",
               "env.reward_funcs=[json:dumps]"]
    cfg = make_config(None, None, prompts)
    assert not warm_starts(cfg) and warm_starts(make_config(None, None, []))
    assert "no solver for the tiny model's warm start" in no_warm_start(cfg)
    assert no_warm_start(make_config(None, None, [*prompts, "model.warm_start_episodes=0"])) is None


def test_the_base_smollm2_on_a_game_is_sent_to_rldyn_sft_first(tmp_path):
    assert "rldyn sft --preset" in game_without_sft(make_config("frozenlake-smollm2"))
    tuned = str(tmp_path / "runs" / "fl" / "checkpoints" / "step_31" / "actor")
    assert game_without_sft(make_config("frozenlake-smollm2", overrides=[f"model.path={tuned}"])) is None
    assert "rldyn sft --preset" in game_without_sft(make_config("sokoban-smollm2"))
    assert game_without_sft(make_config("math-smollm2")) is None  # it answers math in format
