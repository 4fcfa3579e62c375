"""A run opened for steps, shared by `rldyn train` and `rldyn probe`: set up, locked, first written; then closed.

Crash safety: the run directory is locked for the whole run (one writer), and a step's row is written before its
checkpoint is published, so no checkpoint is ever ahead of the rows; a resumed run drops what was written after
its checkpoint (rows, samples, analysis) and writes those steps again: every step once.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from pathlib import Path

from rldynamics import dist
from rldynamics.config import Config
from rldynamics.tracking.run_dir import RunLock
from rldynamics.train import setup
from rldynamics.train.diagnostics.base import TRAIN
from rldynamics.train.early_stop import EarlyStopper
from rldynamics.train.session import Session, Start


@contextmanager
def opened(cfg: Config, run_dir: Path | None = None, *, job: str = TRAIN, report: bool = True):
    """A session of `job` set up (`setup`: checks, models, the resumed checkpoint, the job's diagnostics) with its
    run directory locked and first written; yields (session, start, early stopper). After the body: every
    diagnostic's background work done (gradient dumps on disk), the writer closed and, with `report` and
    `log.report`, the report written (not after an error: what was written stays as it is).

    Under torchrun every rank calls it; the checks and the run directory are rank 0's (`dist.on_main`), so a start
    that fails raises the same error on every rank before any work."""
    setup.check_world(cfg, job=job)
    run_dir = dist.on_main(lambda: run_dir or setup.resolve_run_dir(cfg))
    start = dist.on_main(setup.plan_start, cfg, run_dir)  # reads only; raises before any work
    stopper = EarlyStopper.for_run(cfg)
    setup.load_early_stop(stopper, start)
    s = setup.make_session(cfg, run_dir, start, job)  # writes nothing
    with ExitStack() as held:
        dist.on_main(_open, s, start, held)
        try:
            yield s, start, stopper
        finally:
            for d in s.diagnostics:
                d.close()
        if s.main:
            s.writer.close()
        if report and cfg.log.report:
            report_on_ranks(s.run_dir)


def _open(s: Session, start: Start, held: ExitStack) -> None:
    """Lock the run directory for as long as `held` is (one writer per run), then make the first writes."""
    lock = held.enter_context(RunLock(s.run_dir))
    setup.open_run(s, start)
    if lock.stale:
        print(f"note: {s.run_dir} was last opened by {lock.stale}, which ended without closing it")
    if start.in_place and start.checkpoint is None:
        print(f"note: {s.run_dir} has no checkpoint yet; training it again from step 0")


def report_on_ranks(run_dir: Path) -> None:
    """`report_run` once every rank is past rank 0's last write: rank 0 writes the report, and with several ranks
    rank 1 draws the figures beside it (in one process, both)."""
    dist.barrier()
    report_run(run_dir, figures=dist.rank() == min(1, dist.world() - 1), page=dist.is_main())
    dist.barrier()  # both are done before anything is said of them


def report_run(run_dir: Path, figures: bool = True, page: bool = True) -> None:
    """The figures (`plots/`) and the HTML report of the finished run, each where asked: they read only the run
    directory and not each other, so two ranks draw them side by side.

    The run is complete before this; a figure that cannot be drawn is reported in one line and never fails it."""
    from rldynamics.plots.cli import plot_command, report_command

    try:
        if figures:
            plot_command(run_dir, list_files=False)
        if page:
            report_command(run_dir, quiet=True)
    except Exception as e:  # noqa: BLE001 (the training result must not be lost to a plotting problem)
        print(f"warning: the figures or report of {run_dir} could not be written ({e.__class__.__name__}: "
              f"{str(e).splitlines()[0] if str(e) else ''}); the run directory is complete, retry with "
              f"`rldyn report {run_dir}`")
