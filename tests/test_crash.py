"""Crash safety and one writer per run directory.

A real `rldyn train` process is killed (SIGKILL) at named write boundaries through the `RLDYN_CRASH_AT` test hook
(`train/checkpoint.py: crash_point`), resumed, killed again, and finally completed: the run directory must then
hold every step's row, samples and analysis exactly once, and the weights of an uninterrupted run, bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import FAST
from rldynamics.cli import main
from rldynamics.config import make_config
from rldynamics.tracking.run_dir import RunInUse, RunLock, RunWriter, read_metrics
from rldynamics.train.trainer import train

# Each resume starts where the previous process was killed: before the first checkpoint (restart from step 0),
# between a step's row and its checkpoint, and inside a checkpoint write (leaving a temporary directory).
KILLS = [("samples", 1), ("logged", 2), ("checkpoint_files", 3)]
SETTINGS = ["train.steps=3", "checkpoint.every=1", "algo.adv_estimator=gae", "analysis.enabled=true",
            "analysis.every=2", "val.every=2", "model.threads=1"]  # in this process and the killed ones alike


def _rldyn_train(args: list[str], crash_at: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RLDYN_CRASH_AT", None)
    if crash_at:
        env["RLDYN_CRASH_AT"] = crash_at
    return subprocess.run([sys.executable, "-m", "rldynamics.cli", "train", *args], env=env, capture_output=True,
                          text=True, timeout=900)


def _lines(file: Path) -> list[dict]:
    return [json.loads(line) for line in file.read_text().splitlines()]


def _without_timing(rows: list[dict]) -> list[dict]:
    """The rows without timings, NaN (an undefined cosine) made comparable."""
    return [{k: "nan" if v != v else v for k, v in r.items() if not k.startswith("timing_s/")} for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_killed_at_write_boundaries_then_resumed(fast_overrides, lora):
    if lora:
        pytest.importorskip("peft")
    settings = [*SETTINGS, *(["model.lora.rank=4", "checkpoint.save_merged=true"] if lora else [])]
    # names of one length: a step record's header holds the run's name, so `record/bytes` compares equal
    intact = train(make_config(overrides=[*fast_overrides, *settings, "log.name=intact"]))
    run = intact.parent / "killed"
    args = [*fast_overrides, *settings, "log.name=killed"]
    for n, (point, step) in enumerate(KILLS):
        out = _rldyn_train(args + (["checkpoint.resume=latest"] if n else []), crash_at=f"{point}:{step}")
        assert out.returncode == -signal.SIGKILL, out.stderr
    assert list((run / "checkpoints").glob(".tmp_step_3_*"))  # the last kill left a half-written checkpoint
    out = _rldyn_train([f"log.run_dir={run.parent}", "log.name=killed", "checkpoint.resume=latest"])
    assert out.returncode == 0, out.stderr

    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 3]
    assert _without_timing(read_metrics(run)) == _without_timing(read_metrics(intact))
    assert _lines(run / "samples.jsonl") == _lines(intact / "samples.jsonl")
    assert [s["step"] for s in _lines(run / "samples.jsonl")] == [1, 2, 3]
    assert _lines(run / "rewards.jsonl") == _lines(intact / "rewards.jsonl")
    assert sorted(p.name for p in (run / "analysis").iterdir()) == ["step_1", "step_3"]
    for step in (1, 3):
        assert (run / f"analysis/step_{step}/groups.csv").read_bytes() == \
            (intact / f"analysis/step_{step}/groups.csv").read_bytes()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1", "step_2", "step_3"]
    actor = ["actor/adapter_model.safetensors", "actor_merged/model.safetensors"] if lora else [
        "actor/model.safetensors"]
    for part in (*actor, "critic/value_head.safetensors"):
        a, b = (load_file(str(r / "checkpoints/step_3" / part)) for r in (intact, run))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


HOLD = "import sys, time\nfrom rldynamics.tracking.run_dir import RunLock\nwith RunLock(sys.argv[1]):\n" \
       "    print('locked', flush=True)\n    time.sleep(120)\n"


def test_second_writer_fails_at_once_naming_the_holder(fast_overrides, capsys):
    run = Path(fast_overrides[-1].split("=", 1)[1]) / "busy"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(["train", *fast_overrides, "log.name=busy"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"pid {holder.pid} on host" in err and "in use" in err
        assert [p.name for p in run.iterdir()] == [".lock"]  # nothing written
    finally:
        holder.kill()
        holder.wait()
    # The holder was killed: its lock is stale, the next start takes it over and says so.
    assert main(["train", *fast_overrides, "log.name=busy"]) == 0
    assert f"last opened by pid {holder.pid}" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2]


def test_lock_is_exclusive_within_one_process_too(tmp_path):
    with RunLock(tmp_path / "run") as first:
        assert first.stale is None
        with pytest.raises(RunInUse, match=f"pid {os.getpid()}"):
            RunLock(tmp_path / "run").check()
        with pytest.raises(RunInUse), RunLock(tmp_path / "run"):
            pass
    with RunLock(tmp_path / "run") as again:  # released cleanly: not stale
        assert again.stale is None


def test_resume_truncation_keeps_steps_up_to_the_checkpoint(tmp_path):
    writer = RunWriter(tmp_path)
    for step in range(4):
        writer.log(step, {"x": float(step)})
        writer.log_samples(step, [{"text": "t", "reward": 0.0}])
        writer.analysis_dir(step)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "x": 1.')  # a row cut by a kill
    writer.truncate_after(1)
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    assert [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == [0, 1]
    assert sorted(p.name for p in (tmp_path / "analysis").iterdir()) == ["step_0", "step_1"]
    damaged = (tmp_path / "metrics.jsonl").read_bytes().replace(b'{"step": 0', b'{"stop": 0')
    (tmp_path / "metrics.jsonl").write_bytes(damaged + b'{"step": 1, "x": 2.0}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl: line 1 is not a JSON row with a step"):
        writer.truncate_after(0)
    assert (tmp_path / "metrics.jsonl").read_bytes() == damaged + b'{"step": 1, "x": 2.0}\n'  # unchanged


def _victim(tmp_path: Path, name: str) -> Path:
    victim = tmp_path / "victims" / name
    victim.parent.mkdir(exist_ok=True)
    victim.write_text(f"precious {name}\n")
    return victim


@pytest.fixture(scope="module")
def one_step_run(tiny_cache, tmp_path_factory) -> Path:
    """A run with a checkpoint at step 1 (to be copied, then resumed)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLDYN_CACHE", tiny_cache)
        return train(make_config(overrides=[*FAST, f"log.run_dir={tmp_path_factory.mktemp('runs')}", "log.name=linked",
                                            "train.steps=1", "val.every=0"]))


