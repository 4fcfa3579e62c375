"""Full gradient dumps of the analysis, written by a bounded background writer.

With `analysis.dump_gradients=true` every gradient the probe computes (each bucket, each loss term, each reward
component) is written in full, per parameter, to `analysis/step_<N>/gradients.npz`, next to the sketches: the
raw material for any offline study the logged norms, cosines and sketches do not answer.

- Keys are ``<prefix>/<bucket>/<term>/<parameter name>`` (e.g. ``grad_norm/all/task/model.embed_tokens.weight``,
  ``grad_norm/bucket_2/reward/correctness/lm_head.weight``), values float32 arrays of the parameter's shape,
  signed and unweighted like the sketches. ``np.load(path)[key]`` reads one array without loading the others.
- Bounded memory: at most `max_pending` dumps are held (queued or being written); the training step that would
  add one more waits until the oldest is on disk.
- Atomic: each file is written to ``.gradients.npz.tmp`` and renamed (`tracking.files.replacing`: never through a
  link), so a kill never leaves a half-written ``gradients.npz`` (a resumed run rewrites the steps after its
  checkpoint anyway).
- Errors surface: a dump that cannot be written (a full disk, a removed directory) is raised, with the file, at
  the next `submit` or at `close`, which the trainer calls when the run ends (it also waits for every queued
  dump: nothing is left unwritten at exit).
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import numpy as np

from rldynamics.tracking.files import replacing


class GradientDumpError(RuntimeError):
    """A gradient dump could not be written."""


class GradientDumper:
    """Write `.npz` gradient dumps on one background thread, holding at most `max_pending` in memory."""

    def __init__(self, max_pending: int = 2):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._slots = threading.BoundedSemaphore(max_pending)  # one per dump held in memory
        self._queue: queue.Queue = queue.Queue()
        self._error: GradientDumpError | None = None
        self._thread = threading.Thread(target=self._work, name="rldyn-gradient-dump", daemon=True)
        self._thread.start()

    def submit(self, path: str | Path, arrays: dict[str, np.ndarray]) -> None:
        """Queue `arrays` to be written to `path`; waits while `max_pending` dumps are still held."""
        self._raise_pending_error()
        self._slots.acquire()
        self._queue.put((Path(path), arrays))

    def close(self) -> None:
        """Write every queued dump, stop the thread, and raise the first error if any dump failed."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._raise_pending_error()

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            path, arrays = item
            try:
                if self._error is None:  # after a failure, later dumps are dropped until it is reported
                    write_npz(path, arrays)
            except Exception as e:  # noqa: BLE001 (handed to the training thread, which raises it)
                self._error = GradientDumpError(f"gradient dump {path} could not be written: "
                                                f"{e.__class__.__name__}: {e}")
            finally:
                del item, arrays
                self._slots.release()


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write `arrays` to `path` as an uncompressed `.npz`, atomically (temporary file, fsync, rename)."""
    with replacing(path, sync=True) as f:
        np.savez(f, **arrays)
