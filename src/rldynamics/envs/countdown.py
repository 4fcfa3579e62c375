"""Countdown as a single-turn text environment: reach a target with the given numbers and + - * /.

Design choices:
- Task and scale follow RAGEN's Countdown (TinyZero's task): the observation is
  `Target: 24, nums: [3, 5, 2, 7]`; the answer is an arithmetic expression; the episode ends after one
  answer. Rewards are two named components: `format` (1 when the answer is a valid expression over the
  given numbers) and `correct` (1 when it also equals the target). The default weights (format 0.1,
  correct 0.9) give RAGEN's scores: correct 1.0, a valid expression with the wrong value 0.1, anything
  else 0, and a reply without `<answer>` tags the rollout's `format_penalty` (RAGEN's -0.1).
- Format credit is given for a *valid expression* only, not for any tagged text. RAGEN gives it when the
  integers found in the text by a regex are exactly the given numbers, so `3 + 5 +` or `3 5` earned 0.1
  there and earn 0 here: the 0.1 should reward a checkable attempt, not a list of the numbers.
- Rules: each given number may be used at most once (as on the TV show; a number that is given twice may
  be used twice); `use_all_numbers=true` requires every number exactly once (RAGEN's rule). The operators
  are + - * / (also written × ÷ −) and parentheses; unary minus is allowed (it is ordinary arithmetic and
  creates no number), unary plus, powers, floor division, decimals, other literals (`0x10`, `1_0`, `1e3`)
  and `=` are not. Division is exact (`6 / 4 * 2` equals 3): values are `fractions.Fraction`s, never
  floats. Division by zero makes a valid expression with no value (format 1, correct 0).
- Safety: model text is never `eval`ed. An answer longer than `MAX_ANSWER_CHARS` or containing any other
  character is rejected before parsing; the rest is parsed with `ast.parse(mode="eval")` and walked over
  the allowed nodes only, at most `MAX_DEPTH` deep. The given numbers are checked before anything is
  computed, so evaluation sees at most `max(num_numbers)` leaves of bounded size: every answer is judged
  in time bounded by its (capped) length.
- Instances: `random.Random(f"countdown/{seed}/{attempt}")`, calling only `Random.random()` (the one stream
  Python guarantees across versions), draws how many numbers and the numbers; the solver then lists every
  integer it can reach inside `target_range` (with all numbers when `use_all_numbers`), and the target is
  drawn uniformly from that list, so every instance is solvable. A target equal to a given number is never
  drawn (it would need no arithmetic). An attempt with no reachable target is retried with the next stream.
- Solver: dynamic programming over subsets of the numbers (every value reachable from each subset, with
  a back-pointer), exact in rationals, so it finds every solution the rules allow. Its answer uses as few
  numbers as possible and the fewest parentheses. Cost grows steeply with the count (4 numbers: ~10 ms,
  5: ~0.4 s), hence `MAX_NUMBERS`; instances and the last solver tables are cached per process.
"""

from __future__ import annotations

import ast
import numbers as numbers_abc
import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache

from rldynamics.envs.base import StepResult

MAX_NUMBERS = 5
MAX_NUMBER_VALUE = 10**6
MAX_ANSWER_CHARS = 200
MAX_DEPTH = 32
MAX_ATTEMPTS = 64

_UNICODE_OPERATORS = str.maketrans({"×": "*", "÷": "/", "−": "-"})
_ALLOWED_TEXT = re.compile(r"[0-9+\-*/()\s]*")
_BINARY_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_LEAF_PRECEDENCE = 3


class InvalidExpression(ValueError):
    """An answer that is not a valid expression over the given numbers; the message says why."""


@dataclass(frozen=True)
class Instance:
    """One Countdown puzzle: the numbers (in the order shown) and the target."""

    numbers: tuple[int, ...]
    target: int

    def render(self) -> str:
        """RAGEN's observation text, e.g. `Target: 24, nums: [3, 5, 2, 7]`."""
        return f"Target: {self.target}, nums: [{', '.join(map(str, self.numbers))}]"


# ----------------------------------------------------------------------------------------------------
# Checking and evaluating an answer
# ----------------------------------------------------------------------------------------------------


