"""`rldyn doctor`: the health rules over a finished run's logs give the alarms the run's own
monitor wrote (its run directory, its TensorBoard mirror, a W&B-style export of its rows); a source
lacking a signal names the rules that cannot run; a path that is none of the sources is refused in
one line."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pytest

from conftest import FAST
from rldynamics.analysis.health_rules import RULES, Signals
from rldynamics.cli import main
from rldynamics.config import load_config, make_config
from rldynamics.integrations.doctor import doctor, read_logs
from rldynamics.integrations.signals import RLDYNAMICS, TRL, cannot_run, cannot_run_line, signals_of, values_of
from rldynamics.plots.data import load_run
from rldynamics.plots.report import HEALTH_REPORT
from rldynamics.plots.timeline import verdict
from rldynamics.tracking.run_dir import EVENTS_FILE, read_events, read_metrics
from rldynamics.train.trainer import train

# math-tiny, one optimizer step a step; the entropy rule at ratio 1 fires at every step whose
# entropy is below step 1's and clears at the next one above it: warnings, clears, records and
# validations
SETTINGS = ["health.baseline_steps=1", "health.entropy_collapse_ratio=1.0",
            "health.truncation=record"]
RUN = [*FAST, "train.group_size=3", "env.max_new_tokens=40", "env.max_turns=1",
       "env.math.length_target=20", "val.env_groups=2", "train.mini_batch_size=64",
       "train.ppo_epochs=1", "train.steps=6", "val.every=3", "log.tensorboard=true", *SETTINGS]


@pytest.fixture(scope="module")
def run(tiny_cache, tmp_path_factory) -> Path:
    """A six-step run whose monitor wrote warnings, a clear and records (and a TensorBoard
    mirror)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLDYN_CACHE", tiny_cache)
        root = tmp_path_factory.mktemp("doctor")
        overrides = [*RUN, f"log.run_dir={root}", "log.name=r"]
        return train(make_config("math-tiny", overrides=overrides))


def _key(events: list[dict]) -> list[tuple]:
    return [(e["step"], e["rule"], e["action"]) for e in events]


def test_doctor_of_a_run_directory_writes_the_rows_its_monitor_wrote(run):
    own = read_events(run)
    actions = {e["action"] for e in own}
    assert {"warn", "clear", "record"} <= actions, own  # the comparison covers every kind of row
    lines = doctor(run)
    # rule, step, action, value, threshold, since and message
    assert read_events(run / "doctor") == own
    mine = load_run(run)
    assert lines[1] == f"health: {verdict(mine).text}"  # the verdict the run's own report gives
    page = (run / "doctor" / HEALTH_REPORT).read_text()
    assert verdict(mine).text in page and "entropy_collapse" in page


def test_doctor_of_the_runs_tensorboard_mirror_reads_its_settings_and_alarms(run):
    doctor(run / "tensorboard", tmp := run / "tb_doctor")
    got = read_events(tmp)
    # TensorBoard keeps float32: the entropy rule at ratio 1 compares entropies equal to 7 digits
    same = [e for e in read_events(run) if e["rule"] != "entropy_collapse"]
    assert same and _key([e for e in got if e["rule"] != "entropy_collapse"]) == _key(same)


def _export(rows: list[dict], path: Path) -> Path:
    """W&B's history export of `rows`: a `_step` column, a column per scalar, empty where not
    logged."""
    scalars = [{("_step" if k == "step" else k): v for k, v in r.items()
                if isinstance(v, (int, float))} for r in rows]
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in scalars))
        return path
    columns = sorted({k for r in scalars for k in r})
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows({k: repr(v) for k, v in r.items()} for r in scalars)
    return path


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_wandb_export_of_the_run_gives_its_alarms_with_its_settings(run, tmp_path, suffix):
    """Outside the run directory the export has no settings: the run's health.* keys are given; the
    run's length is its last step, as here."""
    file = _export(read_metrics(run), tmp_path / f"history{suffix}")
    lines = doctor(file, None, SETTINGS)
    assert lines[0].startswith(f"read {suffix[1:].upper()} export (rldynamics names)")
    assert _key(read_events(tmp_path / "doctor")) == _key(read_events(run))


