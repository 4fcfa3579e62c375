"""The answer checker and its worker process: the exact shortcuts agree with math-verify, a worker that dies is
replaced, a worker never outlives its parent, and a rollout's checks stop at its time budget."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rldynamics.envs.answer_check import CHECKER, AnswerChecker, check_budget, quick_equal

HANG = "9^{9^{9^{9}}}"  # sympy evaluates it in C for hours, holding the GIL


def _gone(pid: int) -> bool:
    """True when process `pid` has exited (a zombie waiting for its reaper counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def _wait_for(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _busy_worker(checker: AnswerChecker) -> tuple[threading.Thread, dict]:
    """A thread running a check that never ends on its own; returns once the worker has the request."""
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(verdict=checker.equal("1", HANG, timeout=120.0)))
    thread.start()
    assert _wait_for(lambda: checker.busy, 120)
    time.sleep(0.5)  # inside sympy by now
    return thread, out


def test_integers_beyond_pythons_digit_limit_never_raise():
    """int() refuses more than 4,300 digits; such integers go to math-verify (which cannot read them either)."""
    long = "1" * 5000
    assert quick_equal(long, long) is True  # identical texts
    assert quick_equal(long, "0" + long) is None and quick_equal("7", long) is None
    assert CHECKER.equal(long, "7", timeout=30.0) is False
    assert CHECKER.equal("0" + long, long, timeout=30.0) is False  # math-verify's verdict for these texts


@pytest.mark.parametrize("pred", ["١٢٣", "１２３", "-１２３", "1２3"])
def test_only_ascii_digits_take_the_integer_shortcut(pred):
    """math-verify does not read Unicode digits as numbers, so neither does the shortcut."""
    assert quick_equal("123", pred) is None
    assert CHECKER.equal("123", pred, timeout=30.0) is False


@pytest.mark.parametrize("gold, pred", [("7", "007"), ("0", "-0"), ("-12", "-12"), ("12", "13")])
def test_integer_shortcut_agrees_with_math_verify(gold, pred):
    from rldynamics.envs.answer_worker import verify_equal

    assert quick_equal(gold, pred) is verify_equal(gold, pred)


def test_worker_killed_mid_check_counts_as_wrong_and_checks_go_on(capfd):
    """A worker that dies during a check (here kill -9, as the kernel kills for memory) gives no verdict; the next
    check starts a new worker."""
    checker = AnswerChecker()
    try:
        thread, out = _busy_worker(checker)
        pid = checker.worker_pid
        os.kill(pid, signal.SIGKILL)
        thread.join(30)
        assert not thread.is_alive() and out == {"verdict": None}
        assert "answer-check worker died during a check" in capfd.readouterr().err
        assert checker.equal("\\frac{1}{2}", "0.5", timeout=30.0) is True and checker.worker_pid != pid
    finally:
        checker.close()


def test_worker_that_died_while_idle_is_replaced():
    checker = AnswerChecker()
    try:
        assert checker.equal("\\frac{1}{2}", "0.5", timeout=30.0) is True
        pid = checker.worker_pid
        os.kill(pid, signal.SIGKILL)
        assert _wait_for(lambda: _gone(pid), 10)
        assert checker.equal("\\frac{1}{2}", "0.25", timeout=30.0) is False and checker.worker_pid != pid
    finally:
        checker.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the worker's death signal is Linux's prctl")
def test_worker_dies_with_its_parent_even_inside_sympy():
    """kill -9 of the training process while its worker is stuck in C: the worker goes too."""
    code = textwrap.dedent(f"""
        import sys, threading, time
        from rldynamics.envs.answer_check import CHECKER
        threading.Thread(target=CHECKER.equal, args=("1", {HANG!r}, 600.0), daemon=True).start()
        while not CHECKER.busy:
            time.sleep(0.05)
        time.sleep(0.5)
        print(CHECKER.worker_pid, flush=True)
        time.sleep(600)
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    worker = None
    try:
        worker = int(parent.stdout.readline())
        assert not _gone(worker)
        parent.kill()
        parent.wait()
        assert _wait_for(lambda: _gone(worker), 5.0), "the answer-check worker outlived its parent by 5 s"
    finally:
        parent.kill()
        parent.wait()
        if worker is not None and not _gone(worker):
            os.kill(worker, signal.SIGKILL)  # a failed test leaves no process computing for hours


def test_worker_outlives_the_thread_that_started_it():
    """Linux sends the death signal when the *thread* that started a process exits; the worker must not care."""
    checker = AnswerChecker()
    try:
        thread = threading.Thread(target=checker.equal, args=("\\frac{1}{2}", "0.5", 30.0))
        thread.start()
        thread.join(120)
        pid = checker.worker_pid
        time.sleep(0.5)
        assert not _gone(pid)
        assert checker.equal("\\frac{1}{2}", "0.5", timeout=30.0) is True and checker.worker_pid == pid
    finally:
        checker.close()


def test_budget_gives_later_checks_no_time():
    """Inside `check_budget(s)` the checks share s seconds: once spent, a check that needs math-verify is answered
    None at once (the exact shortcuts still answer); outside it, each check has its own timeout only."""
    checker = AnswerChecker()
    try:
        checker.equal("\\frac{1}{2}", "0.5", timeout=30.0)  # the first start-up is paid by no budget
        with check_budget(1.5) as budget:
            verdicts = [checker.equal("1", HANG, timeout=1.0) for _ in range(8)]
            assert checker.equal("12", "12.0", timeout=30.0) is None  # math-verify's case, but no time is left
            assert checker.equal("12", "012", timeout=30.0) is True  # the shortcut needs no time
        assert verdicts == [None] * 8 and budget.left <= 0
        assert checker.timeouts <= 2  # the first check's 1 s, perhaps one more; without the budget all 8 time out
        assert checker.equal("12", "12.0", timeout=30.0) is True  # outside the block: no budget
    finally:
        checker.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_checks_with_a_worker_of_its_own():
    """A process forked from one whose worker (and worker-starting thread) run starts its own; the parent's goes on."""
    assert CHECKER.equal("\\frac{1}{2}", "0.5", timeout=120.0) is True
    parents = CHECKER.worker_pid
    child = os.fork()
    if child == 0:  # the child: the parent's threads do not exist here
        ok = CHECKER.equal("\\frac{1}{2}", "0.25", timeout=60.0) is False and CHECKER.worker_pid != parents
        CHECKER.close()
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 120
    while (done := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    assert done[0] == child and os.waitstatus_to_exitcode(done[1]) == 0
    assert CHECKER.equal("\\frac{1}{2}", "0.5", timeout=120.0) is True and CHECKER.worker_pid == parents
