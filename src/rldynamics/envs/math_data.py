"""Math problems: the seeded synthetic generator and loaders for GSM8K- / MATH-500-style files.

Design choices:
- The generator writes arithmetic word problems (or bare expressions) whose difficulty is set by the
  number of operations, the operand range and the operators. Each problem is a pure function of its seed:
  `random.Random(f"math/{seed}/problem")`, drawing only with `Random.random()` (the one stream Python
  guarantees across versions), so every process and machine sees the same problems, offline.
- Operations apply left to right to a running total that stays a non-negative integer: subtraction never
  goes below zero, division is exact (a divisor of the total, or 1 when it has none in range).
- Files are JSONL (one object per line) or Parquet (needs `pip install rldynamics[parquet]`, i.e. pyarrow);
  the question and answer columns are named by the caller. A GSM8K answer (`... #### 72`) gives the gold
  answer after the last `####` and its reasoning before it; any other answer text is the gold answer as is.
  Every problem in the file is checked when it is loaded: a line that is not UTF-8 or not JSON (or nests too
  deeply to parse), a missing column, a value that is not text or a finite number (true, a list, NaN,
  bytes, ...) or an empty file is a ValueError naming the file, the line or row, and the column. A JSON
  integer keeps its digits, however many (Python's int refuses more than 4,300); other numbers are read as
  Python floats (`0.50` gives "0.5"). Loaded files are cached per process (keyed by path, size and
  modification time), since each trajectory constructs its own env.
- `sample` names the small JSONL file shipped in the package (`data/math_sample.jsonl`), written by
  `write_sample` (`python scripts/make_math_sample.py`) from the synthetic generator in GSM8K style.
- `reasoning_gym:<dataset>` draws from reasoning-gym's offline generators (`pip install
  rldynamics[reasoning-gym]`), one problem per seed (the dataset built with that seed, size 1).
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

from rldynamics.envs.data_source import read_rows, source_key

OPERATORS = "+-*/"
NAMES = ("Ava", "Ben", "Cleo", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jin", "Kai", "Lea")
ITEMS = ("apples", "books", "coins", "cards", "marbles", "pens", "shells", "stamps")
ORDINALS = ("First", "Second", "Third", "Fourth", "Fifth", "Sixth", "Seventh", "Eighth")
SAMPLE_NAME = "sample"
REASONING_GYM = "reasoning_gym:"
_CALCULATOR = re.compile(r"<<[^<>]*>>")  # GSM8K's calculator annotations inside its reasoning
SOLUTION_WORDS = 30  # an answer without '####' longer than this (or with a line break) is a worked solution


@dataclass(frozen=True)
class Problem:
    """One math problem: the question text, the gold answer, and worked reasoning steps when known."""

    question: str
    answer: str
    steps: tuple[str, ...] = ()
    start: int = 0
    ops: tuple[tuple[str, int], ...] = ()  # synthetic problems: the operations applied to `start`, in order
    where: str = ""  # file sources: the row's location in its source ("line 7", "row 3")
    row: dict = field(default_factory=dict, compare=False, hash=False)  # file sources: the row's columns


def _below(rng: random.Random, n: int) -> int:
    """A uniform integer in [0, n) from `rng.random()` only."""
    return min(int(rng.random() * n), n - 1)


def _operand(rng: random.Random, op: str, total: int, max_number: int) -> int:
    """A right operand for `total op operand` that keeps the total a non-negative integer."""
    if op == "+":
        return 1 + _below(rng, max_number)
    if op == "*":
        return 2 + _below(rng, max_number - 1) if max_number >= 2 else 1
    if op == "-":
        return 1 + _below(rng, min(total, max_number)) if total > 0 else 0
    divisors = [d for d in range(2, max_number + 1) if total % d == 0 and total > 0]
    return divisors[_below(rng, len(divisors))] if divisors else 1


def apply(total: int, op: str, operand: int) -> int:
    """`total op operand` in integers (division is exact by construction)."""
    return {"+": total + operand, "-": total - operand, "*": total * operand, "/": total // max(operand, 1)}[op]


_SENTENCES = {
    "+": "{name} gets {n} more {item}.",
    "-": "{name} gives away {n} {item}.",
    "*": "{name} ends up with {n} times as many {item}.",
    "/": "{name} splits the {item} into {n} equal piles and keeps one pile.",
}


def generate_problem(seed: int, num_ops: int = 2, max_number: int = 20, operators: str = "+-*",
                     word_problems: bool = True) -> Problem:
    """The synthetic problem of `seed`: `num_ops` operations on operands in 1..max_number, left to right."""
    rng = random.Random(f"math/{seed}/problem")
    name, item = NAMES[_below(rng, len(NAMES))], ITEMS[_below(rng, len(ITEMS))]
    total = 1 + _below(rng, max_number)
    start = total
    sentences, expression, steps, ops = [f"{name} has {total} {item}."], str(total), [], []
    for k in range(num_ops):
        op = operators[_below(rng, len(operators))]
        n = _operand(rng, op, total, max_number)
        result = apply(total, op, n)
        sentences.append(_SENTENCES[op].format(name=name, n=n, item=item))
        expression = f"({expression} {op} {n})" if k < num_ops - 1 else f"{expression} {op} {n}"
        steps.append(f"{total} {op} {n} = {result}")
        ops.append((op, n))
        total = result
    if word_problems:
        question = " ".join(sentences) + f" How many {item} does {name} have now?"
    else:
        question = f"Compute {expression}."
    return Problem(question=question, answer=str(total), steps=tuple(steps), start=start, ops=tuple(ops))


def gold_answer(answer: str) -> tuple[str, tuple[str, ...]]:
    """(gold answer, reasoning lines) of an answer field; GSM8K's `reasoning #### 72` gives ("72", lines)."""
    if "####" not in answer:
        return answer.strip(), ()
    reasoning, _, gold = answer.rpartition("####")
    lines = tuple(line.strip() for line in _CALCULATOR.sub("", reasoning).splitlines() if line.strip())
    return gold.strip(), lines


