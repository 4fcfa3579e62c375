"""The run directory: the source of truth of a run. Plots, reports and sweeps read only this.

Layout:
    .lock                      held (fcntl.flock) by the one process writing the run; names it (pid, host, start)
    config.yaml                resolved config
    metrics.jsonl              one JSON object per logged step, always with "step"
    samples.jsonl              a few decoded trajectories per step
    rewards.jsonl              one row per training trajectory and step: reward components (raw and weighted),
                               total, response length, correct flag (`read_rewards`)
    events.jsonl               one row per health alarm and action (`train/diagnostics/health.py`)
    analysis/step_<N>/         gradient-analysis tables and sketches
    records/step_<N>.safetensors  step records (`tracking/step_records.py`): what step N trained on
    run_id                     the run's id, written with its first record (a replay checks it)
    rolled_back/attempt_<k>/   what the steps undone by the k-th rollback wrote (the same files, analysis/ too)
    checkpoints/step_<N>/      model weights (safetensors) + trainer state
    plots/, report.html        written by `rldyn plot` / `rldyn report`

Every file here is written through `tracking.files`: never through a symbolic link (one is refused, naming it),
whole files atomically.

This module imports no torch, so readers work on any machine with the run directory copied over.
Non-finite floats are written as JSON `NaN`/`Infinity` (Python's json reads them back).
The JSONL files are only ever appended to (one write per call, then closed), so they can be read while a run
is going; a line cut short by a crash is the last line of its file, and readers and resumes ignore it.

Crash safety: a resumed run drops every row (and analysis directory) after the step it resumes from, and a
line cut by a kill, by rewriting the file to a temporary name renamed over the old one, so a kill during the
rewrite loses nothing either; a damaged line elsewhere stops the resume (one line naming file and line).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from rldynamics.tracking.files import append_file, open_file, refuse_link, remove, write_file

LOCK_FILE = ".lock"
REWARDS_FILE = "rewards.jsonl"
EVENTS_FILE = "events.jsonl"
CONFIG_HISTORY_FILE = "config_history.jsonl"  # the settings a health rollback changed, and from which step
LOG_FILES = ("metrics.jsonl", "samples.jsonl", REWARDS_FILE, EVENTS_FILE)
ROLLED_BACK = "rolled_back"
STEP_DIRS = ("analysis", "records")  # directories of per-step entries `step_<N>` / `step_<N>.<ext>`


class RunInUse(OSError):
    """Another live process holds the run directory's lock; `holder` names it (`pid N on host H since T`)."""

    holder: str = ""