def parse_expression(text: str, numbers: Sequence[int], *, use_all: bool = False) -> ast.expr:
    """The syntax tree of `text` when it is a valid expression over `numbers`, else InvalidExpression.

    Valid: integers, + - * / (or × ÷ −), parentheses and unary minus, each given number used at most as
    often as it is given (exactly as often with `use_all`), at most MAX_ANSWER_CHARS characters.
    """
    if not isinstance(text, str):
        raise InvalidExpression(f"the answer must be text, got {type(text).__name__}")
    if len(text) > MAX_ANSWER_CHARS:
        raise InvalidExpression(f"the answer is longer than {MAX_ANSWER_CHARS} characters")
    text = text.translate(_UNICODE_OPERATORS)
    if not _ALLOWED_TEXT.fullmatch(text):
        raise InvalidExpression("only digits, + - * /, parentheses and spaces are allowed")
    source = " ".join(text.split())  # newlines and tabs would end an expression early
    if not source:
        raise InvalidExpression("the answer is empty")
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise InvalidExpression("not an arithmetic expression") from e
    used = Counter(_literals(tree, 0))
    given = Counter(numbers)
    if used - given:
        raise InvalidExpression(f"uses {_listing(used - given)} beyond the given numbers")
    if use_all and used != given:
        raise InvalidExpression(f"does not use {_listing(given - used)}")
    return tree


def _listing(counts: Counter) -> str:
    """A few of the numbers in `counts`, short enough for a one-line verdict."""
    items = [str(n) if len(str(n)) <= 12 else str(n)[:9] + "..." for n in sorted(counts.elements())]
    return ", ".join(items[:4]) + (", ..." if len(items) > 4 else "")


def _literals(node: ast.expr, depth: int) -> list[int]:
    """The integer literals of an allowed tree, left to right; InvalidExpression on any other node."""
    if depth > MAX_DEPTH:
        raise InvalidExpression(f"nested deeper than {MAX_DEPTH}")
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        return _literals(node.left, depth + 1) + _literals(node.right, depth + 1)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _literals(node.operand, depth + 1)
    if isinstance(node, ast.Constant) and type(node.value) is int:  # the allowed characters make it decimal
        return [node.value]
    raise InvalidExpression("only + - * /, parentheses and unary minus are allowed")


def evaluate(node: ast.expr) -> Fraction | None:
    """Exact value of a tree accepted by `parse_expression`; None when it divides by zero."""
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp):
        value = evaluate(node.operand)
        return None if value is None else -value
    left, right = evaluate(node.left), evaluate(node.right)
    if left is None or right is None:
        return None
    op = _BINARY_OPS[type(node.op)]
    if op == "/":
        return None if right == 0 else left / right
    return _apply(op, left, right)


def _apply(op: str, a: Fraction, b: Fraction) -> Fraction:
    return a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a / b


def score_answer(text: str, instance: Instance, *, use_all: bool = False) -> tuple[dict[str, float], str]:
    """Reward components `format` and `correct` of an answer, and a one-line verdict for the observation."""
    try:
        tree = parse_expression(text, instance.numbers, use_all=use_all)
    except InvalidExpression as e:
        return {"format": 0.0, "correct": 0.0}, f"Invalid answer: {e}."
    value = evaluate(tree)
    if value == instance.target:
        return {"format": 1.0, "correct": 1.0}, f"Correct: {' '.join(text.split())} = {instance.target}."
    shown = "is undefined (division by zero)" if value is None else f"equals {value}"
    return {"format": 1.0, "correct": 0.0}, f"Wrong: the expression {shown}, not {instance.target}."


# ----------------------------------------------------------------------------------------------------
# Solver: every value reachable from every subset of the numbers
# ----------------------------------------------------------------------------------------------------

# A table maps a subset (bit mask over the numbers) to {value: how it was made}: None for a single number,
# else (op, mask of the first operand, first operand, second operand); the second operand's mask is the rest.
Table = list[dict[Fraction, tuple | None]]


@lru_cache(maxsize=8)
def reachable(numbers: tuple[int, ...]) -> Table:
    """Every value each subset of `numbers` can make with + - * / (exact), with one way to make it.

    Subsets are visited by size, then by mask; within one, splits, operand pairs and operators
    (+, *, -, /, each order) in a fixed order, keeping the first way found: deterministic.
    """
    count = len(numbers)
    table: Table = [{} for _ in range(1 << count)]
    for i, n in enumerate(numbers):
        table[1 << i][Fraction(n)] = None
    for mask in sorted(range(1, 1 << count), key=lambda m: (bin(m).count("1"), m)):
        if mask & (mask - 1) == 0:
            continue
        low = mask & -mask
        sub = (mask - 1) & mask
        while sub:
            if sub & low:  # each unordered split once: the first part holds the lowest number
                _combine(table, sub, mask ^ sub)
            sub = (sub - 1) & mask
    return table