def sample_path() -> Path:
    """The JSONL sample file shipped in the package."""
    return Path(str(resources.files("rldynamics") / "envs" / "data" / "math_sample.jsonl"))


def load_problems(source: str, question_key: str = "question", answer_key: str = "answer",
                  split: str = "train") -> tuple[Problem, ...]:
    """All problems of a data source (`envs.data_source`: a JSONL / Parquet / CSV file, a `save_to_disk` directory,
    a cached hub id; `sample` = the shipped sample); ValueError on any bad row."""
    source = str(sample_path()) if source == SAMPLE_NAME else source
    return _problems(*source_key(source), split, question_key, answer_key)


@lru_cache(maxsize=8)
def _problems(source: str, size: int, mtime_ns: int, split: str, question_key: str,
              answer_key: str) -> tuple[Problem, ...]:
    rows = read_rows(source, split)
    problems = [_problem(source, where, row, question_key, answer_key) for where, row in rows]
    _check_gold(source, rows, problems, answer_key)
    return tuple(problems)


def _problem(source: str, where: str, row: dict, question_key: str, answer_key: str) -> Problem:
    values = []
    for key in (question_key, answer_key):
        if key not in row:
            raise ValueError(f"{source}: {where} has no column {key!r} (columns: {', '.join(map(str, row))}); "
                             f"set env.math.question_key / env.math.answer_key to the file's column names")
        value = None if row[key] is None else _text(row[key], f"{source}: {where}: {key!r}")
        if value is None or not value.strip():
            raise ValueError(f"{source}: {where} has an empty {key!r}")
        values.append(value)
    gold, steps = gold_answer(values[1])
    if not gold:
        raise ValueError(f"{source}: {where} has an empty gold answer after '####' in {answer_key!r}")
    return Problem(question=values[0].strip(), answer=gold, steps=steps, where=where, row=row)


def _check_gold(source: str, rows, problems: list[Problem], answer_key: str) -> None:
    """Refuse answers that would make a whole worked solution the gold answer: rows without GSM8K's `#### x` marker
    in a file whose other rows have it, or (no row has it) an answer that reads as a solution (a line break, or more
    than `SOLUTION_WORDS` words)."""
    marked = [str(row[answer_key]).count("####") > 0 for _, row in rows]
    fix = (f"point env.math.answer_key at the column that holds only the final answer, or end every {answer_key!r} "
           "with '#### <final answer>' (GSM8K style)")
    if any(marked) and not all(marked):
        where = rows[marked.index(False)][0]
        raise ValueError(f"{source}: {where}'s {answer_key!r} has no '#### <answer>' marker, unlike {sum(marked)} "
                         f"other rows, so its whole text would be the gold answer; {fix}")
    if not any(marked):
        for p in problems:
            if "\n" in p.answer or len(p.answer.split()) > SOLUTION_WORDS:
                raise ValueError(f"{source}: {p.where}'s {answer_key!r} reads as a worked solution "
                                 f"({len(p.answer.split())} words, {p.answer.count(chr(10)) + 1} lines) with no "
                                 f"'#### <answer>' marker, so the whole text would be the gold answer; {fix}")


def _text(value: object, where: str) -> str:
    """A cell's text: a string as is, a finite number as Python writes it; anything else is a ValueError."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    kind = type(value).__name__ + (f" {value!r}" if isinstance(value, float) else "")
    raise ValueError(f"{where} is a {kind}, not text or a finite number; store it as a string")


@lru_cache(maxsize=4096)
def reasoning_gym_problem(dataset: str, seed: int, options: tuple = ()) -> Problem:
    """Problem `seed` of reasoning-gym's generator `dataset` (e.g. basic_arithmetic, chain_sum, gsm_symbolic), with
    the generator's config `options` as (name, value) pairs (chain_sum: min_terms, max_digits, ...)."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise ValueError(f"env.math.source={REASONING_GYM}{dataset} needs reasoning-gym: "
                         "pip install 'rldynamics[reasoning-gym]'") from e
    try:
        entry = reasoning_gym.create_dataset(dataset, seed=seed, size=1, **dict(options))[0]
    except TypeError as e:
        raise ValueError(f"reasoning-gym's {dataset} does not take env.math.gym_config {dict(options)} ({e})") from e
    except (ValueError, KeyError) as e:
        raise ValueError(f"reasoning-gym has no dataset {dataset!r} ({e}); e.g. basic_arithmetic, chain_sum, "
                         "gsm_symbolic") from e
    return Problem(question=str(entry["question"]), answer=str(entry["answer"]))


def write_sample(path: str | Path, count: int = 64, first_seed: int = 900_000) -> None:
    """Write `count` synthetic problems as a GSM8K-style JSONL file (reasoning, then `#### answer`)."""
    lines = []
    for seed in range(first_seed, first_seed + count):
        p = generate_problem(seed, num_ops=2 + seed % 2, max_number=50, operators="+-*/")
        reasoning = "\n".join(f"{ORDINALS[i]}, {step}." for i, step in enumerate(p.steps))
        lines.append(json.dumps({"question": p.question, "answer": f"{reasoning}\n#### {p.answer}"}))
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
