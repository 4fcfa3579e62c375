"""Math answer equivalence with `math-verify`, with a timeout per check and a time budget per rollout.

Design choices:
- math-verify's own timeouts use `signal.alarm`, which only works in the main thread and cannot interrupt
  a computation stuck in C (sympy evaluating `9^{9^{9^9}}` never returns). So its timeouts are switched
  off and every check runs in one persistent worker process (`python -m rldynamics.envs.answer_worker`,
  JSON lines over stdin/stdout). The caller waits for the reply with a deadline; a check that passes it
  kills the worker (a fresh one starts on the next check) and gives no verdict. Callers in any thread
  share the worker through a lock; the worker's start-up (importing sympy) has its own, longer deadline
  and never counts against a check.
- A worker that dies (killed for memory, say) is replaced: a check it was answering gives no verdict and
  one line on stderr says so; a worker found dead before a check is restarted silently. The worker never
  outlives this process, even when stuck in C (`answer_worker.die_with_parent`). Linux ties that death
  signal to the thread that started the worker, so workers are started by one long-lived thread of ours,
  never by a caller's thread, which may end sooner. A forked child forgets its parent's worker and thread
  (they are not its own) and starts its own.
- `check_budget(seconds)` gives the checks made inside it (in this thread: one rollout's) that many seconds
  in all: each check waits at most what is left, and once nothing is left a check that needs the worker
  gives no verdict at once. Worker restarts are paid from the budget; the process's first start is not.
  So a batch of replies that all hang costs the budget plus one restart, not their number times the timeout.
- No verdict (None) counts as "not equal" for the caller.
- Both sides are parsed by math-verify: a text without `$` or `\\boxed` is wrapped in `$...$` first, so
  `\\dfrac12`, `0.5`, `1/2` and `\\frac{1}{2}`, `1,000` and `1000`, `3\\sqrt2` and `\\sqrt{18}` agree.
  Units in `\\text{}` / `\\mathrm{}` and `\\$` are dropped, `50\\%` matches both 50 and 0.5 (and `-45\\%`
  both -45 and -0.45), `x=3` matches 3; plain-word units (`5 dollars`) do not match, and `1 2` reads as
  1 + 2 (math-verify's rules, pinned in tests/test_math_env.py).
- Two exact shortcuts skip the worker: identical texts (after trimming) are equal, and two integers written
  in ASCII digits (`-?[0-9]+`, at most Python's 4,300-digit conversion limit) are compared as integers,
  which is math-verify's answer for them. Identical texts are equal even where math-verify reads nothing
  (`١٢٣`, a 5,000-digit integer); any other Unicode digits and longer integers go to math-verify.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

STARTUP_TIMEOUT_S = 120.0
_INTEGER = re.compile(r"-?[0-9]+")  # ASCII digits only: math-verify reads no others as numbers


def quick_equal(gold: str, pred: str) -> bool | None:
    """The exact shortcuts: True/False when decided without math-verify, else None."""
    gold, pred = gold.strip(), pred.strip()
    if gold == pred:
        return True
    if _INTEGER.fullmatch(gold) and _INTEGER.fullmatch(pred):
        try:
            return int(gold) == int(pred)
        except ValueError:  # past Python's digit limit (sys.get_int_max_str_digits): math-verify decides
            return None
    return None


@dataclass
class CheckBudget:
    """Seconds of answer checking left to the checks inside one `check_budget` block."""

    left: float


_BUDGET: ContextVar[CheckBudget | None] = ContextVar("answer_check_budget", default=None)


@contextmanager
def check_budget(seconds: float) -> Iterator[CheckBudget]:
    """Give the answer checks made inside this block (in this thread) `seconds` seconds in all."""
    budget = CheckBudget(left=seconds)
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)


class AnswerChecker:
    """Checks answers in a persistent worker process; thread-safe; a check past its deadline kills the worker."""

    def __init__(self) -> None:
        self._forget_worker()
        self.timeouts = 0  # checks whose worker was killed at their deadline

    def _forget_worker(self) -> None:
        """No worker, without stopping one (also what a forked child does with its parent's)."""
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._replies: queue.Queue | None = None
        self._started = False
        self.busy = False  # a check is waiting for the worker's verdict

    @property
    def worker_pid(self) -> int | None:
        """The worker's process id (None before the first start and after `close`)."""
        return None if self._proc is None else self._proc.pid

    def equal(self, gold: str, pred: str, timeout: float) -> bool | None:
        """True/False as math-verify decides; None when there is no verdict: the check ran past `timeout` seconds
        or past the budget of the enclosing `check_budget`, or the worker died during it."""
        quick = quick_equal(gold, pred)
        if quick is not None:
            return quick
        budget = _BUDGET.get()
        if budget is not None and budget.left <= 0:
            return None
        with self._lock:
            first = not self._started
            with _paid_by(None if first else budget):
                replies = self._ensure_worker()
            if budget is not None and budget.left <= 0:
                return None
            with _paid_by(budget):
                return self._ask(replies, gold, pred, timeout if budget is None else min(timeout, budget.left))

    def _ask(self, replies: queue.Queue, gold: str, pred: str, timeout: float) -> bool | None:
        """Send one request to the running worker and wait up to `timeout` seconds for its verdict."""
        self.busy = True
        try:
            self._proc.stdin.write(json.dumps({"gold": gold, "pred": pred}) + "\n")
            self._proc.stdin.flush()
            reply = replies.get(timeout=timeout)
        except OSError:  # the pipe broke: the worker died before it read the request
            reply = None
        except queue.Empty:
            self.timeouts += 1
            self._stop_worker()
            return None
        finally:
            self.busy = False
        if reply is None:
            code = self._stop_worker()
            print(f"rldynamics: the math answer-check worker died during a check (exit code {code}, e.g. killed for "
                  "memory); that answer counts as wrong and a new worker starts", file=sys.stderr, flush=True)
            return None
        return bool(reply["equal"])

    def _ensure_worker(self) -> queue.Queue:
        if self._proc is not None and self._proc.poll() is None:
            return self._replies
        self._stop_worker()  # a worker that died while idle
        root = str(Path(__file__).resolve().parents[2])  # the directory holding the rldynamics package
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self._proc = _SPAWNER.popen([sys.executable, "-m", "rldynamics.envs.answer_worker", str(os.getpid())],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._started = True
        self._replies = queue.Queue()
        threading.Thread(target=_read_replies, args=(self._proc.stdout, self._replies), daemon=True).start()
        try:
            ready = self._replies.get(timeout=STARTUP_TIMEOUT_S)
        except queue.Empty:
            ready = None
        if not ready or not ready.get("ready"):
            self._stop_worker()
            raise RuntimeError("the math answer-check worker did not start; is math-verify installed? "
                               "(pip install math-verify)")
        return self._replies

    def _stop_worker(self) -> int | None:
        """Kill and reap the worker, if any; its exit code."""
        code = None
        if self._proc is not None:
            self._proc.kill()
            code = self._proc.wait()
            try:
                self._proc.stdin.close()
            except OSError:  # the pipe broke with the process
                pass
        self._proc = None
        return code

    def close(self) -> None:
        """Stop the worker (a later check starts a new one)."""
        with self._lock:
            self._stop_worker()


@contextmanager
def _paid_by(budget: CheckBudget | None) -> Iterator[None]:
    """Take the block's wall time from `budget` (nothing when None)."""
    start = time.monotonic()
    try:
        yield
    finally:
        if budget is not None:
            budget.left -= time.monotonic() - start


class _Spawner:
    """Starts processes from one daemon thread that lives as long as this process (see the module docstring)."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """No thread yet (also in a forked child, where the parent's thread does not exist)."""
        self._requests: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def popen(self, *args, **kwargs) -> subprocess.Popen:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="answer-check-spawner", daemon=True)
                self._thread.start()
        done: queue.Queue = queue.Queue(maxsize=1)
        self._requests.put((args, kwargs, done))
        result = done.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def _serve(self) -> None:
        while True:
            args, kwargs, done = self._requests.get()
            try:
                done.put(subprocess.Popen(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the caller, raised in its thread
                done.put(e)


def _read_replies(stream, replies: queue.Queue) -> None:
    """Forward each JSON line of the worker to `replies`; None at end of stream (which this thread then closes)."""
    with stream:
        for line in stream:
            try:
                replies.put(json.loads(line))
            except ValueError:  # a line cut short when the worker was killed
                break
    replies.put(None)


_SPAWNER = _Spawner()
CHECKER = AnswerChecker()
atexit.register(CHECKER.close)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: (_SPAWNER.forget(), CHECKER._forget_worker()))
