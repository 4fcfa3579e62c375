"""Running a sweep plan: one `rldyn train` process per run, on CPU thread shares or disjoint GPU sets.

- Slots: on CPU `--parallel K` gives K slots that split the cores (`OMP_NUM_THREADS` and friends; an exported
  `OMP_NUM_THREADS` is kept), so K runs do not oversubscribe the machine; on GPUs `--devices 0,1,2,3 --devices-per-run D` gives one slot per D
  devices (`CUDA_VISIBLE_DEVICES`), with the cores split the same way.
- Each run is its own process group writing stdout and stderr to `<run>/train.log`; a crash is recorded in
  `<run>/sweep.json` with its last log line, and the other runs go on.
- Ctrl-C (or SIGTERM) interrupts every running run (SIGTERM, then SIGKILL after a grace period), records
  them as interrupted and returns; re-running the sweep resumes them from their latest checkpoint.
- One writer per run, whatever happens to the sweep: the sweep holds `OUT/.lock` (a second sweep into OUT
  stops at once), every run it starts dies with it (`stop_with_parent`, kill -9 of the sweep included), and
  a run whose lock a live process still holds is neither moved aside nor resumed.
- A rich table shows each run's state, step, latest validation success and early-stop reason (on a
  terminal); every state change is also printed as one line, so logs of background sweeps are readable.
This module imports no torch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from rldynamics.sweep import runs
from rldynamics.sweep.plan_types import RunPlan, SweepPlan
from rldynamics.sweep.protocols import SweepError
from rldynamics.threads import default_threads, explicit_threads
from rldynamics.tracking.run_dir import RunInUse, RunLock

GRACE_S = 20.0
POLL_S = 0.5
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
STATE_STYLE = {"running": "cyan", "completed": "green", "early_stopped": "yellow", "failed": "red",
               "damaged": "red", "interrupted": "magenta", "pending": "dim"}
PR_SET_PDEATHSIG = 1  # prctl option, <linux/prctl.h>
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None  # loaded before any fork


def stop_with_parent(parent: int) -> Callable[[], None]:
    """A `preexec_fn` for children of `parent` (this process) that must not outlive it.

    The child asks the kernel for SIGTERM when its parent dies (Linux `prctl(PR_SET_PDEATHSIG)`, kept across
    exec), which also covers a parent killed by SIGKILL or the out-of-memory killer, where no handler of the
    parent runs; a parent that died before the request was made is seen by `getppid` and the child stops at
    once. SIGTERM, not SIGKILL: `rldyn train` has no handler and dies at once (its run directory is crash-safe),
    and torchrun (`rldyn train --nproc`) stops its ranks on SIGTERM, which SIGKILL would leave running.
    The request is tied to the thread that forks, here the main thread. Elsewhere than Linux this does nothing:
    children then outlive a killed sweep, and a re-run refuses their runs while they hold their run locks.
    """
    def arm() -> None:
        if _LIBC is not None:
            _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


@contextmanager
def sweep_lock(out: Path) -> Iterator[None]:
    """Hold `OUT/.lock` (created with OUT) for the whole sweep: a second sweep into OUT stops at once, naming the
    first; the kernel releases the lock however the sweep ends, kill -9 included."""
    out.mkdir(parents=True, exist_ok=True)
    with ExitStack() as held:
        try:
            held.enter_context(RunLock(out))
        except RunInUse as e:
            raise SweepError(f"{out} is in use by another sweep ({e.holder}); wait for it to finish or give "
                             "another --out") from None
        yield


@dataclass
class Slot:
    """Where one run executes: a name for the table and the environment variables that confine it."""

    name: str
    env: dict[str, str]
    ranks: int = 1  # GPUs of the slot: a run on several is launched with `rldyn train --nproc` (FSDP2)


def cpu_count() -> int:
    """Cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def make_slots(parallel: int | None = None, devices: list[str] | None = None, devices_per_run: int = 1,
               cores: int | None = None) -> list[Slot]:
    """CPU slots (`parallel`) or GPU slots (disjoint groups of `devices_per_run` of `devices`).

    Each slot's thread count is an exported `OMP_NUM_THREADS` when there is one (the user's explicit choice), else
    the slot's share of the cores; on CPU at most what one run alone takes by default (`threads.default_threads`).
    A `model.threads=N` override, given to every run, wins over both (`threads.choose_threads`)."""
    cores = cores or cpu_count()
    if devices:
        if parallel is not None:
            raise SweepError("give --parallel for CPU runs or --devices for GPU runs, not both")
        if devices_per_run < 1 or len(devices) % devices_per_run:
            raise SweepError(f"--devices-per-run {devices_per_run} does not divide the {len(devices)} device(s) "
                             f"{','.join(devices)}")
        if len(set(devices)) != len(devices):
            raise SweepError(f"--devices lists a device twice: {','.join(devices)}")
        groups = [devices[i:i + devices_per_run] for i in range(0, len(devices), devices_per_run)]
        threads = str(explicit_threads() or max(1, cores // len(groups)))
        return [Slot(f"cuda {','.join(g)}",
                     {"CUDA_VISIBLE_DEVICES": ",".join(g), **dict.fromkeys(THREAD_VARS, threads)}, ranks=len(g))
                for g in groups]
    if devices_per_run != 1:
        raise SweepError("--devices-per-run needs --devices (the GPU ids to split between runs)")
    parallel = 1 if parallel is None else parallel
    if parallel < 1:
        raise SweepError(f"--parallel must be >= 1, got {parallel}")
    threads = str(explicit_threads() or max(1, min(cores // parallel, default_threads(cores))))
    return [Slot(f"cpu {i}", dict.fromkeys(THREAD_VARS, threads)) for i in range(parallel)]


@dataclass
class Job:
    """A run being executed (or waiting) and what the table shows about it."""

    plan: RunPlan
    state: str = "pending"
    slot: Slot | None = None
    proc: subprocess.Popen | None = None
    started: float = 0.0
    where: str = ""  # the slot it ran on, kept once it finished (or as recorded by the sweep that ran it)
    took: float | None = None  # wall seconds of its last attempt, once finished
    seen: tuple[int, float] | None = None
    shown: runs.Outcome = field(default_factory=lambda: runs.Outcome("pending"))

    @property
    def name(self) -> str:
        return f"{self.plan.point.label} seed {self.plan.seed}"

    def refresh(self) -> runs.Outcome:
        """Re-read the run directory when its metrics file changed."""
        file = self.plan.path / "metrics.jsonl"
        try:
            stat = file.stat()
            key = (stat.st_size, stat.st_mtime)
        except OSError:
            key = None
        if key != self.seen:
            self.seen = key
            self.shown = runs.outcome(self.plan.path)
        return self.shown


def _command(sweep: SweepPlan, plan: RunPlan, ranks: int = 1) -> list[str]:
    cmd = [sys.executable, "-m", "rldynamics.cli", "train", "--preset", sweep.preset]
    if ranks > 1:
        cmd += ["--nproc", str(ranks)]
    if sweep.config_file:
        cmd += ["--config", sweep.config_file]
    return cmd + plan.train_overrides()


def _set_aside(path: Path) -> Path:
    """Move an attempt that stopped before its first checkpoint to `seed<s>.restarted-<k>` (nothing is deleted)."""
    k = 1
    while (aside := path.with_name(f"{path.name}.restarted-{k}")).exists():
        k += 1
    path.rename(aside)
    return aside


class Launcher:
    """Runs the jobs of a plan on the slots; `run()` returns the jobs with their final states."""

    def __init__(self, sweep: SweepPlan, slots: list[Slot], console: Console | None = None):
        self.sweep = sweep
        self.slots = slots
        self.console = console or Console()
        self.jobs = [Job(p) for p in sweep.runs]
        for job in self.jobs:
            if job.plan.action == "skip":
                job.state = job.refresh().state
                status = runs.read_status(job.plan.path)
                job.where = str(status.get("where") or "earlier sweep")
                job.took = status.get("seconds") if isinstance(status.get("seconds"), (int, float)) else None

    # ------------------------------------------------------------------ process handling

    def _start(self, job: Job, slot: Slot) -> None:
        """Start the run on `slot`; RunInUse, before anything is written, when a live process holds its lock."""
        plan = job.plan
        RunLock(plan.path).check()
        status = runs.read_status(plan.path)
        note = {"start": "fresh start", "resume": "resuming from the latest checkpoint"}.get(plan.action, "")
        if plan.action == "restart":
            aside = _set_aside(plan.path)
            note = f"the previous attempt stopped before its first checkpoint; it was moved to {aside.name}"
        attempt = int(status.get("attempts", 0)) + 1
        runs.write_status(plan.path, sweep=self.sweep.protocol.name, keys=list(self.sweep.protocol.keys),
                          point=plan.point.label, value=plan.point.value, index=plan.index, seed=plan.seed,
                          overrides=plan.overrides, attempts=attempt, state="running", returncode=None, error="")
        cmd = _command(self.sweep, plan, slot.ranks)
        env = {**os.environ, **slot.env, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(plan.path / runs.LOG_FILE, "a") as log:
            log.write(f"=== rldyn sweep: attempt {attempt} on {slot.name} ({note})\n=== {' '.join(cmd)}\n")
            log.flush()
            job.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                        start_new_session=True, preexec_fn=stop_with_parent(os.getpid()))
        job.state, job.slot, job.started, job.where, job.took = "running", slot, time.monotonic(), slot.name, None
        self.console.print(f"[cyan]started[/] {job.name} on {slot.name} ({note})")

    def _finished(self, job: Job, returncode: int) -> None:
        job.proc, job.slot = None, None
        job.seen = None
        job.took = round(time.monotonic() - job.started, 1)
        runs.write_status(job.plan.path, where=job.where, seconds=job.took)
        if returncode == 0:  # the metrics decide: rows that stop short or repeat make the run damaged
            runs.write_status(job.plan.path, returncode=0, error="")
            found = job.refresh()
            job.state = found.state
            runs.write_status(job.plan.path, state=job.state, error=found.detail if job.state == "damaged" else "")
            detail = f": {found.detail}" if found.detail else ""
            self.console.print(f"[{STATE_STYLE.get(job.state, '')}]{job.state}[/]{detail} {job.name} at step "
                               f"{found.step} (val success {_pct(found.val_success)})")
            return
        found = job.refresh()
        tail = runs.log_tail(job.plan.path)
        if returncode < 0:  # e.g. SIGKILL from the kernel's out-of-memory killer
            error = f"killed by {signal.Signals(-returncode).name}"
        else:
            error = tail[-1] if tail else f"exit code {returncode}"
        job.state = "failed"
        job.shown = runs.Outcome("failed", error, found.step, found.steps, found.val_success)
        runs.write_status(job.plan.path, state="failed", returncode=returncode, error=error)
        self.console.print(f"[red]failed[/] {job.name} (exit code {returncode}): {error}\n"
                           f"  log: {job.plan.path / runs.LOG_FILE}\n" + "\n".join(f"  | {t}" for t in tail[-8:]))

    def _interrupt(self) -> None:
        """Stop every running run: SIGTERM to its process group (a background sweep's children ignore SIGINT),
        SIGKILL after the grace period (or at once on a second Ctrl-C), and record each as interrupted."""
        running = [j for j in self.jobs if j.proc is not None]
        if running:
            self.console.print(f"[magenta]interrupting {len(running)} run(s)... (Ctrl-C again to kill them now)")
        for job in running:
            _signal(job.proc, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        try:
            while any(j.proc.poll() is None for j in running) and time.monotonic() < deadline:
                time.sleep(0.1)
        except KeyboardInterrupt:
            pass
        for job in running:
            if job.proc.poll() is None:
                _signal(job.proc, signal.SIGKILL)
            rc = job.proc.wait()
            job.proc, job.slot, job.state = None, None, "interrupted"
            job.took = round(time.monotonic() - job.started, 1)
            runs.write_status(job.plan.path, state="interrupted", returncode=rc, error="interrupted by the sweep")

    # ------------------------------------------------------------------ scheduling

    def _next(self) -> Job | None:
        """The next pending job, preferring one whose seed no running job has (runs of one seed share
        one-off per-seed set-up such as the tiny model's warm start, which the first of them then caches)."""
        pending = [j for j in self.jobs if j.state == "pending"]
        busy = {j.plan.seed for j in self.jobs if j.state == "running"}
        return next((j for j in pending if j.plan.seed not in busy), pending[0] if pending else None)

    def run(self) -> list[Job]:
        """Run every pending job; returns the jobs. Ctrl-C / SIGTERM interrupt cleanly (states recorded)."""
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        live = Live(self.table(), console=self.console, auto_refresh=False, transient=False,
                    redirect_stdout=False, redirect_stderr=False)
        try:
            with live:
                self._loop(live)
        except KeyboardInterrupt:
            self._interrupt()
            self.console.print(self.table())
        finally:
            signal.signal(signal.SIGTERM, previous)
        return self.jobs

    def _loop(self, live: Live) -> None:
        free = list(self.slots)
        while True:
            for job in [j for j in self.jobs if j.proc is not None]:
                rc = job.proc.poll()
                if rc is not None:
                    free.append(job.slot)
                    self._finished(job, rc)
            while free and (job := self._next()) is not None:
                try:
                    self._start(job, free[0])
                    free.pop(0)
                except RunInUse as e:  # started by hand since the plan was made: left to that process
                    job.state, job.shown = "failed", runs.Outcome("failed", f"{job.plan.path} is in use by {e.holder}")
                    self.console.print(f"[red]not started[/] {job.name}: {job.shown.detail}")
            live.update(self.table(), refresh=self.console.is_terminal)
            if not any(j.state in ("pending", "running") for j in self.jobs):
                return
            time.sleep(POLL_S)

    def table(self) -> Table:
        """The live view: one row per run."""
        table = Table(title=f"sweep {self.sweep.protocol.name} -> {self.sweep.out}", title_justify="left")
        for col in ("point", "seed", "state", "step", "val success", "early stop / error", "where", "time"):
            table.add_column(col, justify="right" if col in ("seed", "step", "val success", "time") else "left")
        for job in self.jobs:
            seen = job.refresh() if job.state == "running" else job.shown
            state = job.state
            step = "" if seen.step is None else f"{seen.step}/{seen.steps}"
            took = time.monotonic() - job.started if job.state == "running" else job.took
            table.add_row(job.plan.point.label, str(job.plan.seed), f"[{STATE_STYLE.get(state, '')}]{state}",
                          step, _pct(seen.val_success), seen.detail[:60], job.where, "" if took is None else
                          f"{took:.0f}s")
        return table


def _pct(value: float) -> str:
    return "" if value != value else f"{100 * value:.1f} %"


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _raise_interrupt(signum, frame):  # noqa: ARG001 - signal handler signature
    raise KeyboardInterrupt
