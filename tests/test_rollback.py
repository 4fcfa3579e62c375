"""A health rollback with a remedy, from a state kept in memory (`train/snapshots.py`): back to the state before
step 1 with no checkpoint on disk, the remedy's settings recorded (events, config history, config.yaml) and used,
the steps after the rollback exactly those of a resume from the same state with the changed settings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rldynamics.config import ConfigError, load_config, make_config, save_config
from rldynamics.plots.data import load_run
from rldynamics.plots.report import result_lines
from rldynamics.tracking.run_dir import read_metrics
from rldynamics.train.setup import base_model_path
from rldynamics.train.trainer import train

PRESET = "math-tiny"
VARIED = ["train.group_size=3", "env.max_new_tokens=40", "env.max_turns=1", "env.math.length_target=20",
          "val.env_groups=2", "train.mini_batch_size=64", "train.ppo_epochs=1"]
DIP = ["train.steps=6", "val.every=0", "health.baseline_steps=1", "health.entropy_collapse_ratio=1.0"]
BACK = ["checkpoint.every=0", "checkpoint.save_last=false", "health.entropy_collapse=rollback",
        "health.max_rollbacks=1", "health.snapshot_every=100", "health.remedy=[train.lr*=0.5, algo.entropy_coef=0.01]"]


def _events(run) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def _plain(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("timing_s/")}


def test_a_rollback_with_a_remedy_goes_back_to_the_state_before_step_1_in_memory(fast_overrides, tmp_path):
    cfg = make_config(PRESET, overrides=[*fast_overrides, *VARIED, *DIP, *BACK, "log.name=a"])
    a = train(cfg)
    back = [e for e in _events(a) if e["rule"] == "rollback"]
    assert len(back) == 1 and back[0]["step"] == 0
    k = back[0]["from_step"]
    assert back[0]["changes"] == {"train.lr": [3e-4, 1.5e-4], "algo.entropy_coef": [0.0, 0.01]}
    history = [json.loads(line) for line in (a / "config_history.jsonl").read_text().splitlines()]
    assert history == [{"step": 0, "attempt": 1, "changes": back[0]["changes"]}]
    saved = load_config(a / "config.yaml")
    assert saved.train.lr == 1.5e-4 and saved.algo.entropy_coef == 0.01  # a resumed run goes on with them

    # the state before step 1, kept in memory, written as checkpoint step_0: the base model's weights exactly
    written = load_file(str(a / "checkpoints" / "step_0" / "actor" / "model.safetensors"))
    base = load_file(str(Path(base_model_path(cfg)) / "model.safetensors"))
    assert written.keys() == base.keys() and all(torch.equal(written[n], base[n]) for n in base)

    rows = read_metrics(a)
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps))  # every step once (0: the validation before training)
    undone = [json.loads(line)["step"] for line in
              (a / "rolled_back" / "attempt_1" / "metrics.jsonl").read_text().splitlines()]
    assert undone == list(range(1, k + 1))

    # a resume of that state with the remedy's settings, as attempt 1, takes the same steps
    b = a.parent / "b"
    (b / "checkpoints").mkdir(parents=True)
    shutil.copytree(a / "checkpoints" / "step_0", b / "checkpoints" / "step_0")
    shutil.copytree(a / "rolled_back", b / "rolled_back")
    (b / "metrics.jsonl").write_text("")
    settings = [*fast_overrides, *VARIED, *DIP, *BACK[:2], "train.lr=1.5e-4", "algo.entropy_coef=0.01",
                f"train.steps={steps[-1]}", "health.entropy_collapse=record"]
    save_config(make_config(PRESET, overrides=[*settings, "log.name=b"]), b / "config.yaml")
    train(make_config(PRESET, overrides=[*settings, "log.name=b", "checkpoint.resume=latest"]))
    trained, rows_b = [r for r in rows if r["step"] >= 1], read_metrics(b)
    assert {r["actor/lr"] for r in trained} == {1.5e-4}
    compared = [k for k in trained[-1] if not k.startswith(("timing_s/", "health/", "early_stopped/"))]
    assert [{k: r.get(k) for k in compared} for r in trained] == [{k: r.get(k) for k in compared} for r in rows_b]


def test_remedy_entries_are_checked_before_any_work():
    with pytest.raises(ConfigError, match=r"health.remedy entry 'model.path=x': a rollback can change"):
        make_config(overrides=["health.remedy=[model.path=x]"])
    with pytest.raises(ConfigError, match=r"health.remedy entry 'filter.value\*=x': the factor 'x' is not a number"):
        make_config(overrides=["health.remedy=[filter.value*=x]"])
    with pytest.raises(ConfigError, match=r"health.remedy entry 'train.lr=-1': train.lr must be >= 0"):
        make_config(overrides=["health.remedy=[train.lr=-1]"])


def test_a_destructive_first_update_is_undone_at_the_step_that_made_it(fast_overrides, tmp_path):
    """lr 3e-2 (100 x the preset's): the update_kl rule sees an early update move the policy on its own batch (step
    1's groups here have equal rewards: no gradient, KL ~0; step 2's does) and rolls back to the state before step 1,
    the only one kept; with the remedy the run goes on at 3e-4 and its first updates are judged again (the rule's
    count came back with the state)."""
    guard = ["train.lr=3e-2", "train.steps=4", "val.every=0", "checkpoint.every=0", "checkpoint.save_last=false",
             "health.update_kl=rollback", "health.max_rollbacks=1", "health.remedy=[train.lr*=0.01]"]
    run = train(make_config(PRESET, overrides=[*fast_overrides, *VARIED, *guard, "log.name=guard"]))
    fired = [e for e in _events(run / "rolled_back" / "attempt_1") if e["rule"] == "update_kl"]  # an undone step's
    back = [e for e in _events(run) if e["rule"] == "rollback"]
    assert not [e for e in _events(run) if e["rule"] == "update_kl"]
    assert len(fired) == 1 and fired[0]["action"] == "rollback" and fired[0]["value"] > 0.1
    k = fired[0]["step"]
    undone = read_metrics(run / "rolled_back" / "attempt_1")
    assert [r["step"] for r in undone] == list(range(1, k + 1))
    assert all(r["health/update_kl_value"] <= 0.1 for r in undone[:-1])  # the first destructive update is the one
    assert [(e["step"], e["from_step"]) for e in back] == [(0, k)]  # undone at step k, back to before step 1
    assert back[0]["changes"] == {"train.lr": [3e-2, pytest.approx(3e-4)]}
    rows = [r for r in read_metrics(run) if r["step"] >= 1]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and [r["actor/lr"] for r in rows] == [pytest.approx(3e-4)] * 4
    assert all(r["health/update_kl_value"] < 0.1 for r in rows)  # measured again at the remedied rate: not destructive


def test_a_rollback_rule_with_no_rollback_left_stops_with_the_state_from_before_the_trouble(fast_overrides,
                                                                                          tmp_path):
    """lr 3e-2 with `health.max_rollbacks=0`: the update_kl rule fires at the first destructive update (step k) and
    stops the run there; its last checkpoint is the state before step 1, kept in memory and written as step_0 (the
    base model's weights exactly), and no state of a trained step is saved: the policy the run leaves is the one it
    started with, not the broken one. The rows of the steps it took stay; the event says what it left."""
    guard = ["train.lr=3e-2", "train.steps=4", "val.every=0", "checkpoint.every=0", "checkpoint.save_last=true",
             "health.update_kl=rollback", "health.max_rollbacks=0"]
    cfg = make_config(PRESET, overrides=[*fast_overrides, *VARIED, *guard, "log.name=ends"])
    run = train(cfg)
    [fired] = [e for e in _events(run) if e["rule"] == "update_kl"]
    k = fired["step"]
    assert fired["action"] == "stop" and fired["value"] > 0.1
    assert fired["message"].endswith("no rollbacks allowed (health.max_rollbacks=0); stopping with the state of "
                                     "step 0, from before the trouble, as the last checkpoint")
    assert read_metrics(run)[-1]["step"] == k and not (run / "rolled_back").exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0"]  # not step k's (save_last)
    written = load_file(str(run / "checkpoints" / "step_0" / "actor" / "model.safetensors"))
    base = load_file(str(Path(base_model_path(cfg)) / "model.safetensors"))
    assert written.keys() == base.keys() and all(torch.equal(written[n], base[n]) for n in base)


def test_checkpoints_saved_after_the_trouble_began_are_set_aside_by_the_stop_and_by_a_rollback(fast_overrides):
    """`reward_variance_collapse` judges 3 steps in a row (share 0: every step counts), so it fires at step 3 with
    its trouble since step 1, after checkpoints of steps 1 and 2 were saved. With no rollback left the run ends with
    the state before step 1 as its only checkpoint, and steps 1-2's checkpoints move to checkpoints_after_trouble/
    (not `latest`, not lost). With one rollback allowed they first move into the attempt's archive, the run goes
    on from step 0 and the rule fires again at step 3: that stop sets aside the new attempt's own."""
    rule = ["train.steps=3", "val.every=0", "checkpoint.every=1", "checkpoint.keep_last=0",
            "health.reward_variance_collapse=rollback", "health.zero_variance_share=0",
            "health.zero_variance_steps=3"]
    stop = train(make_config(PRESET, overrides=[*fast_overrides, *VARIED, *rule, "health.max_rollbacks=0",
                                                "log.name=stops"]))
    [fired] = [e for e in _events(stop) if e["rule"] == "reward_variance_collapse"]
    assert (fired["step"], fired["since"], fired["action"], fired["ends_with"]) == (3, 1, "stop", 0)
    assert sorted(p.name for p in (stop / "checkpoints").iterdir()) == ["step_0"]
    [left] = [line for line in result_lines(load_run(stop)) if line.startswith("left: ")]
    assert left.startswith("left: the state of step 0, from before the trouble, as the last checkpoint "
                           "(checkpoints/step_0; validation success ")
    assert sorted(p.name for p in (stop / "checkpoints_after_trouble").iterdir()) == ["step_1", "step_2"]
    back = train(make_config(PRESET, overrides=[*fast_overrides, *VARIED, *rule, "health.max_rollbacks=1",
                                                "log.name=rolls"]))
    assert [e["step"] for e in _events(back) if e["rule"] == "rollback"] == [0]
    for kept in (back / "rolled_back" / "attempt_1" / "checkpoints", back / "checkpoints_after_trouble"):
        assert sorted(p.name for p in kept.iterdir()) == ["step_1", "step_2"]
    assert sorted(p.name for p in (back / "checkpoints").iterdir()) == ["step_0"]


@pytest.mark.slow
def test_under_torchrun_a_rollback_from_memory_gives_the_one_process_run(fast_overrides, tmp_path):
    """Two ranks (FSDP2 on gloo, `train.row_seeded_sampling`) roll back as one process does: the state before step 1,
    kept in memory (gathered from the shards on rank 0), is written as step_0 and every rank reopens from it with the
    remedy; the undone steps, the steps after, the events and the final weights are the one-process run's. (The
    optimizer state before any step is kept as it is: torch's gathering would take a zero step and start the
    moments' step counts at 1.)"""
    import os

    from conftest import run_ranks

    guard = ["train.lr=3e-2", "train.steps=4", "val.every=0", "checkpoint.every=0", "checkpoint.save_last=true",
             "health.update_kl=rollback", "health.max_rollbacks=1", "health.remedy=[train.lr*=0.01]",
             "train.row_seeded_sampling=true"]
    one = train(make_config(PRESET, overrides=[*fast_overrides, *VARIED, *guard, "log.name=one"]))
    run_ranks(["-m", "rldynamics.cli", "train", "--preset", PRESET, *fast_overrides, *VARIED, *guard,
               "log.name=two"], timeout=300, env={"RLDYN_CACHE": os.environ["RLDYN_CACHE"]})
    two = tmp_path / "runs" / "two"
    assert _events(two) == _events(one) and [e["step"] for e in _events(one) if e["rule"] == "rollback"] == [0]
    assert (two / "config_history.jsonl").read_text() == (one / "config_history.jsonl").read_text()
    for rows_one, rows_two in [(read_metrics(one), read_metrics(two)),
                               (read_metrics(one / "rolled_back" / "attempt_1"),
                                read_metrics(two / "rolled_back" / "attempt_1"))]:
        assert [r["step"] for r in rows_two] == [r["step"] for r in rows_one]
        for a, b in zip(rows_one, rows_two, strict=True):
            for key, value in _plain(a).items():
                if key != "record/bytes":
                    assert b[key] == pytest.approx(value, rel=1e-3, abs=1e-6), (a["step"], key)
    wa, wb = (load_file(str(r / "checkpoints" / "step_4" / "actor" / "model.safetensors")) for r in (one, two))
    assert wa.keys() == wb.keys() and max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-5


def test_a_reopened_run_keeps_the_states_from_before_the_one_it_went_back_to(fast_overrides):
    """A second rollback may need to go back further than the first (the trouble it sees began earlier): the run
    reopened at step 10 keeps the earlier run's state before step 1 and its state of step 5 (not those of step 10
    or later), and a state carried over writes the checkpoint of its own weights."""
    from rldynamics.train import setup
    from rldynamics.train.session import Start
    from rldynamics.train.snapshots import Snapshots

    cfg = make_config(PRESET, overrides=[*fast_overrides, *BACK, "health.snapshot_every=5", "health.snapshots=3"])
    s = setup.make_session(cfg, setup.resolve_run_dir(cfg), Start())  # writes nothing
    first = s.snapshots
    weights = {}
    for step in (0, 5, 10, 15):
        with torch.no_grad():
            next(s.model.parameters()).add_(1.0)  # a different state at every step
        weights[step] = {k: v.clone() for k, v in s.model.state_dict().items()}
        first.keep(s, step, {}, start=step == 0)
    assert first.steps() == [0, 5, 10, 15]
    again = Snapshots(cfg, s.model, s.critic)
    again.carry(first, 10)
    assert again.steps() == [0, 5]
    again.keep(s, 10, {}, start=True)  # the reopened run's start: one of the newest, the carried start stays
    assert again.steps() == [0, 5, 10]
    written = load_file(str(again.write(s, 5) / "actor" / "model.safetensors"))
    assert all(torch.equal(written[k], weights[5][k]) for k in written)


def test_where_not_every_state_fits_the_state_before_step_1_is_kept_first(fast_overrides):
    """`health.snapshot_mb` for one and a half states keeps the state before step 1 alone (no state of a later step
    is copied, and the start-up line says which fit); for two and a half, the start and one of the newest; for half
    a state, none, with a warning that a rollback needs a checkpoint."""
    from rldynamics.train import setup
    from rldynamics.train.session import Start
    from rldynamics.train.snapshots import Snapshots

    keys = [*fast_overrides, *BACK, "health.snapshot_every=5", "health.snapshots=3"]
    cfg = make_config(PRESET, overrides=keys)
    s = setup.make_session(cfg, setup.resolve_run_dir(cfg), Start())  # writes nothing
    size = s.snapshots.size_mb
    budget = {room: Snapshots(make_config(PRESET, overrides=[*keys, f"health.snapshot_mb={room * size}"]), s.model,
                              s.critic) for room in (0.5, 1.5, 2.5)}
    for snaps in budget.values():
        for step in (0, 5, 10):
            if snaps.due(step, start=step == 0):
                snaps.keep(s, step, {}, start=step == 0)
    assert [b.steps() for b in budget.values()] == [[], [0], [0, 10]]
    assert not budget[1.5].due(5) and budget[2.5].due(5)
    assert budget[0.5].words().startswith("warning: a rollback goes back to checkpoints on disk only")
    assert "the state before step 1, in memory" in budget[1.5].words()
    assert "(0 of the health.snapshots=3 fit" in budget[1.5].words()
    assert "(1 of the health.snapshots=3 fit" in budget[2.5].words()
