"""Settings that would train something other than what they seem to are refused before any work,
in one line naming the key, why, and what to set instead."""

from __future__ import annotations

import pytest

from rldynamics.cli import main
from rldynamics.config import ConfigError, make_config


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_relative_estimators_refuse_one_reply_per_prompt(estimator):
    """GRPO with one reply per prompt would train on raw rewards (a singleton group: mean 0, std 1),
    RLOO on nothing (advantage 0)."""
    chosen = f"algo.adv_estimator={estimator}"
    with pytest.raises(ConfigError) as error:
        make_config(overrides=[chosen, "train.group_size=1"])
    message = str(error.value)
    assert "train.group_size=1" in message and chosen in message
    assert ">= 2" in message and "reinforce_pp" in message and "gae" in message
    with pytest.raises(ConfigError, match="analysis.group_size=1"):
        make_config(overrides=[chosen, "analysis.group_size=1"])
    for other in ("gae", "reinforce_pp"):  # a critic's or the batch's baseline: one reply will do
        make_config(overrides=[f"algo.adv_estimator={other}", "train.group_size=1"])


def test_lora_dropout_of_one_is_refused():
    """Dropout 1 drops every adapter input: every gradient is 0."""
    with pytest.raises(ConfigError, match=r"model.lora.dropout=1.0 .*\[0, 1\)"):
        make_config(overrides=["model.lora.rank=4", "model.lora.dropout=1"])
    cfg = make_config(overrides=["model.lora.rank=4", "model.lora.dropout=0.99"])
    assert cfg.model.lora.dropout == 0.99


def test_clip_low_of_one_is_refused_before_any_work(fast_overrides, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"algo.clip_low=1.0 .*\[0, 1\)"):
        make_config(overrides=["algo.clip_low=1"])
    assert main(["train", *fast_overrides, "algo.clip_low=1", "log.name=clip"]) == 2
    captured = capsys.readouterr()
    assert "algo.clip_low" in captured.err and len(captured.err.strip().splitlines()) == 1
    assert "warm start" not in captured.out and not (tmp_path / "runs" / "clip").exists()
    assert make_config(overrides=["algo.clip_low=0.99"]).algo.clip_low == 0.99
