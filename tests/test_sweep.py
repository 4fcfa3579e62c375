"""Sweeps: pinned protocol expansions, plans, summaries from run directories, tiny sweeps end to end."""

from __future__ import annotations

import json
import math
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FAST
from rldynamics import metric_names as names
from rldynamics.cli import main
from rldynamics.config import ConfigError, make_config, save_config
from rldynamics.sweep.launch import make_slots
from rldynamics.sweep.plan import build_plan
from rldynamics.sweep.protocols import SweepError, expand, split_values
from rldynamics.sweep.report import FILES, write_summary
from rldynamics.sweep.runs import record_runs, write_status
from rldynamics.sweep.summary import collect
from rldynamics.tracking.run_dir import RunWriter, read_metrics

FILTER = ("filter.strategy=top_p", "filter.keep=largest", "filter.metric=reward_std", "filter.loss_scaling=none")
TOP_P = (*FILTER, "filter.prob_mode=softmax", "algo.kl_coef=0.001", "algo.kl_type=k1", "algo.entropy_coef=0.001")


def test_top_p_protocol_pinned():
    points = expand("top_p").points
    assert [p.label for p in points] == ["1.0", "0.98", "0.95", "0.9", "0.8", "0.6", "0.4", "nofilter"]
    assert points[0].overrides == (*TOP_P, "filter.value=1.0", "filter.include_zero=false")
    assert points[3].overrides == (*TOP_P, "filter.value=0.9", "filter.include_zero=false")
    assert points[7].overrides == (*TOP_P, "filter.value=1.0", "filter.include_zero=true")
    assert [p.label for p in expand("top_p", [["0.9", "nofilter"]]).points] == ["0.9", "nofilter"]


def test_kl_and_entropy_protocols_pinned():
    kl = expand("kl").points
    assert [p.label for p in kl] == ["kl0", "kl0.001", "kl0.003", "kl0.01", "kl0.03", "kl0.1"]
    off = (*FILTER, "filter.value=1.0", "filter.include_zero=true")
    assert kl[2].overrides == (*off, "algo.entropy_coef=0.0", "algo.kl_type=k1", "algo.kl_coef=0.003")
    ent = expand("entropy", [["0", "0.01"]], exclude_zero=True).points
    assert [p.label for p in ent] == ["ent0", "ent0.01"]
    assert ent[1].overrides == (*FILTER, "filter.value=1.0", "filter.include_zero=false", "algo.kl_coef=0.0",
                                "algo.entropy_coef=0.01")
    cfg = make_config(overrides=list(kl[0].overrides))  # no reference model at 0: the trainer loads one only if > 0
    assert cfg.algo.kl_coef == 0 and cfg.filter.value == 1.0 and cfg.filter.include_zero


def test_custom_grid_and_value_lists():
    points = expand("custom", [["1e-4", "3e-4"], ["0.2", "0.28"]], ["train.lr", "algo.clip_high"]).points
    assert [p.label for p in points] == ["lr1e-4_clip_high0.2", "lr1e-4_clip_high0.28", "lr3e-4_clip_high0.2",
                                         "lr3e-4_clip_high0.28"]
    assert points[1].overrides == ("train.lr=1e-4", "algo.clip_high=0.28")
    assert split_values("[5,5],[6,6]") == ["[5,5]", "[6,6]"]
    with pytest.raises(SweepError, match="one --values per key"):
        expand("custom", [["1"]], ["train.lr", "train.steps"])
    with pytest.raises(SweepError, match="more than once"):
        expand("kl", [["0.1", "0.1"]])