@pytest.mark.parametrize("link", [".lock", "metrics.jsonl", "samples.jsonl", ".metrics.jsonl.tmp", ".config.yaml.tmp"])
def test_resume_never_writes_through_a_link(one_step_run, fast_overrides, tmp_path, capsys, link):
    """A link in the run directory where the run writes a file (its lock, a log, a temporary file of an atomic
    rewrite) is never written through: the file it points to stays as it was. A link in place of a file the run
    owns is refused in one line naming it, before anything is written; a link in place of a temporary file is
    removed (the temporary file is created anew, exclusively)."""
    run = shutil.copytree(one_step_run, tmp_path / "runs" / "linked")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "x": 1.')  # a row cut by a kill: the resume rewrites metrics.jsonl
    victim = _victim(tmp_path, "file")
    if (run / link).exists():
        (run / link).unlink()
    (run / link).symlink_to(victim)
    code = main(["train", *fast_overrides, "log.name=linked", "checkpoint.resume=latest", "val.every=0"])
    err = capsys.readouterr().err.strip()
    assert victim.read_text() == "precious file\n"
    if link.endswith(".tmp"):
        assert code == 0 and [r["step"] for r in read_metrics(run)] == [0, 1, 2]
    else:
        assert code == 2 and len(err.splitlines()) == 1 and f"{run / link} is a symbolic link" in err, err