def _combine(table: Table, a_mask: int, b_mask: int) -> None:
    """Add `a op b` and `b op a` for every a made by `a_mask` and b made by `b_mask` (first way kept)."""
    out = table[a_mask | b_mask]
    for a in table[a_mask]:
        for b in table[b_mask]:
            for value, how in ((a + b, ("+", a_mask, a, b)), (a * b, ("*", a_mask, a, b)),
                               (a - b, ("-", a_mask, a, b)), (b - a, ("-", b_mask, b, a))):
                if value not in out:
                    out[value] = how
            if b and a / b not in out:
                out[a / b] = ("/", a_mask, a, b)
            if a and b / a not in out:
                out[b / a] = ("/", b_mask, b, a)


def expression(numbers: tuple[int, ...], mask: int, value: Fraction) -> tuple[str, int]:
    """Text of the table's way for subset `mask` to make `value` (fewest parentheses), and its precedence."""
    how = reachable(numbers)[mask][value]
    if how is None:
        return str(numbers[mask.bit_length() - 1]), _LEAF_PRECEDENCE
    op, first_mask, x, y = how
    (lt, lp), (rt, rp) = expression(numbers, first_mask, x), expression(numbers, mask ^ first_mask, y)
    prec = _PRECEDENCE[op]
    lt = f"({lt})" if lp < prec else lt
    rt = f"({rt})" if rp < prec or (rp == prec and op in "-/") else rt
    return f"{lt} {op} {rt}", prec


def solve_instance(numbers: Sequence[int], target: int, *, use_all: bool = False) -> str | None:
    """An expression over `numbers` that equals `target` using the fewest numbers, or None if none exists."""
    return _solve(tuple(numbers), int(target), bool(use_all))


@lru_cache(maxsize=65536)
def _solve(numbers: tuple[int, ...], target: int, use_all: bool) -> str | None:
    table = reachable(numbers)
    full = len(table) - 1
    masks = [full] if use_all else sorted(range(1, full + 1), key=lambda m: (bin(m).count("1"), m))
    for mask in masks:
        if Fraction(target) in table[mask]:
            return expression(numbers, mask, Fraction(target))[0]
    return None


def reachable_targets(numbers: Sequence[int], low: int, high: int, *, use_all: bool = False) -> list[int]:
    """Sorted integers in [low, high] the numbers can make (all of them with `use_all`), minus the numbers."""
    table = reachable(tuple(numbers))
    masks = [len(table) - 1] if use_all else range(1, len(table))
    values = {int(v) for m in masks for v in table[m] if v.denominator == 1 and low <= v <= high}
    return sorted(values - set(numbers))


# ----------------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------------


def _randint(rng: random.Random, low: int, high: int) -> int:
    """Uniform int in [low, high] drawn from `rng.random()` only (version-stable, unlike `randint`)."""
    return low + min(int(rng.random() * (high - low + 1)), high - low)


@lru_cache(maxsize=65536)
def generate_instance(num_numbers: tuple[int, int], number_range: tuple[int, int], target_range: tuple[int, int],
                      use_all: bool, seed: int) -> Instance:
    """Deterministic solvable instance for `seed` (same result in every process and on every machine)."""
    for attempt in range(MAX_ATTEMPTS):
        rng = random.Random(f"countdown/{seed}/{attempt}")
        count = _randint(rng, *num_numbers)
        nums = tuple(_randint(rng, *number_range) for _ in range(count))
        targets = reachable_targets(nums, *target_range, use_all=use_all)
        if targets:
            target = targets[_randint(rng, 0, len(targets) - 1)]
            solve_instance(nums, target, use_all=use_all)  # cached now, while the solver's table is at hand
            return Instance(numbers=nums, target=target)
    raise RuntimeError(
        f"no solvable Countdown instance with num_numbers={list(num_numbers)}, number_range={list(number_range)}, "
        f"target_range={list(target_range)} for seed {seed} after {MAX_ATTEMPTS} attempts; widen target_range")


# ----------------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------------


def _int_range(name: str, value: object, low: int, high: int | None = None) -> tuple[int, int]:
    """`value` as an inclusive (lo, hi) pair of ints with low <= lo <= hi (<= high), or ValueError."""
    ok = not isinstance(value, str) and isinstance(value, Sequence) and len(value) == 2
    ok = ok and all(isinstance(v, numbers_abc.Integral) and not isinstance(v, bool) for v in value)
    if ok:
        lo, hi = int(value[0]), int(value[1])
        ok = low <= lo <= hi and (high is None or hi <= high)
    if not ok:
        bound = f"{low} <= lo <= hi" + (f" <= {high}" if high is not None else "")
        raise ValueError(f"{name} must be a [lo, hi] pair of integers with {bound}, got {value!r}")
    return lo, hi


