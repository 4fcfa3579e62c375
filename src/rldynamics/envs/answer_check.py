"""Math answer equivalence with `math-verify`, with a timeout per check that works in any thread.

Design choices:
- math-verify's own timeouts use `signal.alarm`, which only works in the main thread and cannot interrupt
  a computation stuck in C (sympy evaluating `9^{9^{9^9}}` never returns). So its timeouts are switched
  off and every check runs in one persistent worker process (`python -m rldynamics.envs.answer_worker`,
  JSON lines over stdin/stdout). The caller waits for the reply with a deadline; a check that passes it
  kills the worker (a fresh one starts on the next check) and counts as "not equal". Callers in any
  thread share the worker through a lock; the worker's start-up (importing sympy) has its own, longer
  deadline and never counts against a check.
- Both sides are parsed by math-verify: a text without `$` or `\\boxed` is wrapped in `$...$` first, so
  `\\dfrac12`, `0.5`, `1/2` and `\\frac{1}{2}`, `1,000` and `1000`, `3\\sqrt2` and `\\sqrt{18}` agree.
  Units in `\\text{}` / `\\mathrm{}` and `\\$` are dropped, `50\\%` matches both 50 and 0.5, `x=3`
  matches 3; plain-word units (`5 dollars`) do not match, and `1 2` reads as 1 + 2 (math-verify's rules,
  pinned in tests/test_math_env.py).
- Two exact shortcuts skip the worker: identical texts (after trimming) are equal, and two plain integers
  are compared as integers. Both give math-verify's own answer for those inputs.
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
from pathlib import Path

STARTUP_TIMEOUT_S = 120.0
_INTEGER = re.compile(r"-?\d+")


def quick_equal(gold: str, pred: str) -> bool | None:
    """The exact shortcuts: True/False when decided without math-verify, else None."""
    gold, pred = gold.strip(), pred.strip()
    if gold == pred:
        return True
    if _INTEGER.fullmatch(gold) and _INTEGER.fullmatch(pred):
        return int(gold) == int(pred)
    return None


class AnswerChecker:
    """Checks answers in a persistent worker process; thread-safe; a check past its deadline kills the worker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._replies: queue.Queue | None = None
        self.timeouts = 0

    def equal(self, gold: str, pred: str, timeout: float) -> bool | None:
        """True/False as math-verify decides; None when the check ran past `timeout` seconds."""
        quick = quick_equal(gold, pred)
        if quick is not None:
            return quick
        with self._lock:
            replies = self._ensure_worker()
            self._proc.stdin.write(json.dumps({"gold": gold, "pred": pred}) + "\n")
            self._proc.stdin.flush()
            try:
                reply = replies.get(timeout=timeout)
            except queue.Empty:
                self.timeouts += 1
                self._stop_worker()
                return None
            if reply is None:
                self._stop_worker()
                raise RuntimeError("the math answer-check worker exited unexpectedly (see its error output above)")
            return bool(reply["equal"])

    def _ensure_worker(self) -> queue.Queue:
        if self._proc is not None and self._proc.poll() is None:
            return self._replies
        root = str(Path(__file__).resolve().parents[2])  # the directory holding the rldynamics package
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self._proc = subprocess.Popen([sys.executable, "-m", "rldynamics.envs.answer_worker"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=env)
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

    def _stop_worker(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            try:
                self._proc.stdin.close()
            except OSError:  # the pipe broke with the process
                pass
        self._proc = None

    def close(self) -> None:
        """Stop the worker (a later check starts a new one)."""
        with self._lock:
            self._stop_worker()


def _read_replies(stream, replies: queue.Queue) -> None:
    """Forward each JSON line of the worker to `replies`; None at end of stream."""
    for line in stream:
        replies.put(json.loads(line))
    replies.put(None)


CHECKER = AnswerChecker()
atexit.register(CHECKER.close)
