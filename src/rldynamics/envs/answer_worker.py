"""The answer-check worker process: math-verify on JSON-line requests (started by `envs.answer_check`).

Protocol: after start-up the worker prints `{"ready": true}`; then for each stdin line
`{"gold": ..., "pred": ...}` it prints one line `{"equal": true|false}`. It exits at the end of stdin.
math-verify's own (signal-based) timeouts are off: the parent enforces the deadline by killing this process.
"""

from __future__ import annotations

import json
import re
import sys

_DELIMITER = re.compile(r"(?<!\\)\$")  # a math delimiter: a dollar sign not escaped as \$


def as_math(text: str) -> str:
    """`text` ready for math-verify's LaTeX extraction: wrapped in `$...$` unless it has a `$` (not `\\$`)
    or a `\\boxed`."""
    text = text.strip()
    return text if (_DELIMITER.search(text) or "\\boxed" in text) else f"${text}$"


def verify_equal(gold: str, pred: str) -> bool:
    """math-verify's verdict on (gold, prediction), both parsed, with its signal-based timeouts disabled."""
    from math_verify import parse, verify

    parsed_gold = parse(as_math(gold), parsing_timeout=None)
    parsed_pred = parse(as_math(pred), parsing_timeout=None)
    return bool(parsed_gold and parsed_pred and verify(parsed_gold, parsed_pred, timeout_seconds=None))


def serve() -> None:
    """Worker main loop: one JSON request per stdin line, one JSON reply per stdout line."""
    import logging

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
    serve()
