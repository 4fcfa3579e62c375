"""Sweeps: pinned protocol expansions, plans, summaries from run directories, tiny sweeps end to end."""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import FAST
from rldynamics.cli import main
from rldynamics.config import ConfigError, make_config, save_config
from rldynamics.sweep.launch import make_slots
from rldynamics.sweep.plan import build_plan
from rldynamics.sweep.protocols import SweepError, expand, split_values
from rldynamics.sweep.report import FILES, write_summary
from rldynamics.sweep.runs import write_status
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


def test_slots_split_cores_and_devices():
    cpu = make_slots(parallel=2, cores=2)
    assert [(s.name, s.env["OMP_NUM_THREADS"]) for s in cpu] == [("cpu 0", "1"), ("cpu 1", "1")]
    gpu = make_slots(devices=["0", "1", "2", "3"], devices_per_run=2, cores=16)
    assert [(s.env["CUDA_VISIBLE_DEVICES"], s.env["OMP_NUM_THREADS"]) for s in gpu] == [("0,1", "8"), ("2,3", "8")]
    assert [s.ranks for s in gpu] == [2, 2] and [s.ranks for s in cpu] == [1, 1]  # two GPUs: rldyn train --nproc 2
    for bad in (dict(devices=["0", "1", "2"], devices_per_run=2), dict(parallel=2, devices=["0"]),
                dict(devices_per_run=2), dict(parallel=0)):
        with pytest.raises(SweepError):
            make_slots(**bad)


def _write_run(out, label, seed, val, overrides=(), stop=None, status=None):
    """A run directory written with the real RunWriter: validation every step, `stop` = early-stop reason."""
    path = out / label / f"seed{seed}"
    cfg = make_config(overrides=[*FAST, f"train.steps={len(val) - 1}", f"seed={seed}", f"log.run_dir={out / label}",
                                 f"log.name=seed{seed}", *overrides])
    path.mkdir(parents=True)
    save_config(cfg, path / "config.yaml")
    writer = RunWriter(path)
    for step, v in enumerate(val):
        row = {"val-env/sokoban/success": v, "timing_s/val": 1.0}
        if step > 0:
            row.update({"rollout/in_group_reward_std": 0.5 * step, "rollout/filter_kept_ratio": 1.0,
                        "timing_s/step": 2.0})
        if stop and step == len(val) - 1:
            row[f"early_stopped/{stop}"] = 1.0
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
    assert {p: p.read_text() for p in out.glob("*/seed0/train.log")} == logs

    copy = tmp_path / "copied"
    shutil.copytree(out, copy)
    for f in FILES:
        (copy / f).unlink()
    assert main(["sweep", "--summarize", str(copy)]) == 0
    for f in FILES:
        assert (copy / f).read_bytes() == (out / f).read_bytes(), f


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


def test_interrupted_sweep_resumes_from_checkpoints(tmp_path, fast_overrides):
    # Enough steps that the run is still going when the first checkpoint appears, however fast the machine.
    steps = 40
    out = tmp_path / "sw"
    args = ["sweep", "kl", "--values", "0", "--out", str(out), *FAST, f"train.steps={steps}",
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
