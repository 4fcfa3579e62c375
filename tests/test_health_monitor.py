"""The health monitor as the trainer runs it (`train/diagnostics/health.py`), on hand-made step
records and a stand-in session (no model): a warning that stops firing writes a `clear` row and
says so, the validation rules read the problem-clustered standard error the validation logged,
optimizer steps without a reward signal stay out of the spike history and are never refused, every
step with refused optimizer steps says how many, and a rollback that cannot happen says why the run
stops."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rldynamics import metric_names as names
from rldynamics.config import make_config
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.train.actor import ActorUpdate
from rldynamics.train.batch_ops import Validation
from rldynamics.train.diagnostics.base import StepRecord
from rldynamics.train.diagnostics.health import Health, signals
from rldynamics.train.update import StepTrace

ENV = "sokoban"  # the default preset's


class Writer:
    def __init__(self):
        self.events: list[dict] = []

    def log_event(self, row: dict) -> None:
        self.events.append(row)


class Console:
    def __init__(self):
        self.lines: list[str] = []

    def print(self, text: str) -> None:
        self.lines.append(text)


def session(run_dir: Path, *overrides: str, attempt: int = 0) -> SimpleNamespace:
    """What the monitor reads of a training session."""
    return SimpleNamespace(cfg=make_config(overrides=list(overrides)), main=True, writer=Writer(),
                           console=Console(), attempt=attempt, run_dir=run_dir, snapshots=None)


def validation(success: float, se: float | None = None, problems: int = 512,
               trajectories: int = 512) -> Validation:
    metrics = {names.val_success(ENV): success}
    if se is not None:
        metrics[names.env_metric(ENV, names.SUCCESS_SE, validation=True)] = se
        metrics[names.env_metric(ENV, names.PROBLEMS, validation=True)] = float(problems)
    return Validation(success, metrics, trajectories=trajectories)


def trace(norm: float, signal: bool = True, skipped: bool = False) -> StepTrace:
    return StepTrace(grad_norm=norm, clipped=False, skipped=skipped, group_grad_sq={},
                     group_update_sq={}, group_weight_sq={}, stats={}, signal=signal)


def update(*steps: StepTrace, ppo_kl: float = 0.0) -> ActorUpdate:
    return ActorUpdate(entropy=1.0, metrics={}, ppo_kl=ppo_kl, clipfrac_high=0.0, clipfrac_low=0.0,
                       kl_loss=None, steps=list(steps))


def record(step: int, **parts) -> StepRecord:
    out = StepRecord(step=step, seed_step=step)
    for k, v in parts.items():
        setattr(out, k, v)
    return out


# --- a warning that stops firing: a clear row, a console line ---

def test_a_warning_that_stops_firing_writes_a_clear_row_and_says_so(tmp_path):
    s = session(tmp_path, "train.steps=100")
    health = Health(s.cfg)
    health.before_training(validation(0.152, se=0.0159))
    health.run(s, record(60, validation=validation(0.160, se=0.0162)))  # 0.35 SE above its start
    health.run(s, record(61))  # no validation: the streak goes on
    health.run(s, record(80, validation=validation(0.250, se=0.0192)))
    rows = [e for e in s.writer.events if e["rule"] == "no_learning"]
    assert [(e["step"], e["action"]) for e in rows] == [(60, "warn"), (80, "clear")]
    cleared = "no_learning no longer fires (it did from step 60)"
    assert rows[1]["since"] == 1 and rows[1]["message"] == cleared
    said = [line for line in s.console.lines if "no_learning" in line]
    assert len(said) == 2 and cleared in said[1]


def test_the_validation_signals_read_the_problem_clustered_standard_error(tmp_path):
    cfg = session(tmp_path).cfg
    x = signals(cfg, record(5, validation=validation(0.3, se=0.04, problems=23, trajectories=100)))
    assert (x.val_success, x.val_count, x.val_se) == (0.3, 100, 0.04)
    assert signals(cfg, record(5, validation=validation(0.3))).val_se is None  # binomial
    one = validation(0.3, se=0.0, problems=1)  # one problem: no clustered SE
    assert signals(cfg, record(5, validation=one)).val_se is None


def test_the_training_success_is_the_rollouts_mean_env_success(tmp_path):
    cfg = session(tmp_path).cfg
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]] * 4, dtype=torch.float)  # [4, 6]
    batch = RolloutBatch(input_ids=torch.arange(24).view(4, 6), attention_mask=torch.ones(4, 6, dtype=torch.long),
                         response_mask=mask, scores=torch.zeros(4), group_ids=torch.tensor([0, 0, 1, 1]),
                         env_metrics=[{names.SUCCESS: v} for v in (1.0, 0.0, 0.0, 1.0)])
    x = signals(cfg, record(3, rollout=batch))
    assert (x.train_success, x.train_count) == (0.5, 4)
    assert (signals(cfg, record(3)).train_success, signals(cfg, record(3)).train_count) == (None, 0)


def test_the_validation_before_training_gives_its_clustered_standard_error(tmp_path):
    s = session(tmp_path, "train.steps=100", "health.no_learning_se=2")
    health = Health(s.cfg)
    health.before_training(validation(0.5, se=0.03, trajectories=100))
    health.run(s, record(60, validation=validation(0.6, se=0.04, trajectories=100)))
    # the limit 0.5 + 2 x hypot(0.03, 0.04) = 0.6, not exceeded; binomial: 0.5 + 2 x 0.07 = 0.64
    [row] = [e for e in s.writer.events if e["rule"] == "no_learning"]
    assert row["threshold"] == pytest.approx(0.6, rel=1e-12)


# --- optimizer steps without a reward signal (all advantages zero) ---

def test_steps_without_reward_signal_stay_out_of_the_spike_history_and_are_not_refused(tmp_path):
    """At a low temperature most groups have equal rewards: their mini-batches' advantages are all
    zero (rounding noise under GRPO) and their gradient norms ~0. A median over them would make
    every real step a spike."""
    s = session(tmp_path, "train.steps=100", "health.grad_spike=skip")
    health = Health(s.cfg)
    quiet = update(trace(1e-4, signal=False), trace(2e-4, signal=False))
    for step in range(1, 7):
        health.run(s, record(step, update=quiet))
    assert not health.guard(trace(1.0))  # no history yet: nothing is a spike
    for step in range(7, 10):
        mixed = update(trace(1.0), trace(3e-4, signal=False), trace(1.2))
        health.run(s, record(step, update=mixed))
    assert health.rules["grad_spike"].norms == [1.0, 1.2] * 3
    assert not health.guard(trace(1.5)) and health.guard(trace(30.0))
    assert not health.guard(trace(30.0, signal=False))  # a step without a reward signal
    assert s.writer.events == [] and s.console.lines == []


def test_every_step_with_refused_optimizer_steps_says_how_many(tmp_path):
    s = session(tmp_path, "train.steps=100", "health.grad_spike=skip")
    health = Health(s.cfg)
    for step in range(1, 4):
        health.run(s, record(step, update=update(trace(1.0), trace(1.1))))
    refused = [trace(50.0, skipped=True), trace(60.0, skipped=True)]
    health.run(s, record(4, update=update(trace(1.0), *refused)))
    health.run(s, record(5, update=update(trace(40.0, skipped=True), trace(1.0))))
    health.run(s, record(6, update=update(trace(1.0))))
    assert [(e["step"], e["action"]) for e in s.writer.events] == [(4, "skip")]  # one per streak
    said = [line for line in s.console.lines if "grad_spike" in line]
    assert len(said) == 2  # every step that refused optimizer steps
    assert "2 optimizer steps refused" in said[0] and "1 optimizer step refused" in said[1]


# --- a rollback that cannot happen ---

DRIFT = ["train.steps=100", "health.policy_drift=rollback"]
NO_CHECKPOINT = "cannot roll back: no checkpoint or state in memory before step 1; stopping"


def drifted(step: int) -> StepRecord:
    return record(step, update=update(trace(1.0), ppo_kl=0.647))


def test_a_rollback_without_a_checkpoint_before_the_trouble_says_why_it_stops(tmp_path):
    s = session(tmp_path, *DRIFT)
    result = Health(s.cfg).run(s, drifted(1))
    assert result.stop == "health_policy_drift" and result.rollback_to is None and result.end_with is None
    [row] = s.writer.events
    assert row["action"] == "stop" and NO_CHECKPOINT in row["message"]
    assert any(NO_CHECKPOINT in line for line in s.console.lines)


def test_a_rollback_with_none_allowed_or_left_says_why_it_stops(tmp_path):
    (tmp_path / "checkpoints" / "step_2").mkdir(parents=True)
    s = session(tmp_path, *DRIFT, "health.max_rollbacks=0")
    assert Health(s.cfg).run(s, drifted(3)).stop == "health_policy_drift"
    ending = "stopping with the state of step 2, from before the trouble, as the last checkpoint"
    none = f"no rollbacks allowed (health.max_rollbacks=0); {ending}"
    assert none in s.writer.events[0]["message"]
    s = session(tmp_path, *DRIFT, "health.max_rollbacks=2", attempt=2)
    result = Health(s.cfg).run(s, drifted(3))
    assert result.stop == "health_policy_drift" and result.rollback_to is None and result.end_with == 2
    left = f"no rollbacks left (health.max_rollbacks=2, all used); {ending}"
    assert left in s.writer.events[0]["message"]
    s = session(tmp_path, *DRIFT)
    result = Health(s.cfg).run(s, drifted(3))
    assert result.stop is None and result.rollback_to == 2  # the step of the checkpoint on disk
    [row] = s.writer.events
    assert row["action"] == "rollback" and "stopping" not in row["message"]