def test_writers_never_follow_links(tmp_path):
    """Each writer of a run directory on its own: the lock, the logs and an analysis directory that is a link."""
    run = tmp_path / "run"
    run.mkdir()
    victim = _victim(tmp_path, "lock")
    (run / ".lock").symlink_to(victim)
    for attempt in (lambda: RunLock(run).check(), lambda: RunLock(run).__enter__()):
        with pytest.raises(OSError, match="is a symbolic link"):
            attempt()
    assert victim.read_text() == "precious lock\n"
    (run / ".lock").unlink()
    writer = RunWriter(run)
    for name, write in (("metrics.jsonl", lambda: writer.log(1, {"x": 1.0})),
                        ("rewards.jsonl", lambda: writer.log_rewards([{"step": 1}]))):
        victim = _victim(tmp_path, name)
        (run / name).symlink_to(victim)
        with pytest.raises(OSError, match="is a symbolic link"):
            write()
        with pytest.raises(OSError, match="is a symbolic link"):  # the resume refuses it before any change
            writer.truncate_after(0)
        assert victim.read_text() == f"precious {name}\n"
        (run / name).unlink()
    kept = tmp_path / "victims" / "directory"
    kept.mkdir()
    (kept / "groups.csv").write_text("precious\n")
    (run / "analysis").mkdir()
    (run / "analysis" / "step_3").symlink_to(kept, target_is_directory=True)
    with pytest.raises(OSError, match="is a symbolic link"):
        writer.analysis_dir(3)
    writer.truncate_after(2)  # removes the link (step 3 is after the resumed step), never what it points to
    assert not (run / "analysis" / "step_3").exists() and (kept / "groups.csv").read_text() == "precious\n"


def _can_mount_tmpfs() -> bool:
    """True when this machine lets an unprivileged user namespace mount a small tmpfs (a disk that fills up)."""
    try:
        return subprocess.run(["unshare", "-r", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                              capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs `unshare -r -m` to mount a small tmpfs")
def test_full_disk_during_a_checkpoint_then_resumed(fast_overrides, tmp_path):
    """A real run on a real file system that fills up (a tmpfs in its own mount namespace): step 2's row fits but
    its checkpoint does not. The run ends with one line naming the checkpoint and the last complete one; once
    space is freed, `checkpoint.resume=latest` repeats step 2 and the run holds every step exactly once."""
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    train = [sys.executable, "-m", "rldynamics.cli", "train", *fast_overrides[:-1], f"log.run_dir={disk}",
             "log.name=full", "val.every=0"]
    first, again = " ".join([*train, "train.steps=1"]), " ".join([*train, "checkpoint.resume=latest"])
    script = f"""set -e
    mount -t tmpfs -o size=64m tmpfs {disk}
    {first} > {out}.1 2>&1
    head -c 200000 /dev/zero > {disk}/room
    cat /dev/zero > {disk}/filler 2>/dev/null || true
    rm {disk}/room
    {again} > {out}.2 2>{out}.2.err && exit 3 || echo $? > {out}.2.code
    rm {disk}/filler
    {again} > {out}.3 2>&1
    cp -r {disk}/full {out}
    """
    done = subprocess.run(["unshare", "-r", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (done.stderr, *(Path(f"{out}.{n}").read_text()[-2000:] for n in (1, 2, 3)
                                                  if Path(f"{out}.{n}").exists()))
    err = Path(f"{out}.2.err").read_text().strip()
    assert Path(f"{out}.2.code").read_text().strip() == "2"
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"{disk / 'full' / 'checkpoints' / 'step_2'} could not be written" in err, err
    assert f"the last complete checkpoint, {disk / 'full' / 'checkpoints' / 'step_1'}, is still there" in err, err
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1", "step_2"]
