"""The answer-check worker process: math-verify on JSON-line requests (started by `envs.answer_check`).

Protocol: `python -m rldynamics.envs.answer_worker PARENT_PID`; after start-up the worker prints
`{"ready": true}`; then for each stdin line `{"gold": ..., "pred": ...}` it prints one line
`{"equal": true|false}`. It exits at the end of stdin.
math-verify's own (signal-based) timeouts are off: the parent enforces the deadline by killing this process.

The worker never outlives its parent. A check can sit in C for hours holding the GIL (sympy computing
`9^{9^{9^9}}`), where no thread of this process can run, so on Linux the kernel kills it when the parent goes
(`PR_SET_PDEATHSIG`); elsewhere a thread notices a new parent process id within a second (which works
whenever the check runs Python code).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import sys
import threading
import time

_DELIMITER = re.compile(r"(?<!\\)\$")  # a math delimiter: a dollar sign not escaped as \$
_PR_SET_PDEATHSIG = 1


def as_math(text: str) -> str:
    """`text` ready for math-verify's LaTeX extraction: wrapped in `$...$` unless it has a `$` (not `\\$`)
    or a `\\boxed`."""
    text = text.strip()
    return text if (_DELIMITER.search(text) or "\\boxed" in text) else f"${text}$"


def signed_percent(expr):
    """`-45\\%` as math-verify reads `45\\%`: (-45) * 1/100, not -1 * 45 * 1/100.

    math-verify matches a percentage with its number (`50\\%` = 50 = 0.5) only in the two-factor form, so
    without this `-45\\%` matched -0.45 but not -45."""
    from sympy import Mul, Number, Rational, UnevaluatedExpr

    if (isinstance(expr, Mul) and len(expr.args) == 3 and expr.args[0] == -1 and isinstance(expr.args[1], Number)
            and expr.args[2] == UnevaluatedExpr(Rational(1, 100))):
        return Mul(-expr.args[1], expr.args[2], evaluate=False)
    return expr


def verify_equal(gold: str, pred: str) -> bool:
    """math-verify's verdict on (gold, prediction), both parsed, with its signal-based timeouts disabled."""
    from math_verify import parse, verify

    parsed_gold = [signed_percent(e) for e in parse(as_math(gold), parsing_timeout=None)]
    parsed_pred = [signed_percent(e) for e in parse(as_math(pred), parsing_timeout=None)]
    return bool(parsed_gold and parsed_pred and verify(parsed_gold, parsed_pred, timeout_seconds=None))


def die_with_parent(parent: int) -> None:
    """Make sure this process ends when process `parent` does (see the module docstring)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    else:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # the parent went before the death signal was set
        os._exit(1)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def serve(parent: int) -> None:
    """Worker main loop: one JSON request per stdin line, one JSON reply per stdout line."""
    import logging

    die_with_parent(parent)
    logging.disable(logging.WARNING)  # math-verify warns that its own timeouts are off: that is the point
    verify_equal("1", "\\frac{2}{2}")  # import sympy and warm the LaTeX parser before reporting ready
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            equal = verify_equal(request["gold"], request["pred"])
        except Exception:  # noqa: BLE001 - math-verify raises on exotic input; that answer is not equal
            equal = False
        print(json.dumps({"equal": equal}), flush=True)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
