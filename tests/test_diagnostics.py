"""The step's diagnostics (`train/diagnostics/`): the table, the reply-length diagnostic on hand-made masks, and a
diagnostic added as one class and one table entry with the step loop untouched (due steps, needs, metrics,
state saved with the checkpoint and restored on resume)."""

from __future__ import annotations

import json

import pytest
import torch

from rldynamics.config import make_config
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.tracking.run_dir import read_metrics
from rldynamics.train import diagnostics
from rldynamics.train.diagnostics import DIAGNOSTICS, build_diagnostics, diagnostic_states
from rldynamics.train.diagnostics.base import POINTS, Diagnostic, DiagnosticResult, Needs, StepRecord
from rldynamics.train.diagnostics.lengths import ReplyLengths
from rldynamics.train.trainer import train


def test_the_table_names_each_diagnostic_by_its_own_name_at_a_known_point():
    for name, cls in DIAGNOSTICS.items():
        assert cls.name == name and cls.point in POINTS


def _batch(spans: list[list[tuple[int, int]]], width: int = 16) -> RolloutBatch:
    mask = torch.zeros(len(spans), width)
    for row, runs in enumerate(spans):
        for start, end in runs:
            mask[row, start:end] = 1.0
    n = len(spans)
    return RolloutBatch(torch.zeros(n, width, dtype=torch.long), torch.ones(n, width, dtype=torch.long), mask,
                        scores=torch.zeros(n), group_ids=torch.zeros(n, dtype=torch.long))


def test_reply_lengths_count_each_turn_and_the_replies_at_the_cap():
    cfg = make_config(overrides=["env.max_new_tokens=5"])
    # row 0: two turns of 3 and 5 tokens (the second at the cap); row 1: one turn of 5 (at the cap); row 2: 2 tokens
    record = StepRecord(step=1, seed_step=1, rollout=_batch([[(2, 5), (8, 13)], [(1, 6)], [(0, 2)]]))
    metrics = ReplyLengths(cfg).run(None, record).metrics
    assert metrics == {"response_length/clip_ratio": pytest.approx(2 / 4),
                       "response_length/reply_mean": pytest.approx((3 + 5 + 5 + 2) / 4),
                       "response_length/reply_max": 5.0}
    assert ReplyLengths(cfg).run(None, StepRecord(1, 1, rollout=_batch([[]]))).metrics == {}


def test_the_rollout_policy_log_probs_come_from_the_pass_or_else_the_update():
    from rldynamics.analysis.objective import ActorInputs
    from rldynamics.train.actor import ActorUpdate
    from rldynamics.train.prepare import Prepared

    passed, own = torch.full((1, 2), -1.0), torch.full((1, 2), -2.0)
    record = StepRecord(1, 1, prepared=Prepared(ActorInputs(old_logprobs=passed, advantages=torch.zeros(1, 2)),
                                                None, None, None))
    assert record.rollout_policy_logprobs() is passed
    record.prepared.inputs.old_logprobs = None
    assert record.rollout_policy_logprobs() is None
    record.update = ActorUpdate(entropy=0.0, metrics={}, ppo_kl=0.0, clipfrac_high=0.0, clipfrac_low=0.0, kl_loss=None,
                                logprobs=own)
    assert record.rollout_policy_logprobs() is own


class Counter(Diagnostic):
    """A diagnostic defined outside the package: due on even steps, asks for the old-log-prob pass, counts its runs."""

    name, point = "counter", "end"
    runs: list[tuple[int, bool]] = []  # (step, whether the old-log-prob pass ran), across instances

    def __init__(self, cfg):
        super().__init__(cfg)
        self.count = 0

    @staticmethod
    def enabled(cfg) -> bool:
        return True

    def due(self, step: int) -> bool:
        return step % 2 == 0

    def needs(self, step: int) -> Needs:
        return Needs(old_logprobs=True)

    def run(self, s, record: StepRecord) -> DiagnosticResult:
        self.count += 1
        Counter.runs.append((record.step, record.prepared.inputs.old_logprobs is not None))
        return DiagnosticResult({"counter/count": float(self.count)})

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state.get("count", 0)


def test_a_diagnostic_is_one_class_and_one_entry(fast_overrides, tmp_path, monkeypatch):
    """Added to `DIAGNOSTICS` alone: it runs on its due steps at its point, gets the pass it asked for, logs its
    metrics, and its state is saved with each checkpoint and restored by a resumed run."""
    monkeypatch.setitem(DIAGNOSTICS, "counter", Counter)
    Counter.runs = []
    common = [*fast_overrides, f"log.run_dir={tmp_path}", "log.name=c", "val.every=0", "checkpoint.every=2",
              "train.mini_batch_size=4", "train.ppo_epochs=1"]  # one pass on the rollout policy: only the
    # diagnostic's need makes the old-log-prob pass run
    run = train(make_config(overrides=[*common, "train.steps=2"]))
    state = json.loads((run / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert state["diagnostics"]["counter"] == {"count": 1}
    train(make_config(overrides=[*common, "train.steps=4", "checkpoint.resume=latest"]))
    assert Counter.runs == [(2, True), (4, True)]
    rows = {r["step"]: r for r in read_metrics(run)}
    assert "counter/count" not in rows[1] and "counter/count" not in rows[3]
    assert [("timing_s/old_log_prob" in rows[k]) for k in (1, 2, 3, 4)] == [False, True, False, True]
    assert rows[2]["counter/count"] == 1.0 and rows[4]["counter/count"] == 2.0  # the count went on after resume
    assert "timing_s/counter" in rows[4]


def test_checkpoints_from_before_the_diagnostics_key_restore_the_collapse_ema():
    cfg = make_config(overrides=["collapse.enabled=true"])
    ema = {"collapse_first_turn_sample": {"std": 0.5}}
    (collapse,) = [d for d in build_diagnostics(cfg, {"step": 3, "collapse_ema": ema}) if d.name == "collapse"]
    assert collapse.ema == ema and collapse.ema is not ema
    assert diagnostic_states(build_diagnostics(cfg, {"diagnostics": {"collapse": {"ema": ema}}}))["collapse"] == {
        "ema": ema}
    assert "collapse" not in {d.name for d in build_diagnostics(make_config())}
    assert diagnostics.DIAGNOSTICS["collapse"].enabled(cfg)
