"""The stand-alone RL doctors of bench/doctors.py over converted logs; run by the Python of an environment that holds
them (rlwatch 0.5.1, rlprobe 0.1.0, rldoctor 0.2.0, rlvr-audit 0.1.0), never by this project's.

    .venv-doctors/bin/python bench/doctors_tools.py INPUTS.json > alarms.json

INPUTS.json: a list, per run, of each tool's input as `doctors.convert` writes it. Prints, per run and tool,
{detector: the first step t at which the tool, fed steps 1..t, reported it at its warning level or above}, each
tool at its default thresholds:
- rlwatch: one `RLWatch` fed step by step (`log_step`); every alert it sends (warning or critical) counts.
- rlprobe: the recording written with its `RunWriter` and read back; its doctor (`diagnose_view`) on the steps up to
  t, for every t, as its `RunWatcher` does after each part file; findings warn or critical count (info does not).
- rldoctor: `diagnose(run_from_records(records up to t))` for every t; findings WARNING or CRITICAL count (as its
  LiveMonitor's `alert_at`). `rldoctor_live`: its `LiveMonitor` at its defaults (a check every 25 records from 60
  on).
- rlvr-audit: `audit_portfolio` (what `rlvr-audit inspect` computes) over each step's prompts. The tool has no
  run-level alarm; a step counts as flagged when none of its prompts is HEALTHY (`no_healthy_prompt`) or when the
  portfolio lists anomalies (`anomaly`).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import sys
import tempfile
from pathlib import Path

import numpy as np


def rlwatch_fired(steps: list) -> dict[str, int]:
    from rlwatch.config import RLWatchConfig
    from rlwatch.core import RLWatch

    fired: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = RLWatchConfig(run_id="run", framework="manual")
        cfg.storage.log_dir = tmp  # its SQLite store
        monitor = RLWatch(cfg)
        monitor.start()
        for step, kwargs in steps:
            if "rewards" in kwargs:
                kwargs = {**kwargs, "rewards": np.asarray(kwargs["rewards"], dtype=float)}
            with contextlib.redirect_stderr(io.StringIO()):  # its console panels
                for alert in monitor.log_step(step, **kwargs):
                    fired.setdefault(alert.detector, step)
        monitor.stop()
    return fired


def rlprobe_fired(data: dict) -> dict[str, int]:
    from rlprobe.doctor import diagnose_view
    from rlprobe.doctor.runview import RunView
    from rlprobe.schemas import RunManifest, StepRecord
    from rlprobe.storage import RunReader, RunWriter

    fired: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        with RunWriter(tmp, RunManifest(**data["manifest"])) as writer:
            for record in data["steps"]:
                writer.add_step(StepRecord(**record))
        reader = RunReader(tmp)
        records = reader.steps()
        for k in range(1, len(records) + 1):
            for f in diagnose_view(RunView(reader.manifest, records[:k], samples_provider=reader.samples)):
                if f.severity in ("warn", "critical"):
                    fired.setdefault(f.signature_id, records[k - 1].step)
    return fired


def rldoctor_fired(data: dict) -> tuple[dict[str, int], dict[str, int]]:
    from rl_doctor import diagnose, run_from_records
    from rl_doctor.detectors.base import Severity
    from rl_doctor.live import LiveMonitor

    records, fired, live = data["records"], {}, {}
    for k in range(1, len(records) + 1):
        try:
            run = run_from_records(records[:k], config=data["config"])
        except ValueError:
            continue
        for f in diagnose(run).findings:
            if f.severity >= Severity.WARNING:
                fired.setdefault(f.detector, records[k - 1]["step"])
    monitor = LiveMonitor(config=data["config"], on_finding=lambda f: None)
    for record in records:
        for f in monitor.log(record):
            live.setdefault(f.detector, record["step"])
    return fired, live


def rlvr_audit_fired(data: dict) -> dict[str, int]:
    from rlvr_audit import audit_portfolio

    fired: dict[str, int] = {}
    for step, prompts in data["steps"]:
        report = audit_portfolio(prompts, G=data["G"])
        if not report["verdict_histogram"].get("HEALTHY"):
            fired.setdefault("no_healthy_prompt", step)
        if report["anomaly_prompt_ids"]:
            fired.setdefault("anomaly", step)
    return fired


def main(path: str) -> int:
    logging.disable(logging.CRITICAL)  # the tools' own log lines
    out = {}
    for run in json.loads(Path(path).read_text()):
        doctor, live = rldoctor_fired(run["rldoctor"])
        out[run["run"]] = {"rlwatch": rlwatch_fired(run["rlwatch"]), "rlprobe": rlprobe_fired(run["rlprobe"]),
                           "rldoctor": doctor, "rldoctor_live": live, "rlvr_audit": rlvr_audit_fired(run["rlvr_audit"])}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