@pytest.mark.parametrize("args, message", [
    (["custom", "train.lrr", "--values", "1,2"], "train.lrr"),
    (["top_p", "--values", "0.9,high"], "'high' is not a number"),
    (["top_p", "--values", "0.9", "filter.value=0.5"], "filter.value is swept"),
    (["kl", "--values", "0.1", "val.every=often"], "val.every"),
    (["kl", "--values", "0.1", "seed=3"], "--seeds"),
])
def test_bad_input_fails_before_any_run(tmp_path, capsys, args, message):
    out = tmp_path / "sweep"
    assert main(["sweep", *args, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_slots_split_cores_and_devices(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # exported, it would be every slot's count
    cpu = make_slots(parallel=2, cores=2)
    assert [(s.name, s.env["OMP_NUM_THREADS"]) for s in cpu] == [("cpu 0", "1"), ("cpu 1", "1")]
    gpu = make_slots(devices=["0", "1", "2", "3"], devices_per_run=2, cores=16)
    assert [(s.env["CUDA_VISIBLE_DEVICES"], s.env["OMP_NUM_THREADS"]) for s in gpu] == [("0,1", "8"), ("2,3", "8")]
    assert [s.ranks for s in gpu] == [2, 2] and [s.ranks for s in cpu] == [1, 1]  # two GPUs: rldyn train --nproc 2
    for bad in (dict(devices=["0", "1", "2"], devices_per_run=2), dict(parallel=2, devices=["0"]),
                dict(devices_per_run=2), dict(parallel=0)):
        with pytest.raises(SweepError):
            make_slots(**bad)


def _write_run(out, label, seed, val, overrides=(), stop=None, status=None, kept=1.0):
    """A run directory written with the real RunWriter: validation every step, `stop` = early-stop reason, `kept` the
    filter's kept ratio of every step (0: no group kept, no actor update)."""
    path = out / label / f"seed{seed}"
    cfg = make_config(overrides=[*FAST, f"train.steps={len(val) - 1}", f"seed={seed}", f"log.run_dir={out / label}",
                                 f"log.name=seed{seed}", *overrides])
    path.mkdir(parents=True)
    save_config(cfg, path / "config.yaml")
    writer = RunWriter(path)
    for step, v in enumerate(val):
        row = {names.val_success("sokoban"): v, names.VAL_TIME: 1.0}
        if step > 0:
            row.update({names.IN_GROUP_REWARD_STD: 0.5 * step, names.FILTER_KEPT_RATIO: kept,
                        names.EMPTY_AFTER_FILTER: float(kept == 0), names.STEP_TIME: 2.0})
            if kept:
                row[names.PG_LOSS] = 0.1
        if stop and step == len(val) - 1:
            row[names.early_stopped(stop)] = 1.0
        writer.log(step, row)
    write_status(path, sweep="kl", keys=["algo.kl_coef"], point=label, value=label, index=0 if label == "a" else 1,
                 **(status or {"state": "completed", "returncode": 0}))
    return path


def test_summary_marks_early_stop_as_failed_regime(tmp_path):
    out = tmp_path / "sw"
    _write_run(out, "a", 0, [0.1, 0.2, 0.2])
    _write_run(out, "a", 1, [0.1, 0.4, 0.3])
    _write_run(out, "b", 0, [0.1, 0.05, 0.1])
    _write_run(out, "b", 1, [0.1, 0.0], stop="reward_variance_collapse", status={"state": "early_stopped"})
    write_summary(out)
    rows = (out / "summary.csv").read_text().splitlines()
    a, b = (dict(zip(rows[0].split(","), r.split(","), strict=True)) for r in rows[1:])
    assert (a["outcome"], a["final_success_mean"], a["best_success_mean"]) == ("completed", "0.25", "0.3")
    assert a["final_success_std"] == f"{math.sqrt(2 * 0.05 ** 2):.6g}" == "0.0707107"  # sample std of 0.2, 0.3
    assert a["wall_time_s_mean"] == "5" and a["in_group_reward_std_mean"] == "0.75"  # 2 x 2 s + first val 1 s
    assert b["outcome"] == "early_stopped: reward_variance_collapse (1/2)"
    assert b["outcome_per_seed"] == "completed;early_stopped: reward_variance_collapse"
    assert (b["final_success_per_seed"], b["steps_per_seed"]) == ("0.1;0", "2;1")
    md = (out / "summary.md").read_text()
    assert "| b | 5.0 ± 7.1 | 10.0 ± 0.0 | 2 | 2, 1 | early_stopped: reward_variance_collapse (1/2) |" in md
    assert all((out / f).stat().st_size > 0 for f in FILES)


def test_a_point_that_never_updated_is_flagged(tmp_path):
    out = tmp_path / "sw"
    _write_run(out, "a", 0, [0.1, 0.1, 0.1], kept=0.0)
    _write_run(out, "a", 1, [0.1, 0.2, 0.3])
    write_summary(out)
    rows = (out / "summary.csv").read_text().splitlines()
    a = dict(zip(rows[0].split(","), rows[1].split(","), strict=True))
    flag = "completed: never updated: the filter kept no group at any step"
    assert a["outcome"] == f"{flag} (1/2)" and a["outcome_per_seed"] == f"{flag};completed"


def test_plan_resumes_restarts_skips_and_refuses_other_settings(tmp_path, fast_overrides):
    out = tmp_path / "sw"
    protocol = expand("kl", [["0", "0.01"]])
    plan = build_plan(protocol, [0, 1], out, overrides=FAST)
    assert plan.point_overrides["kl0"][-2:] == ["checkpoint.every=1", "checkpoint.keep_last=1"]
    assert [r.action for r in plan.runs] == ["start"] * 4
    common = [*protocol.points[0].overrides, "checkpoint.every=1", "checkpoint.keep_last=1"]
    _write_run(out, "kl0", 0, [0.1, 0.1, 0.2], common)  # finished: 2 of 2 steps
    _write_run(out, "kl0", 1, [0.1, 0.1], [*common, "train.steps=2"], status={"state": "interrupted"})
    (out / "kl0" / "seed1" / "checkpoints" / "step_1").mkdir(parents=True)
    _write_run(out, "kl0.01", 0, [0.1], [*protocol.points[1].overrides, "checkpoint.every=1",
                                         "checkpoint.keep_last=1", "train.steps=2"], status={"state": "failed"})
    plan = build_plan(protocol, [0, 1], out, overrides=FAST)
    assert [r.action for r in plan.runs] == ["skip", "resume", "restart", "start"]
    assert plan.runs[1].train_overrides()[-1] == "checkpoint.resume=latest"
    with pytest.raises(SweepError, match=r"kl0/seed0 holds a run with other settings \(train.lr"):
        build_plan(protocol, [0, 1], out, overrides=[*FAST, "train.lr=0.1"])
    with pytest.raises(ConfigError, match="point kl0: unknown config key 'train.lrr'"):
        build_plan(protocol, [0], out, overrides=["train.lrr=1"])


def test_tiny_sweep_in_parallel_reruns_nothing_and_resummarizes_byte_for_byte(tmp_path, fast_overrides, capsys):
    out = tmp_path / "sw"
    args = ["sweep", "top_p", "--values", "0.9,nofilter", "--seeds", "0", "--parallel", "2", "--out", str(out),
            *FAST]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "2 run(s) at a time (cpu 0, cpu 1)" in first and first.count("started") == 2
    table = [line for line in first.splitlines() if re.search(r"│ +0 │ completed", line)]  # the live table
    assert len(table) == 2 and all(re.search(r"│ cpu [01] +│ +\d+s │", line) for line in table), first
    for label in ("0.9", "nofilter"):
        run = out / label / "seed0"
        assert [r["step"] for r in read_metrics(run)] == [0, 1, 2]
        assert json.loads((run / "sweep.json").read_text())["state"] == "completed"
        assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_2"]  # every=1, keep_last=1
    assert [p.label for p in collect(out).points] == ["0.9", "nofilter"]
    logs = {p: p.read_text() for p in out.glob("*/seed0/train.log")}

    assert main(args) == 0
    again = capsys.readouterr().out
    assert "runs: 2 finished (skipped)" in again and "started" not in again
    table = [line for line in again.splitlines() if re.search(r"│ +0 │ completed", line)]
    assert len(table) == 2 and all(re.search(r"│ cpu [01] +│ +\d+s │", line) for line in table), again
    assert {p: p.read_text() for p in out.glob("*/seed0/train.log")} == logs

    copy = tmp_path / "copied"
    shutil.copytree(out, copy)
    for f in FILES:
        (copy / f).unlink()
    assert main(["sweep", "--summarize", str(copy)]) == 0
    for f in FILES:
        assert (copy / f).read_bytes() == (out / f).read_bytes(), f


@pytest.mark.slow
def test_crashing_point_is_recorded_while_the_other_completes(tmp_path, fast_overrides, capsys):
    """A run that fails (a CUDA device this machine does not have) is recorded with its error line and retried by the
    next sweep. (A diverging point such as train.lr=1e30 no longer crashes: it early-stops with a named reason.)"""
    out = tmp_path / "sw"
    args = ["sweep", "custom", "model.device", "--values", "cpu,cuda:99", "--out", str(out), *FAST]
    code = main([*args, "--parallel", "2"])
    assert code == 1
    printed = capsys.readouterr().out
    assert "failed devicecuda-99 seed 0 (exit code 2): rldyn train: config error: model.device=cuda:99" in printed
    summary = collect(out)
    assert [(r.label, r.state) for p in summary.points for r in p.runs] == [("devicecpu", "completed"),
                                                                              ("devicecuda-99", "failed")]
    assert "no such CUDA device" in summary.points[1].runs[0].detail
    md = (out / "summary.md").read_text()
    assert "## Failed runs" in md and "`devicecuda-99/seed0`: rldyn train: config error: model.device" in md
    assert "no such CUDA device" in (out / "summary.html").read_text()

    assert main(args) == 1  # retried
    assert "1 finished (skipped)" in capsys.readouterr().out
    assert json.loads((out / "devicecuda-99" / "seed0" / "sweep.json").read_text())["attempts"] == 2


@pytest.mark.slow
def test_interrupted_sweep_resumes_from_checkpoints(tmp_path, fast_overrides):
    # Enough steps that the run is still going when the first checkpoint appears, however fast the machine; the
    # sweep checkpoints at every validation, here every 10th step (a validation every step costs a third more).
    steps = 40
    out = tmp_path / "sw"
    args = ["sweep", "kl", "--values", "0", "--out", str(out), *FAST, f"train.steps={steps}", "val.every=10",
            "early_stop.enabled=false"]
    # A test run started in the background (CI) inherits SIGINT ignored; Ctrl-C on a terminal has it on.
    sweep = subprocess.Popen([sys.executable, "-m", "rldynamics.cli", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    run = out / "kl0" / "seed0"
    deadline = time.monotonic() + 300
    while not list(run.glob("checkpoints/step_*")) and sweep.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    sweep.send_signal(signal.SIGINT)  # what Ctrl-C does
    printed = sweep.communicate(timeout=300)[0]
    assert sweep.returncode == 130, printed
    assert json.loads((run / "sweep.json").read_text())["state"] == "interrupted"
    assert read_metrics(run)[-1]["step"] < steps

    assert main(args) == 0
    assert "attempt 2 on cpu 0 (resuming from the latest checkpoint)" in (run / "train.log").read_text()
    assert [r["step"] for r in read_metrics(run)] == list(range(steps + 1))


def test_sweep_summary_modules_import_no_torch():
    code = ("import sys, rldynamics.sweep.command, rldynamics.sweep.report; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# ---------------------------------------------------------------------- one writer per run, whatever happens to a sweep

# A run that stays in its first attempt for a few seconds: no checkpoint before the last step.
NO_EARLY_CHECKPOINT = ["train.steps=20", "val.every=20", "checkpoint.every=20", "early_stop.enabled=false"]


def _sweep_args(out) -> list[str]:
    return ["sweep", "kl", "--values", "0", "--out", str(out), *FAST, *NO_EARLY_CHECKPOINT]


def _start_sweep(out) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rldynamics.cli", *_sweep_args(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _steps(run) -> list[int]:
    """The steps of metrics.jsonl in file order (a step logged twice appears twice)."""
    return [r["step"] for r in read_metrics(run)]


def _wait_for_rows(run, sweep: subprocess.Popen, rows: int = 2, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and sweep.poll() is None:
        if (run / "metrics.jsonl").is_file() and len(_steps(run)) >= rows:
            return
        time.sleep(0.05)
    pytest.fail(f"the sweep logged fewer than {rows} rows in {run} (exit code {sweep.poll()})")


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_second_sweep_into_a_running_sweep_is_refused(tmp_path, fast_overrides, capsys):
    out = tmp_path / "sw"
    run = out / "kl0" / "seed0"
    first = _start_sweep(out)
    try:
        _wait_for_rows(run, first)
        assert main(_sweep_args(out)) == 2
        assert first.poll() is None, "the first sweep ended before the second was refused; use more train.steps"
        err = capsys.readouterr().err
        assert f"{out} is in use by another sweep (pid {first.pid} " in err and len(err.splitlines()) == 1, err
        printed = first.communicate(timeout=300)[0]
    finally:
        first.kill()
    assert first.returncode == 0, printed
    assert _steps(run) == list(range(21))  # every step once, in one directory
    assert not list(out.glob("kl0/seed0.restarted-*"))
    assert [(r.label, r.state) for p in collect(out).points for r in p.runs] == [("kl0", "completed")]


@pytest.mark.slow
def test_killed_sweep_stops_its_trainer_and_the_rerun_logs_every_step_once(tmp_path, fast_overrides):
    out = tmp_path / "sw"
    run = out / "kl0" / "seed0"
    sweep = _start_sweep(out)
    try:
        _wait_for_rows(run, sweep)
        trainer = json.loads((run / ".lock").read_text())["pid"]
        sweep.kill()  # kill -9 of the sweep parent
        sweep.wait()
        deadline = time.monotonic() + 60
        while _alive(trainer) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(trainer), "the trainer outlived its sweep"
    finally:
        sweep.kill()
    killed = _steps(run)
    assert killed == list(range(len(killed))) and killed[-1] < 20, killed  # it stopped with its sweep

    assert main(_sweep_args(out)) == 0
    assert _steps(run) == list(range(21))
    aside = out / "kl0" / "seed0.restarted-1"
    assert _steps(aside) == killed and (aside / "config.yaml").is_file() and (run / "config.yaml").is_file()
    assert "moved to seed0.restarted-1" in (run / "train.log").read_text()


def _hold_lock(path) -> subprocess.Popen:
    """Another live process holding the run directory's lock, as a trainer does."""
    code = ("import sys, time; from rldynamics.tracking.run_dir import RunLock; RunLock(sys.argv[1]).__enter__(); "
            "print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.parametrize("checkpoint", [False, True], ids=["restart", "resume"])
def test_rerun_leaves_a_run_alone_while_its_trainer_lives(tmp_path, capsys, checkpoint):
    """A run whose lock a live process holds (a trainer that outlived its sweep, or one started by hand) is
    neither moved aside nor resumed: the sweep stops before starting anything and names the holder."""
    out = tmp_path / "sw"
    protocol = expand("kl", [["0"]])
    common = [*protocol.points[0].overrides, "checkpoint.every=1", "checkpoint.keep_last=1", "train.steps=2"]
    run = _write_run(out, "kl0", 0, [0.1, 0.1], common, status={"state": "running", "attempts": 1})
    if checkpoint:
        (run / "checkpoints" / "step_1").mkdir(parents=True)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"}
    holder = _hold_lock(run)
    try:
        assert main(["sweep", "kl", "--values", "0", "--out", str(out), *FAST]) == 2
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert f"{run} is in use by pid {holder.pid} " in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in (out / "kl0").iterdir()) == ["seed0"]
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"} == before


# ---------------------------------------------------------------------- the summary believes the run directories


def _damage(kind: str, run) -> str:
    """Damage `run` (a finished run whose trainer exited 0) as `kind`; returns the expected detail."""
    metrics = run / "metrics.jsonl"
    if kind == "truncated":
        metrics.write_bytes(metrics.read_bytes()[: len(metrics.read_bytes()) * 2 // 3])
        return "metrics.jsonl ends at step 1 of 2, though the trainer exited 0"
    if kind == "no_config":
        (run / "config.yaml").unlink()
        return "config.yaml is missing"
    if kind == "deleted":
        shutil.rmtree(run)
        return "its run directory is gone or empty (never started, or deleted)"
    if kind == "metrics_dir":
        metrics.unlink()
        metrics.mkdir()
        return "metrics.jsonl is not a file"
    lines = metrics.read_text().splitlines(keepends=True)  # two writers: rows 0, 1, 0, 2, 1, 2
    metrics.write_text("".join([lines[0], lines[1], lines[0], lines[2], lines[1], lines[2]]))
    return "metrics.jsonl logs step 0 twice"


@pytest.mark.parametrize("kind", ["truncated", "no_config", "deleted", "metrics_dir", "two_writers"])
def test_summarize_believes_the_run_directory_over_the_exit_code(tmp_path, capsys, kind):
    out = tmp_path / "sw"
    protocol = expand("kl", [["0", "0.1"]])
    plan = build_plan(protocol, [0, 1], out, overrides=FAST)
    record_runs(plan)  # what the launcher records before starting the runs
    for r in plan.runs:
        _write_run(out, r.point.label, r.seed, [0.1, 0.2, 0.3], [*r.overrides])
        write_status(r.path, sweep="kl", keys=["algo.kl_coef"], point=r.point.label, value=r.point.value,
                     index=r.index)
    detail = _damage(kind, out / "kl0.1" / "seed1")
    assert main(["sweep", "--summarize", str(out)]) == 1
    printed = capsys.readouterr()
    assert "Traceback" not in printed.out + printed.err
    assert "1 run(s) did not finish" in printed.out and "kl0.1/seed1 (" in printed.out
    found = {(r.label, r.seed): (r.state, r.detail) for p in collect(out).points for r in p.runs}
    assert list(found) == [("kl0", 0), ("kl0", 1), ("kl0.1", 0), ("kl0.1", 1)]  # a deleted run stays listed
    assert [s for s, _ in found.values()] == ["completed", "completed", "completed",
                                              "missing" if kind == "deleted" else "damaged"]
    assert detail in found["kl0.1", 1][1]
    assert detail in (out / "summary.md").read_text()
    csv_row = (out / "summary.csv").read_text().splitlines()[2]
    assert "completed;missing" in csv_row if kind == "deleted" else "completed;damaged" in csv_row


def test_rerun_restarts_a_damaged_run_instead_of_resuming_it(tmp_path):
    """A run with a checkpoint but no config.yaml cannot be resumed (the resume reads config.yaml): it restarts,
    its directory kept aside, instead of failing on every re-run."""
    out = tmp_path / "sw"
    protocol = expand("kl", [["0"]])
    common = [*protocol.points[0].overrides, "checkpoint.every=1", "checkpoint.keep_last=1", "train.steps=2"]
    run = _write_run(out, "kl0", 0, [0.1, 0.1], common, status={"state": "running"})
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    (run / "config.yaml").unlink()
    assert [r.action for r in build_plan(protocol, [0], out, overrides=FAST).runs] == ["restart"]


@pytest.mark.parametrize("key", ["seed", "log.name", "log.run_dir", "checkpoint.resume"])
def test_keys_the_sweep_sets_cannot_be_swept(tmp_path, capsys, key):
    out = tmp_path / "sw"
    assert main(["sweep", "custom", key, "--values", "1,2", "--out", str(out), *FAST]) == 2
    err = capsys.readouterr().err
    assert f"{key} cannot be swept" in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_out_that_is_a_file_is_one_line(tmp_path, capsys):
    out = tmp_path / "notes.txt"
    out.write_text("mine\n")
    assert main(["sweep", "kl", "--values", "0", "--out", str(out), *FAST]) == 2
    err = capsys.readouterr().err
    assert f"--out {out} is a file" in err and len(err.splitlines()) == 1, err
    assert out.read_text() == "mine\n"


def test_summary_that_cannot_be_written_is_one_line_and_keeps_the_old_files(tmp_path):
    """A write that fails (here: a file-size limit of 0 bytes, as a full disk does) ends in one line, exit code 1,
    and leaves the previous summary files whole."""
    out = tmp_path / "sw"
    _write_run(out, "a", 0, [0.1, 0.2, 0.3])
    write_summary(out)
    before = {f: (out / f).read_bytes() for f in FILES}

    def no_room():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))

    done = subprocess.run([sys.executable, "-m", "rldynamics.cli", "sweep", "--summarize", str(out)],
                          capture_output=True, text=True, preexec_fn=no_room, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    assert f"cannot write the summary in {out}" in done.stderr and "--summarize" in done.stderr
    assert {f: (out / f).read_bytes() for f in FILES} == before
    assert sorted(p.name for p in out.iterdir()) == sorted([*FILES, "a"])  # no temporary file left behind


def _running_with(marker: str) -> list[int]:
    """Pids of the live processes whose command line contains `marker`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes().decode(errors="replace") and _alive(
                    int(proc.name)):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_killed_launcher_of_a_run_on_several_ranks_stops_torchrun_and_the_ranks(tmp_path, fast_overrides):
    """A sweep run on several GPUs is `rldyn train --nproc D`: killing that launcher (as the end of its sweep does)
    stops torchrun and every rank (here two CPU ranks)."""
    runs = tmp_path / "ranks"
    run = runs / "two"
    launcher = subprocess.Popen([sys.executable, "-m", "rldynamics.cli", "train", "--nproc", "2", *FAST,
                                 "train.steps=200", "val.every=200", f"log.run_dir={runs}", "log.name=two"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_rows(run, launcher)
        assert len(_running_with(str(runs))) == 4  # the launcher, torchrun, two ranks
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 60
        while _running_with(str(runs)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running_with(str(runs)), "torchrun or a rank outlived the launcher"
    finally:
        launcher.kill()
    assert _steps(run)[-1] < 200


def test_dry_run_says_why_the_sweep_adds_checkpoint_settings(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["sweep", "top_p", "--values", "0.9,nofilter", "--out", str(out), "--dry-run", *FAST]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "checkpoint.keep_last=1: added by the sweep so that an interrupted sweep resumes" in printed
    assert main(["sweep", "top_p", "--values", "0.9", "--out", str(out), "--dry-run", *FAST,
                 "checkpoint.every=1", "checkpoint.keep_last=2"]) == 0
    assert "added by the sweep" not in capsys.readouterr().out  # the user's own choice needs no note
