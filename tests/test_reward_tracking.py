"""Reward tracking: rewards.jsonl rows per trajectory, reward_stats/* per step, resume, crash-cut last lines;
and the math-tiny preset end to end in CI size."""

from __future__ import annotations

import json

import pytest

from rldynamics.config import make_config
from rldynamics.rollout.rewards import reward_stats
from rldynamics.tracking.run_dir import read_metrics, read_rewards
from rldynamics.train.trainer import train


def test_math_tiny_end_to_end(fast_overrides):
    run = train(make_config("math-tiny", overrides=[*fast_overrides, "log.name=m", "analysis.enabled=true"]))
    metrics = read_metrics(run)
    assert [r["step"] for r in metrics] == [0, 1, 2]
    assert "val-env/math/success" in metrics[0] and "grad_norm/all/task" in metrics[1]  # analysis on at step 1
    assert "reward_grad/all/norm/correctness" in metrics[1] and (run / "analysis/step_1/reward_grad.json").is_file()
    rows = read_rewards(run)
    assert [r["step"] for r in rows] == [1] * 4 + [2] * 4  # 2 groups x 2 trajectories per step
    assert [r["traj"] for r in rows[:4]] == [0, 1, 2, 3] and [r["group"] for r in rows[:4]] == [0, 0, 1, 1]
    assert rows[0]["prompt"] == rows[1]["prompt"] == 10000 and rows[2]["prompt"] == 10001  # train.seed_base
    weights = {"correctness": 0.34, "format": 0.33, "length": 0.33}
    for r in rows:
        assert set(r["reward"]) == set(weights)
        assert r["weighted"] == {k: pytest.approx(weights[k] * v) for k, v in r["reward"].items()}
        assert r["total"] == pytest.approx(sum(r["weighted"].values()), abs=1e-6)
        assert r["correct"] == (r["reward"]["correctness"] == 1.0)
        assert 1 <= r["response_tokens"] <= 8 and r["response_chars"] >= 0
    for step in (1, 2):
        stats = {k: v for k, v in metrics[step].items() if k.startswith("reward_stats/")}
        assert stats == pytest.approx(reward_stats([r for r in rows if r["step"] == step], tuple(weights)))
        assert stats["reward_stats/total_samples"] == 4 and "reward_stats/format_valid_count" in stats
        assert stats["reward_stats/avg_correctness"] == metrics[step]["reward/correctness/mean"]


def test_reward_stats_by_hand():
    rows = [{"reward": {"correctness": 1.0, "format": 0.4}, "response_chars": 10, "correct": True},
            {"reward": {"correctness": 0.0, "format": 0.0}, "response_chars": 30, "correct": False},
            {"reward": {"correctness": 0.0, "format": 0.9}, "response_chars": 20, "correct": False}]
    assert reward_stats(rows, ("correctness", "format")) == {
        "reward_stats/avg_correctness": pytest.approx(1 / 3), "reward_stats/avg_format": pytest.approx(1.3 / 3),
        "reward_stats/avg_actual_length": 20.0, "reward_stats/correct_count": 1.0,
        "reward_stats/format_valid_count": 2.0, "reward_stats/total_samples": 3.0}
    no_format = reward_stats([{**r, "reward": {"box": 1.0}} for r in rows], ("box",))
    assert "reward_stats/format_valid_count" not in no_format and no_format["reward_stats/avg_box"] == 1.0


def test_every_env_is_tracked_and_resume_drops_later_rows(fast_overrides):
    """Sokoban too; a resume drops rows after the checkpoint, including a crash-cut last line."""
    common = [*fast_overrides, "log.name=r", "algo.adv_estimator=grpo"]
    run = train(make_config(overrides=common))
    rows = read_rewards(run)
    assert len(rows) == 8 and set(rows[0]["reward"]) == {"step", "box", "solved", "format_penalty"}
    assert "reward_stats/avg_box" in read_metrics(run)[1]
    with open(run / "rewards.jsonl", "a") as f:  # a step 3 that crashed while writing its rows
        f.write(json.dumps({**rows[0], "step": 3}) + "\n" + json.dumps({**rows[1], "step": 3})[:25])
    assert [r["step"] for r in read_rewards(run)][-1] == 3  # the cut line is skipped by the reader
    train(make_config(overrides=[*common, "train.steps=3", "checkpoint.resume=latest"]))
    resumed = read_rewards(run)
    assert [r["step"] for r in resumed] == [1] * 4 + [2] * 4 + [3] * 4
    assert resumed[:8] == rows


def test_reader_tolerates_only_a_cut_last_line(tmp_path):
    (tmp_path / "rewards.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"ste')
    assert read_rewards(tmp_path) == [{"step": 1}, {"step": 2}]
    (tmp_path / "rewards.jsonl").write_text('{"step": 1}\n{"ste\n{"step": 2}\n')
    with pytest.raises(ValueError, match="rewards.jsonl: line 2 is not valid JSON"):
        read_rewards(tmp_path)
    with pytest.raises(FileNotFoundError, match="rewards.jsonl not found"):
        read_rewards(tmp_path / "nothing")
