"""One update phase for training and replay (`train/stages.py` `update_phase`): a changed decision of the phase is
followed by replay with no edit to replay; a record written by an earlier version still replays; and the step,
the set-up and the commands name no diagnostic (each diagnostic owns what it needs)."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from rldynamics.config import make_config
from rldynamics.tracking.step_records import RecordedStep, record_path
from rldynamics.train import stages
from rldynamics.train.diagnostics import DIAGNOSTICS
from rldynamics.train.replay import replay_command
from rldynamics.train.trainer import train

SRC = Path(__file__).resolve().parents[1] / "src" / "rldynamics"
ONE_PASS = ["train.mini_batch_size=64", "train.ppo_epochs=1"]  # one optimizer step on the rollout policy
DATA = Path(__file__).parent / "data" / "record_v1"


def _run(fast_overrides, name: str) -> Path:
    return train(make_config(overrides=[*fast_overrides, *ONE_PASS, f"log.name={name}", "record.every=1",
                                        "checkpoint.every=1", "val.every=0"]))


def _replay(run: Path) -> dict:
    replay_command(run, 2, [])
    return json.loads((run / "replays" / "step_2" / "replay.json").read_text())


def test_replay_follows_a_changed_decision_of_the_update_phase(fast_overrides, monkeypatch):
    """The old-log-prob pass made to run on a single-pass step 2 (a decision of `plan_update` alone): the record
    says it ran, and the replay runs it too, with the same weights; with the decision as it was, the replay of
    the same record does not run it. The actor held back at step 2: neither the step nor its replay updates."""
    plan = stages.plan_update

    def old_pass_at_2(cfg, step, rows, needs):
        p = plan(cfg, step, rows, needs)
        return replace(p, old_pass=True, keep_logprobs=False) if step == 2 else p

    monkeypatch.setattr(stages, "plan_update", old_pass_at_2)
    run = _run(fast_overrides, "old_pass")
    assert RecordedStep.read(record_path(run, 2)).old_logprobs_pass is True
    assert RecordedStep.read(record_path(run, 1)).old_logprobs_pass is False
    summary = _replay(run)
    assert summary["old_logprobs_pass"] == {"recorded": True, "replayed": True}
    assert summary["weights_identical"] is True and summary["metrics_identical"] is True
    monkeypatch.setattr(stages, "plan_update", plan)
    assert _replay(run)["old_logprobs_pass"] == {"recorded": True, "replayed": False}

    monkeypatch.setattr(stages, "plan_update", lambda cfg, step, rows, needs: replace(
        plan(cfg, step, rows, needs), actor=step != 2))
    run = _run(fast_overrides, "held_back")
    assert RecordedStep.read(record_path(run, 2)).update_steps is None
    assert _replay(run)["actor_updated"] == {"recorded": False, "replayed": False}


def test_a_record_written_by_the_first_format_still_reads_and_replays(tiny_cache, monkeypatch, tmp_path):
    """`tests/data/record_v1`: step 1 of a run recorded by the version before the typed record (format
    rldynamics-step-record/1). It reads into the typed record and replays from the base model with the same kept
    rows and losses (bit-identical weights on the machine that wrote it; other CPUs may round differently)."""
    monkeypatch.setenv("RLDYN_CACHE", tiny_cache)
    run = tmp_path / "v1"
    shutil.copytree(DATA, run)
    record = RecordedStep.read(record_path(run, 1))
    assert record.step == 1 and record.rows == len(record.env_seeds) and record.update_steps
    replay_command(run, 1, [])
    summary = json.loads((run / "replays" / "step_1" / "replay.json").read_text())
    assert summary["kept_rows_identical"] is True
    for key, m in summary["metrics"].items():
        assert m["replayed"] == pytest.approx(m["recorded"], rel=1e-3, abs=1e-6), key


def test_a_record_of_an_unknown_format_is_refused_in_one_line(tmp_path):
    from rldynamics.tracking.step_records import RecordError, read_record, write_record

    tensors, meta = read_record(record_path(DATA, 1))
    meta = {k: v for k, v in meta.items() if k not in ("format", "step")}
    path = write_record(tmp_path, 1, tensors, meta)
    data = path.read_bytes().replace(b"rldynamics-step-record/1", b"rldynamics-step-record/9")
    path.write_bytes(data)
    with pytest.raises(RecordError, match=r"newer rldynamics .* format 'rldynamics-step-record/9'; this version reads "
                                          r"rldynamics-step-record/1"):
        RecordedStep.read(path)


STEP_FILES = ("train/trainer.py", "train/stages.py", "train/setup.py", "train/probe.py", "train/replay.py")
SECTIONS = ("analysis", "health", "collapse", "record")  # the diagnostics' config sections
METRIC_PREFIXES = ("grad_norm/", "grad_analysis/", "reward_grad/", "health/", "collapse", "trainer/exited_after")


def test_the_step_setup_and_commands_name_no_diagnostic():
    """Diagnostics own their knowledge: no diagnostic's name, config section or metric key appears in the step,
    the set-up or the commands that run steps."""
    from rldynamics import metric_names as names

    owned = [k for k, v in vars(names).items() if isinstance(v, str) and k.isupper() and v.startswith(METRIC_PREFIXES)]
    patterns = [rf"[\"']{n}[\"']|diagnostics\.{n}\b" for n in DIAGNOSTICS] + [rf"cfg\.{s}\b" for s in SECTIONS] + [
        rf"[\"']{s}\.\w" for s in SECTIONS] + [rf"names\.{k}\b" for k in owned]
    for rel in STEP_FILES:
        code = "\n".join(re.sub(r"(^|  )#.*", "", line) for line in (SRC / rel).read_text().splitlines())
        code = re.sub(r'"""[\s\S]*?"""', "", code)  # docstrings may explain what the diagnostics are
        found = [p for p in patterns if re.search(p, code)]
        assert not found, f"{rel} names {found}"