class RunLock:
    """Exclusive lock on a run directory: one writer per run.

    `fcntl.flock` on `<run>/.lock`: the kernel releases it when the holder exits, however it exits, so a
    lock left by a killed process is stale by construction and is taken over (the previous holder's pid,
    host and start time, still in the file, are reported in `stale`). A second process fails at once with
    `RunInUse` naming the holder. A clean release removes the file while still holding it; a process that locked
    the file just before it was removed finds the path no longer names its file and locks the new one, so two
    processes never hold two files of the same name. A link in place of the lock file is refused
    (`files.LinkRefused`), as every write of a run directory refuses one: truncating it would empty its target.
    """

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.stale: str | None = None
        self._fd: int | None = None

    def check(self) -> None:
        """Raise RunInUse now if a live process holds the lock; creates nothing (for checks before any work)."""
        refuse_link(self.path)
        if self.path.is_file():
            os.close(self._take(open_file(self.path, os.O_RDONLY)))

    def __enter__(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = self._take(open_file(self.path, os.O_RDWR | os.O_CREAT))
        while not _names(self.path, fd):  # removed by the holder that released it: lock the file there now
            os.close(fd)
            fd = self._take(open_file(self.path, os.O_RDWR | os.O_CREAT))
        previous = os.read(fd, 4096)
        self.stale = _describe(previous) if previous.strip() else None
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._fd = fd
        return self

    def _take(self, fd: int) -> int:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(os.read(fd, 4096))
            os.close(fd)
            error = RunInUse(f"run directory {self.path.parent} is in use by {holder}; wait for it to finish "
                             "or choose another log.name")
            error.holder = holder
            raise error from None
        return fd

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            if _names(self.path, self._fd):
                self.path.unlink()  # while held: see the class's docstring
            os.close(self._fd)  # closing releases the lock
            self._fd = None


def _names(path: Path, fd: int) -> bool:
    """Whether `path` is (still) the file open as `fd`."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    here = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino)


def check_no_links(run_dir: str | Path) -> None:
    """Refuse (`files.LinkRefused`) a link in place of a file a run writes: its lock, config.yaml and logs. Reads
    only, for the checks before any work (each writer refuses one again when it writes)."""
    for name in (LOCK_FILE, "config.yaml", *LOG_FILES):
        refuse_link(Path(run_dir) / name)


def _describe(content: bytes) -> str:
    """`pid N on host H since T` from a lock file's content (whatever it holds)."""
    try:
        info = json.loads(content.decode())
        return f"pid {info['pid']} on host {info['host']} since {info['started']}"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "another process (its lock file names no holder)"


class RunWriter:
    """Appends metrics and samples to a run directory; optional mirrors receive the same metrics."""

    def __init__(self, path: str | Path, sinks: list | None = None):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.sinks = sinks or []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append one metrics object for `step` (and forward it to the sinks)."""
        row = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        _append(self.path / "metrics.jsonl", [row])
        for sink in self.sinks:
            sink.log(step, row)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Append decoded trajectories (dicts with at least `text` and `reward`)."""
        _append(self.path / "samples.jsonl", [{"step": step, **s} for s in samples])

    def log_rewards(self, rows: list[dict[str, Any]]) -> None:
        """Append reward-tracking rows (one per trajectory, see `rollout.rewards.reward_rows`)."""
        _append(self.path / REWARDS_FILE, rows)

    def log_event(self, row: dict[str, Any]) -> None:
        """Append one health event (a dict with `step`, `rule`, `action`, ...)."""
        _append(self.path / EVENTS_FILE, [row])

    def log_config_change(self, row: dict[str, Any]) -> None:
        """Append one change of the run's settings (`CONFIG_HISTORY_FILE`: the step it applies after, the attempt
        and each changed key's [before, after]); config.yaml holds the settings of the latest steps."""
        _append(self.path / CONFIG_HISTORY_FILE, [row])

    def attempts(self) -> int:
        """Rollbacks this run has made (`rolled_back/attempt_<k>/` directories)."""
        return attempts(self.path)

    def archive_after(self, step: int) -> Path:
        """Move what was written for steps after `step` (log rows, analysis directories, step records) into a new
        `rolled_back/attempt_<k>/`, which is returned: the steps a rollback undoes stay on record, and the run's own
        files keep every step once."""
        archive = self.path / ROLLED_BACK / f"attempt_{self.attempts() + 1}"
        refuse_link(archive.parent)
        archive.mkdir(parents=True)
        for name in LOG_FILES:
            file = self.path / name
            if file.exists():
                later = [line for line in file.read_bytes().splitlines() if (row_step(line) or -1) > step]
                write_file(archive / name, b"".join(line + b"\n" for line in later))
        for entry in _step_entries(self.path, step):
            (archive / entry.parent.name).mkdir(exist_ok=True)
            entry.rename(archive / entry.parent.name / entry.name)
        self.truncate_after(step)
        return archive

    def analysis_dir(self, step: int) -> Path:
        """The directory for the analysis artefacts of `step` (created)."""
        d = self.path / "analysis" / f"step_{step}"
        refuse_link(d)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def truncate_after(self, step: int) -> None:
        """Drop what was written for steps after `step`: rows of metrics.jsonl, samples.jsonl and rewards.jsonl
        (and a last line cut by a kill), `analysis/step_<N>/` and `records/step_<N>.safetensors` with N > step.

        A resumed run calls this with the step of its checkpoint (-1 to restart from scratch) and then writes
        those steps again, so every step ends up in the run directory exactly once. Any other line that is not a
        JSON row with a step raises ValueError, and a link in place of one of the files `files.LinkRefused`, before
        anything is changed; an analysis directory that is a link is removed as a link.
        """
        kept = {}
        check_no_links(self.path)
        for name in LOG_FILES:
            file = self.path / name
            if file.exists():
                lines = file.read_bytes().splitlines()
                steps = [row_step(line) for line in lines]
                damaged = [i + 1 for i, n in enumerate(steps[:-1]) if n is None and lines[i].strip()]
                if damaged:
                    raise ValueError(f"{file}: line {damaged[0]} is not a JSON row with a step; repair or remove it "
                                     "before resuming")
                kept[file] = [line for line, n in zip(lines, steps, strict=True) if n is not None and n <= step]
                if len(kept[file]) == len(lines):
                    del kept[file]
        for file, lines in kept.items():
            write_file(file, b"".join(line + b"\n" for line in lines))
        for entry in _step_entries(self.path, step):
            remove(entry)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def _step_entries(run_dir: Path, after: int) -> list[Path]:
    """The `step_<N>` entries of `STEP_DIRS` with N > `after`."""
    out = []
    for name in STEP_DIRS:
        for entry in sorted((run_dir / name).glob("step_*")):
            number = entry.name[5:].split(".")[0]
            if number.isdigit() and int(number) > after:
                out.append(entry)
    return out


def _append(file: Path, rows: list[dict[str, Any]]) -> None:
    """Append rows as JSON lines with one write, so a kill leaves whole rows or a cut last line."""
    append_file(file, "".join(json.dumps(r) + "\n" for r in rows).encode())


def row_step(line: bytes) -> int | None:
    """The step of a JSON row written by `RunWriter`, or None for anything else."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def _plain(value: Any) -> Any:
    """A JSON-ready scalar (tensors and numpy scalars become Python numbers; floats are kept exact)."""
    return value.item() if hasattr(value, "item") else value


def _read_jsonl(file: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file; an unparsable *last* line (cut short by a crash) is skipped, others raise."""
    lines = [line for line in file.read_text().splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, start=1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number == len(lines):
                break
            raise ValueError(f"{file}: line {number} is not valid JSON ({e.msg})") from e
    return rows


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All metrics rows of a run, in file order."""
    file = Path(run_dir) / "metrics.jsonl"
    if not file.exists():
        raise FileNotFoundError(f"{file} not found: is {run_dir} a run directory written by `rldyn train`?")
    return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]


def read_rewards(run_dir: str | Path) -> list[dict[str, Any]]:
    """All reward-tracking rows of a run (one per training trajectory and step), in file order.

    Each row: `step`, `traj`, `group`, `prompt` (env seed), `reward` and `weighted` (component name -> value),
    `total`, `response_tokens`, `response_chars`, `correct`. Safe to call while the run is writing.
    """
    file = Path(run_dir) / REWARDS_FILE
    if not file.exists():
        raise FileNotFoundError(f"{file} not found: is {run_dir} a run directory written by `rldyn train`?")
    return _read_jsonl(file)


def read_samples(run_dir: str | Path) -> list[dict[str, Any]]:
    """The decoded trajectories of `samples.jsonl` (`step`, `seed`, `reward`, `success`, `text`); none when absent."""
    file = Path(run_dir) / "samples.jsonl"
    return _read_jsonl(file) if file.is_file() else []


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """The health events of `events.jsonl`, in file order; none when absent. Safe to call while the run is writing.

    An alarm row: `step`, `rule`, `action` (record | warn | skip | rollback | stop), `value`, `threshold`, `since`
    (the first step of the trouble), `message`. A rollback row: `step` (the checkpoint gone back to), `rule` and
    `action` "rollback", `from_step` (the step it left), `archive` (`attempt_<k>` under `rolled_back/`, which holds
    the rows of the undone steps: `read_events(run_dir / ROLLED_BACK / archive)` reads its alarms), `message`.
    """
    file = Path(run_dir) / EVENTS_FILE
    return _read_jsonl(file) if file.is_file() else []


def read_config(run_dir: str | Path) -> dict[str, Any]:
    """The resolved config of a run as a plain dict."""
    import yaml

    return yaml.safe_load((Path(run_dir) / "config.yaml").read_text())


def attempts(run_dir: Path) -> int:
    """Rollbacks the run in `run_dir` has made (`rolled_back/attempt_<k>/` directories)."""
    return len(list((Path(run_dir) / ROLLED_BACK).glob("attempt_*")))