def test_an_event_file_in_transformers_names_is_read_with_trls_table(tmp_path):
    """An event file written by SummaryWriter with TRL's names under `train/`: the entropy falls
    below 0.1 x its start at step 7."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
    for step, entropy in enumerate([0.8, 0.8, 0.8, 0.8, 0.8, 0.5, 0.05], start=1):
        writer.add_scalar("train/entropy", entropy, step)
        writer.add_scalar("train/frac_reward_zero_std", 0.25, step)
    writer.close()
    (file,) = list((tmp_path / "tb").iterdir())
    lines = doctor(file)
    assert lines[0].startswith("read TensorBoard event file (TRL (transformers' callbacks) names)")
    assert _key(read_events(tmp_path / "tb" / "doctor")) == [(7, "entropy_collapse", "warn")]
    assert "grad_spike (no grad_norms)" in lines[2]


def test_a_rule_needs_only_signals_and_a_source_names_what_it_lacks():
    fields = {f.name for f in dataclasses.fields(Signals)}
    read = [{f for group in rule.needs for f in group} for rule in RULES.values()]
    assert all(r and r <= fields for r in read)
    assert cannot_run(set(RLDYNAMICS)) == {}
    trl = cannot_run(set(TRL))
    assert set(trl) == {"non_finite", "first_step", "update_kl", "mismatch", "repetition", "reward_component",
                        "template_collapse", "falling_success", "falling_validation", "no_learning"}
    line = cannot_run_line(set(TRL))
    assert "\n" not in line and "mismatch (no mismatch_kl)" in line
    assert "first_step (no first_ppo_kl or mismatch_kl)" in line


def test_a_logged_step_gives_the_training_success_with_the_runs_trajectories(run):
    v = values_of({"step": 4, "train/math/success": 0.25}, RLDYNAMICS, "math")
    x = signals_of(4, v, 0.4, train_count=64)
    assert (x.train_success, x.train_count) == (0.25, 64)
    cfg = load_config(run / "config.yaml")  # a run directory: the trajectories of its settings
    assert read_logs(run).train_count == cfg.train.env_groups * cfg.train.group_size


def test_the_docs_show_each_tables_names():
    """docs/integrations.md's mapping table: a row per quantity, rldynamics' names, TRL's names."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "integrations.md").read_text()
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
             if line.startswith("| `")]
    for column, table in ((1, RLDYNAMICS), (2, TRL)):
        for quantity, name in table.items():
            row = next(r for r in cells if f"`{quantity}`" in r[0])
            names = name if isinstance(name, tuple) else (name,)
            assert all(f"`{n.rstrip('/')}" in row[column] for n in names), (quantity, row)


def test_what_is_none_of_the_sources_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "nostep.csv").write_text("entropy\n0.5\n")
    (tmp_path / "unknown.csv").write_text("_step,foo\n1,0.5\n")
    (tmp_path / "state.json").write_text("[1, 2]")
    cases = {"missing": "does not exist", "empty": "is none of: an rldynamics run directory",
             "notes.txt": "not a file doctor reads", "nostep.csv": "no rows with a step",
             "unknown.csv": "none of the metric names the health rules read",
             "state.json": "not a JSON object"}
    for name, said in cases.items():
        assert main(["doctor", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
    assert main(["doctor", str(tmp_path / "unknown.csv"), "train.lr=1"]) == 2
    assert "health.* settings only" in capsys.readouterr().err


def test_the_command_prints_the_verdict_and_where_the_files_are(run, tmp_path, capsys):
    assert main(["doctor", str(run), "--out", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("health: ") and out[2].startswith("cannot run on these logs: ")
    assert out[3] == f"events: {tmp_path / 'd' / EVENTS_FILE}"
    assert (tmp_path / "d" / HEALTH_REPORT).is_file()
