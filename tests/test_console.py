"""The console of `rldyn train` / `rldyn probe` as a user sees it in a log file: the CLI in a subprocess, its output
to a pipe (no terminal)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAST

SRC = str(Path(__file__).resolve().parents[1] / "src")


def rldyn(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC, "RLDYN_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "rldynamics.cli", *args], env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """A 2-step run with progress on and a warm start of 2 epochs (a cache of its own, so the warm start runs), its
    stdout a pipe; then a probe of its last checkpoint."""
    tmp = tmp_path_factory.mktemp("console")
    fast = [o for o in FAST if not o.startswith(("log.progress", "model.warm_start_epochs"))]
    train = rldyn("train", *fast, "model.warm_start_epochs=2", "log.progress=true", "log.name=r",
                  f"log.run_dir={tmp / 'runs'}", cache=tmp / "cache")
    assert train.returncode == 0, train.stderr
    probe = rldyn("probe", str(tmp / "runs" / "r" / "checkpoints" / "step_2"), "--validate", "analysis.env_groups=2",
                  "log.progress=true", f"log.run_dir={tmp / 'runs'}", cache=tmp / "cache")
    assert probe.returncode == 0, probe.stderr
    return train.stdout, probe.stdout


def test_step_0_line_shows_the_initial_validation(logged_run):
    lines = logged_run[0].splitlines()
    step0 = [line for line in lines if line.startswith("step 0")]
    assert len(step0) == 1 and re.search(r"\| val \d", step0[0]), lines


def test_without_a_terminal_each_step_and_warm_start_epoch_is_one_plain_line(logged_run):
    out = logged_run[0]
    lines = out.splitlines()
    epochs = [line for line in lines if line.startswith("warm start epoch")]
    assert [e.split(" |")[0] for e in epochs] == ["warm start epoch 1/2", "warm start epoch 2/2"], lines
    assert all("NLL" in e for e in epochs)
    steps = [line for line in lines if re.match(r"step [12]/2 \|", line)]
    assert len(steps) == 2 and all("reward" in s and "elapsed" in s for s in steps), lines
    assert "━" not in out and "\x1b[" not in out  # no bar drawn, no terminal codes in a log file


def test_probe_labels_its_work_as_a_probe(logged_run):
    out = logged_run[1]
    assert "train" not in out.replace("/train", "") and "exited after" not in out, out
    assert re.search(r"^probe of step 2 done: gradient analysis written$", out, re.M), out
    assert re.search(r"^probe of step 2 \| val \d", out, re.M), out  # --validate: the checkpoint's validation
