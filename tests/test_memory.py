"""Freed memory kept for reuse (`rldynamics.memory`): what it reports, and its opt-out."""

from __future__ import annotations

import sys

import pytest

from rldynamics.memory import keep_freed_memory


def test_the_opt_out_leaves_malloc_alone():
    assert keep_freed_memory({"RLDYN_KEEP_MEMORY": "0"}) == "malloc's defaults (RLDYN_KEEP_MEMORY=0)"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux's")
def test_linux_keeps_freed_memory_and_a_run_records_it(fast_overrides):
    from rldynamics.config import make_config
    from rldynamics.tracking.environment import read_environment
    from rldynamics.train.trainer import train

    assert keep_freed_memory({}) == "kept"
    run = train(make_config(overrides=[*fast_overrides, "train.steps=1"]))
    assert read_environment(run)[0]["malloc"] == "kept"


def test_available_memory_reads_memavailable(tmp_path):
    from rldynamics.memory import available_memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:         1000 kB\nMemAvailable:   22000000 kB\n")
    assert available_memory(str(meminfo)) == 22000000 * 1024
    meminfo.write_text("MemTotal:       24576000 kB\n")
    assert available_memory(str(meminfo)) is None  # a kernel without the field
    assert available_memory(str(tmp_path / "missing")) is None