@dataclass
class CountdownConfig:
    """Countdown's keys (`env.countdown.<key>`); defaults are close to RAGEN's Countdown data (3-4 numbers)."""

    num_numbers: list[int] = field(default_factory=lambda: [3, 4])
    """How many numbers an instance gives, [min, max] (drawn uniformly; at most 5)."""
    number_range: list[int] = field(default_factory=lambda: [1, 100])
    """Range of each given number, [min, max] (min >= 1)."""
    target_range: list[int] = field(default_factory=lambda: [1, 100])
    """Range of the target, [min, max]; drawn among the values the numbers can make."""
    use_all_numbers: bool = False
    """Require every given number exactly once (RAGEN's rule) instead of at most once."""


class CountdownEnv:
    """Countdown: one answer per episode, rewards `format` and `correct`; see the module docstring.

    Args: the fields of `CountdownConfig`.
    """

    Config = CountdownConfig
    actions: tuple[str, ...] = ()
    reward_names: tuple[str, ...] = ("format", "correct")
    reward_weights: dict[str, float] = {"format": 0.1, "correct": 0.9}

    def __init__(self, num_numbers: Sequence[int] = (3, 4), number_range: Sequence[int] = (1, 100),
                 target_range: Sequence[int] = (1, 100), use_all_numbers: bool = False) -> None:
        self.num_numbers = _int_range("num_numbers", num_numbers, 2, MAX_NUMBERS)
        self.number_range = _int_range("number_range", number_range, 1, MAX_NUMBER_VALUE)
        self.target_range = _int_range("target_range", target_range, -MAX_NUMBER_VALUE, MAX_NUMBER_VALUE)
        if not isinstance(use_all_numbers, bool):
            raise ValueError(f"use_all_numbers must be true or false, got {use_all_numbers!r}")
        self.use_all = use_all_numbers
        self._instance: Instance | None = None
        self._answered = False
        self._success = False

    def instructions(self) -> str:
        """The rules and an example answer, for the system prompt (short: it is in every sequence)."""
        use = "each exactly once" if self.use_all else "each at most once"
        return ("You are solving the Countdown puzzle. Write an arithmetic expression that equals the target, "
                f"using the numbers in nums ({use}), + - * / and parentheses. "
                "Example: for target 4 and nums [3, 5, 2], answer <answer>5 - 3 + 2</answer>.")

    def reset(self, seed: int) -> str:
        """Generate the instance for `seed` (an integer >= 0), start a new episode, return the observation."""
        if isinstance(seed, bool) or not isinstance(seed, numbers_abc.Integral) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        self.set_instance(generate_instance(self.num_numbers, self.number_range, self.target_range, self.use_all,
                                            int(seed)))
        return self.get_instance().render()

    def set_instance(self, instance: Instance) -> None:
        """Start a new episode on a given instance (hand-built puzzles in tests and demos)."""
        if not isinstance(instance, Instance):
            raise ValueError(f"instance must be an Instance, got {type(instance).__name__}")
        self._instance, self._answered, self._success = instance, False, False

    def get_instance(self) -> Instance:
        """The current instance."""
        if self._instance is None:
            raise RuntimeError("no episode yet; call reset(seed) first")
        return self._instance

    def step(self, action: str) -> StepResult:
        """Judge one answer (any text); the episode ends with it."""
        instance = self.get_instance()
        if self._answered:
            raise RuntimeError("the episode is over (Countdown takes one answer); call reset() first")
        reward, verdict = score_answer(action, instance, use_all=self.use_all)
        self._answered, self._success = True, reward["correct"] == 1.0
        info = {"action_is_effective": reward["format"], "action_is_valid": reward["format"],
                "success": reward["correct"]}
        return StepResult(observation=verdict, reward=reward, done=True, info=info)

    def success(self) -> bool:
        """True when the answer given equals the target."""
        return self._success

    def solve(self) -> list[str]:
        """The solver's answer for the current instance, as a one-action plan (the instance is solvable)."""
        instance = self.get_instance()
        answer = solve_instance(instance.numbers, instance.target, use_all=self.use_all)
        if answer is None:
            raise ValueError(f"no solution for {instance.render()}")
        return [answer]

    def random_action(self, rng: random.Random) -> str:
        """A random valid expression over the numbers, usually wrong (noise for demonstrations)."""
        nums = list(self.get_instance().numbers)
        for i in range(len(nums) - 1, 0, -1):  # Fisher-Yates with rng.random() only
            j = _randint(rng, 0, i)
            nums[i], nums[j] = nums[j], nums[i]
        count = len(nums) if self.use_all else _randint(rng, 2, len(nums))
        ops = "+-*/"
        text = str(nums[0])
        for n in nums[1:count]:
            text += f" {ops[_randint(rng, 0, 3)]} {n}"
        return text
