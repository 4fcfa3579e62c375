"""Reward functions the way TRL users write them: plain Python callables named in `env.reward_funcs`.

Design choices:
- A function is named `module:function` (a module on the import path; the working directory is put on it) or
  `path/to/file.py:function`. It is called as TRL calls its `reward_funcs`: keyword arguments `prompts` (each
  trajectory's first observation: the data set prompt), `completions` (each trajectory's reply, a string: single-turn
  envs) and one list per data set column of the env's rows (math: `question`, `answer` and any other column of the
  file; synthetic problems: `question`, `answer`); it returns one number per completion. `None` (TRL: "does not
  apply to this row") counts 0.
- Each function is a named reward component (its `__name__`) with weight `env.reward_weights.<name>` (default 1.0),
  appended after the env's own components; the trained reward stays the weighted sum formed in `rollout.rewards`.
- Functions are imported and checked when the config is validated (a missing module or name, two functions of one
  name, a name an env component already has: one line, before any work). They run only for single-turn envs
  (`env.max_turns=1`, or an env that grades the whole reply): a completion is then one reply.
- Each call gets its own copy of the arguments (`completions`, `prompts` and the columns, whose list cells come from
  the process's data set cache): a function that edits them in place changes nothing another function, another row
  or a later step sees.
- A function that raises (`sys.exit` included), or returns something other than one finite number (or None) per
  completion, loses only the rows it failed on; a finite number beyond float32's range (|v| > 3.4e38, the precision
  rewards are trained in) counts as a failure too, since it would become an infinite reward and a NaN loss: the batch call is retried row by row, each failing row gets 0 for that component and counts
  in the per-trajectory metric `reward_func_errors` (logged as `<stage>/<env>/reward_func_errors`, the mean number of
  failed functions per trajectory), and the first failure of each function is printed once in one line naming the
  function, the row (its data set location or env seed, and the start of its prompt) and the error. The run goes on.
  A Ctrl-C (KeyboardInterrupt) inside a function stops the run as a Ctrl-C anywhere else does.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import math
import numbers
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ERRORS = "reward_func_errors"  # per-trajectory metric: functions that failed on the trajectory's row
FLOAT32_MAX = 3.4028234663852886e38  # the largest reward magnitude the float32 reward tensors hold


@dataclass
class RewardFunc:
    """A user reward function: its component name, the spec it was named by, the callable."""

    name: str
    spec: str
    fn: Callable


def load_reward_funcs(specs: Sequence[str]) -> list[RewardFunc]:
    """Import every `module:function` / `file.py:function`; ValueError naming the spec when one cannot be used."""
    funcs = [RewardFunc(name=_name(spec, fn), spec=spec, fn=fn) for spec in specs for fn in [_import(spec)]]
    names = [f.name for f in funcs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"env.reward_funcs names two functions called {twice[0]!r}; each function is a reward "
                         "component named after it, so rename one")
    return funcs


_LOADED: dict[str, Callable] = {}  # spec -> function, imported once per process
_WARNED: set[str] = set()  # specs whose first failure was printed (once per process, not once per rollout)


def _import(spec: str) -> Callable:
    return load_function(spec)


def load_function(spec: str, key: str = "env.reward_funcs entry") -> Callable:
    """The function `spec` names (`module:function` or `path/file.py:function`), imported once
    per process; ValueError naming `key` and `spec` when it cannot be used (reward functions and
    the Gymnasium adapter's `render`)."""
    if spec in _LOADED:
        return _LOADED[spec]
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{key} {spec!r} is not of the form module:function or "
                         "path/file.py:function")
    try:
        module = _module(module_name)
    except Exception as e:  # noqa: BLE001 (the user's module may raise anything while importing)
        raise ValueError(f"{key} {spec!r}: cannot import {module_name!r} "
                         f"({e.__class__.__name__}: {_first_line(e)}); put its directory on "
                         "PYTHONPATH or give path/to/file.py:function") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{key} {spec!r}: {module_name!r} has no function {attr!r}")
    _LOADED[spec] = fn
    return fn


def _module(name: str):
    if name.endswith(".py"):
        path = Path(name).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no file {path}")
        module_spec = importlib.util.spec_from_file_location(f"rldyn_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # `rldyn` as a console script does not put the working directory on the path
    return importlib.import_module(name)


def _name(spec: str, fn: Callable) -> str:
    name = getattr(fn, "__name__", "") or spec.rpartition(":")[2]
    return name if name != "<lambda>" else spec.rpartition(":")[2]


@dataclass
class Graded:
    """What `score` found: per function, one value per row; per row, the number of functions that failed on it."""

    values: dict[str, list[float]]
    errors: list[int]


def score(funcs: list[RewardFunc], prompts: list[str], completions: list[str], columns: list[dict],
          locations: list[str], warn: Callable[[str], None]) -> Graded:
    """Call every function on the whole batch (TRL's convention), falling back to one row at a time for a function
    whose batch call fails; a row a function fails on gets 0 and counts in `errors` (see the module docstring)."""
    n = len(completions)
    kwargs = {"prompts": list(prompts), "completions": list(completions), **_column_lists(columns)}
    values, errors = {}, [0] * n
    for f in funcs:
        try:
            values[f.name] = _checked(f.fn(**_fresh(kwargs)), n)
        except (Exception, SystemExit):  # noqa: BLE001 (the user's function may raise anything; rows retried below)
            values[f.name] = []
            for i in range(n):
                try:
                    values[f.name] += _checked(f.fn(**_fresh(kwargs, slice(i, i + 1))), 1)
                except (Exception, SystemExit) as e:  # noqa: BLE001
                    values[f.name].append(0.0)
                    errors[i] += 1
                    if f.spec not in _WARNED:
                        _WARNED.add(f.spec)
                        warn(f"warning: reward function {f.spec} failed on {locations[i]} (prompt {prompts[i][:40]!r}): "
                             f"{e.__class__.__name__}: {_first_line(e)}; that row's {f.name} is 0, counted in "
                             f"<stage>/<env>/{ERRORS} (later failures of {f.name} are counted, not printed)")
    return Graded(values=values, errors=errors)


def _fresh(kwargs: dict[str, list], rows: slice = slice(None)) -> dict[str, list]:
    """A copy of `rows` of every argument list, each cell copied on its own (rows that shared a cell share no copy)."""
    return {k: [copy.deepcopy(cell) for cell in v[rows]] for k, v in kwargs.items()}


def _column_lists(columns: list[dict]) -> dict[str, list]:
    """One list per column (rows missing a column give None there); names TRL passes itself are left out."""
    names = [k for row in columns for k in row]
    names = [k for i, k in enumerate(names) if k not in names[:i] and k not in ("prompts", "completions")]
    return {k: [row.get(k) for row in columns] for k in names}


def _checked(out, n: int) -> list[float]:
    """`out` as n finite floats (None -> 0); TypeError / ValueError saying what is wrong otherwise."""
    if isinstance(out, (str, bytes)) or not isinstance(out, Sequence) and not hasattr(out, "tolist"):
        raise TypeError(f"returned {type(out).__name__}, not a list of {n} numbers")
    out = out.tolist() if hasattr(out, "tolist") else list(out)
    if len(out) != n:
        raise ValueError(f"returned {len(out)} values for {n} completions")
    values = []
    for v in out:
        if v is None:
            values.append(0.0)
        elif isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise ValueError(f"returned {v!r}, not a finite number")
        elif abs(v) > FLOAT32_MAX:
            raise ValueError(f"returned {v!r}, beyond float32's range (|v| <= 3.4e38) that rewards are trained in")
        else:
            values.append(float(v))
    return values


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""
