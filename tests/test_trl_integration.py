"""The health monitor inside TRL 1.16's GRPOTrainer (CPU, the embedded tiny model, a few steps): the
callback stops a run whose groups all get equal rewards, warns where skip or rollback were asked,
writes events.jsonl and the health report; `rldyn doctor` reads the same run's trainer_state.json,
its TensorBoard files and a W&B-style export of its metrics with the same table and gives the same
alarms."""

from __future__ import annotations

import csv
import sys

import pytest
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from rldynamics.config import make_config
from rldynamics.integrations.doctor import doctor
from rldynamics.integrations.signals import HF_PREFIX, TRL
from rldynamics.integrations.trl import INSTALL, HealthCallback
from rldynamics.models.loading import load_model_and_tokenizer
from rldynamics.plots.report import HEALTH_REPORT
from rldynamics.tracking.run_dir import EVENTS_FILE, read_events
from rldynamics.train.setup import base_model_path

MAX_STEPS = 5
# the callback's settings: equal rewards in every group on 2 steps in a row stop the run; every
# reply cut at the 2-token limit asks for a rollback, which a callback cannot do
SETTINGS = {"reward_variance_collapse": "stop", "zero_variance_steps": 2, "truncation": "rollback"}


def equal_rewards(completions, **_) -> list[float]:
    """The same reward for every completion: no group tells a good reply from a bad one."""
    return [0.0] * len(completions)


# GRPO on the CPU: 4 prompts a step, 4 completions each of at most 2 tokens, a log every step
ARGS = {"use_cpu": True, "report_to": [], "save_strategy": "no", "logging_steps": 1,
        "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 2,
        "learning_rate": 1e-5, "disable_tqdm": True, "seed": 0}


def _trainer(out, callback, max_steps: int, **args) -> GRPOTrainer:
    """A GRPOTrainer on the embedded tiny model with `callback`, writing into `out`."""
    model, tokenizer = load_model_and_tokenizer(base_model_path(make_config()))
    config = GRPOConfig(output_dir=str(out), max_steps=max_steps, **{**ARGS, **args})
    prompts = Dataset.from_list([{"prompt": f"What is {i} + {i}?"} for i in range(16)])
    return GRPOTrainer(model=model, reward_funcs=equal_rewards, args=config,
                       processing_class=tokenizer, train_dataset=prompts, callbacks=[callback])


@pytest.fixture(scope="module")
def run(tiny_cache, tmp_path_factory):
    """A run with the callback (KL term on: TRL logs `kl`; transformers' TensorBoard callback)."""
    out = tmp_path_factory.mktemp("trl")
    callback = HealthCallback(**SETTINGS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLDYN_CACHE", tiny_cache)
        trainer = _trainer(out, callback, MAX_STEPS, report_to=["tensorboard"], beta=0.01)
    trainer.train()
    trainer.state.save_to_json(str(out / "trainer_state.json"))
    return trainer, callback, out


def _key(events: list[dict]) -> list[tuple]:
    return [(e["step"], e["rule"]) for e in events]


def test_the_callback_stops_the_run_and_writes_its_events_and_report(run):
    trainer, callback, out = run
    assert trainer.state.global_step == 2 < MAX_STEPS
    events = read_events(out)
    assert events == callback.events
    assert [(e["step"], e["rule"], e["action"]) for e in events] == [
        (1, "truncation", "warn"), (2, "reward_variance_collapse", "stop")]
    assert "health.truncation=rollback cannot act here" in events[0]["message"]
    page = (out / HEALTH_REPORT).read_text()
    assert "Stopped by reward_variance_collapse at step 2" in page
    assert 'id="glossary"' in page and "cannot run on these logs: " in page


def test_the_trl_table_holds_names_trl_logs(run):
    trainer, _, _ = run
    logged = {k for row in trainer.state.log_history for k in row}
    names = {n for name in TRL.values() for n in ((name,) if isinstance(name, str) else name)}
    assert names <= logged, names - logged


def test_doctor_of_the_trainer_state_gives_the_callbacks_alarms(run):
    _, callback, out = run
    settings = [f"health.{k}={v}" for k, v in SETTINGS.items()]
    lines = doctor(out / "trainer_state.json", out / "d1", settings)
    got = read_events(out / "d1")
    assert _key(got) == _key(callback.events) and lines[0].startswith("read TRL trainer_state.json")
    assert all(e["action"] == "warn" for e in got)  # post hoc: the run is over
    said = "health.reward_variance_collapse=stop cannot act here (the run is over)"
    assert said in got[1]["message"]


def test_doctor_of_transformers_tensorboard_files_gives_the_same_alarms(run):
    _, callback, out = run
    (board,) = list((out / "runs").iterdir())
    lines = doctor(board, out / "d2", [f"health.{k}={v}" for k, v in SETTINGS.items()])
    assert "TRL (transformers' callbacks) names" in lines[0]
    assert _key(read_events(out / "d2")) == _key(callback.events)


def test_doctor_of_a_wandb_export_gives_the_same_alarms(run, tmp_path):
    """What transformers' W&B callback logs: TRL's names under `train/`, W&B's `_step`."""
    trainer, callback, _ = run
    rows = [{"_step": r["step"], **{HF_PREFIX + k: v for k, v in r.items() if k != "step"}}
            for r in trainer.state.log_history]
    columns = sorted({k for r in rows for k in r})
    with open(tmp_path / "history.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    doctor(tmp_path / "history.csv", None, [f"health.{k}={v}" for k, v in SETTINGS.items()])
    assert (tmp_path / "doctor" / EVENTS_FILE).is_file()
    assert _key(read_events(tmp_path / "doctor")) == _key(callback.events)


def test_a_resumed_run_goes_on_with_the_rules_history(tiny_cache, tmp_path, monkeypatch):
    """Three equal-reward steps in a row stop the run: two before the checkpoint, one after it."""
    monkeypatch.setenv("RLDYN_CACHE", tiny_cache)
    settings = {"reward_variance_collapse": "stop", "zero_variance_steps": 3}
    first = _trainer(tmp_path, HealthCallback(**settings), 2, save_strategy="steps", save_steps=2)
    first.train()
    assert first.state.global_step == 2 and (tmp_path / "checkpoint-2").is_dir()
    callback = HealthCallback(**settings)
    second = _trainer(tmp_path, callback, MAX_STEPS)
    second.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert second.state.global_step == 3
    assert [(e["step"], e["rule"], e["action"]) for e in callback.events] == [
        (1, "truncation", "warn"), (3, "reward_variance_collapse", "stop")]


def test_without_trl_the_callback_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` raises ImportError
    with pytest.raises(ImportError) as e:
        HealthCallback()
    assert str(e.value) == INSTALL and 'pip install "rldynamics[trl]"' in INSTALL
