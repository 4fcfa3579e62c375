"""Math reasoning as a single-turn text environment with rldynamic's three reward components.

Design choices:
- One turn: `reset(seed)` shows a question, `step(reply)` grades the whole reply and ends the episode.
  The env sets `full_reply = True`, so the rollout passes it the whole decoded reply (step indicators and
  `\\boxed{}` live outside `<answer>`) and its length in tokens, and applies no `format_penalty`.
- Problems come from the seeded synthetic generator (`env.math.source=synthetic`, offline), the shipped
  sample (`sample`), reasoning-gym's offline generators (`reasoning_gym:<dataset>`, optional package) or a
  GSM8K- / MATH-500-style data set: a JSONL / Parquet / CSV file, a `save_to_disk` directory or a cached hub id
  (`math_data`, `data_source`). A data set's rows are
  reached by seed: seeds below `holdout` pick rows 0..holdout-1 (validation with `val.seed_base=0`),
  larger seeds cycle through the other rows, so training never sees the held-out rows.
- The answer is the content of the last `\\boxed`, else of the last `\\fbox` (the MATH dataset's grader and
  rldynamic prefer `\\boxed` alike), or, when the reply has no box, the text of its last `<answer>...</answer>`.
  A box is `\\boxed` or `\\fbox` followed by a braced group (braces matched; one that never closes is no answer
  at all) or by a space and text, which runs to the next `$` or line end
  (`$\\boxed 146$`, read as the MATH dataset's own grader reads it). `\\boxedtext` and a bare `\\boxed`
  are not boxes.
- Extraction is linear in the reply's length whatever it holds (tags are found with `str.find`, boxes with
  one forward scan), since it runs in the trainer, outside the answer check's timeout: the lazy regex
  `<answer>(.*?)</answer>` takes seconds to minutes on a reply of repeated `<answer>` tags.
- Each answer check has a deadline (`verify_timeout`) and the checks of one rollout share `verify_budget`
  seconds (`rollout_scope`, held by the rollout; `answer_check` says how). A check with no verdict counts as
  wrong and shows in `metrics()` as `verify_timeout`, which the rollout logs per step.
- Several attempts (`attempts`, with `env.max_turns` at least as large): a wrong reply gets the feedback "<its answer>
  is not correct. Try again." with the question, and the episode goes on; it ends at a correct reply or at the last
  attempt. The episode is graded by its last reply (earlier, wrong replies score 0 on every component), and success
  is a correct answer within the attempts: RAGEN's multi-turn setting on a task a small pretrained model can do.
- Components, as the rldynamic study defines them (docs/reference/peer_systems.md §A.1):
  `correctness` 1 if math-verify finds the answer equal to the gold answer (rldynamic compared strings),
  else 0; `format` = 0.25 per whole word "first" / "second" / "third" in the lower-cased reply, + 0.25
  for each of "step1" / "step2" in it with spaces removed, + 0.4 if `\\boxed` appears, capped at 1;
  `length` = max(0, 1 - |len/target - 1|) with len in characters (rldynamic) or tokens. Default weights
  0.34 / 0.33 / 0.33; the trained reward is their weighted sum (`rollout.rewards`).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from rldynamics.envs.answer_check import CHECKER, check_budget
from rldynamics.envs.base import StepResult, int_at_least
from rldynamics.envs.math_data import (
    OPERATORS,
    ORDINALS,
    REASONING_GYM,
    SAMPLE_NAME,
    Problem,
    apply,
    generate_problem,
    load_problems,
    reasoning_gym_problem,
)

SYNTHETIC = "synthetic"
LENGTH_UNITS = ("chars", "tokens")
_ANSWER, _ANSWER_END = "<answer>", "</answer>"
_BOX = re.compile(r"\\(?:boxed|fbox)")  # a box's macro name; what follows it decides whether it is a box
_SPACES, _BLANKS = re.compile(r"\s*"), re.compile(r"[^\S\n]*")  # any white space; all but a line break
_BRACE, _TEXT_END = re.compile(r"[{}]"), re.compile(r"[$\n]")
_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")  # a number as written in prose: 1,234 or -3.5
ANSWER_FALLBACKS = ("none", "last_number")


@dataclass
class MathConfig:
    source: str = SYNTHETIC
    """Problems: synthetic (our generator) | sample (shipped JSONL) | reasoning_gym:<dataset> | a .jsonl / .json /
    .parquet / .csv file | a datasets save_to_disk directory | a hub data set id already in the local cache."""
    split: str = "train"
    """Data set sources: the split of a DatasetDict directory or a hub data set (single files: train)."""
    question_key: str = "question"
    """File sources: the question column (MATH-500: problem)."""
    answer_key: str = "answer"
    """File sources: the answer column; a GSM8K answer's gold is the text after its last '####' (answers without one
    that read as worked solutions are refused)."""
    gym_config: dict[str, int] = field(default_factory=dict)
    """reasoning_gym:<dataset> sources: the generator's whole-number options ({min_terms: 2, max_terms: 2,
    max_digits: 1}: chain_sum's two one-digit terms); {} = reasoning-gym's defaults."""
    holdout: int = 0
    """File sources: rows 0..holdout-1 go to seeds below holdout only (set val.seed_base=0, val.env_groups<=holdout)."""
    num_ops: int = 2
    """Synthetic: arithmetic operations per problem."""
    max_number: int = 20
    """Synthetic: operands are drawn from 1..max_number."""
    operators: str = "+-*"
    """Synthetic: operators to draw from, a subset of +-*/ (division is always exact)."""
    word_problems: bool = True
    """Synthetic: phrase problems as short stories (false: bare expressions such as (3 + 4) * 2)."""
    length_unit: str = "chars"
    """Length component: chars (rldynamic) | tokens (sampled tokens of the reply)."""
    length_target: int = 800
    """Length component: the reply length with the highest reward (1); 0 at zero and at twice the target."""
    verify_timeout: float = 5.0
    """Seconds per answer check (math-verify in a worker process); a check past it counts as wrong."""
    answer_fallback: str = "none"
    """A reply with neither a box nor an `<answer>`: none = no answer (rldynamic) | last_number = its last number
    (lm-eval's flexible extract for GSM8K; for small models that reason in prose)."""
    attempts: int = 1
    """Replies per problem: after a wrong one the env says so and asks again (set env.max_turns >= attempts); the
    last reply is graded."""
    verify_budget: float = 60.0
    """Seconds of answer checking per rollout (a step's or a validation's replies, per rank); past it, answers that
    need math-verify count as wrong. Checks without a verdict: <stage>/math/verify_timeout."""


def format_score(reply: str) -> float:
    """rldynamic's format heuristic: step indicators and `\\boxed`, capped at 1."""
    lower = reply.lower()
    score = 0.25 * sum(bool(re.search(rf"\b{word}\b", lower)) for word in ("first", "second", "third"))
    compact = lower.replace(" ", "")
    score += 0.25 * sum(marker in compact for marker in ("step1", "step2"))
    score += 0.4 if "\\boxed" in lower else 0.0
    return min(score, 1.0)


def length_score(length: int, target: int) -> float:
    """Triangular length reward: 1 at `target`, falling linearly to 0 at 0 and at 2 * target."""
    return max(0.0, 1.0 - abs(length / target - 1.0))


def extract_answer(reply: str, fallback: str = "none") -> str | None:
    """The content of the last `\\boxed` box, else of the last `\\fbox`, else the last `<answer>` text, else
    (`fallback=last_number`, and only when the reply has no box at all) its last number; None when there is no answer (see the module docstring: a box whose
    braces never close is no answer, even when an earlier box or `<answer>` exists)."""
    found = list(_BOX.finditer(reply))
    boxes = [m.end() for m in reversed(found) if m.group() == "\\boxed"]  # `\boxed` first, as MATH's grader
    boxes += [m.end() for m in reversed(found) if m.group() == "\\fbox"]  # then `\fbox`, last first
    for box in boxes:
        is_box, content = _box_content(reply, box)
        if is_box:
            return content
    tagged = _last_answer_tag(reply)
    if tagged is not None or fallback != "last_number" or boxes:
        return tagged
    numbers = _NUMBER.findall(reply)
    return numbers[-1].replace(",", "") if numbers else None


def _box_content(reply: str, i: int) -> tuple[bool, str | None]:
    """(whether a box starts with the macro name ending at `i`, its stripped content or None if unclosed)."""
    j = _SPACES.match(reply, i).end()
    if reply.startswith("{", j):
        depth = 0
        for brace in _BRACE.finditer(reply, j):
            depth += 1 if brace.group() == "{" else -1
            if depth == 0:
                return True, reply[j + 1:brace.start()].strip()
        return True, None
    k = _BLANKS.match(reply, i).end()
    if k == i or k == len(reply) or reply[k] in "$\n":
        return False, None  # `\boxedx`, `\boxed$`, a bare `\boxed`: no box
    end = _TEXT_END.search(reply, k)
    return True, reply[k:end.start() if end else len(reply)].strip()  # `\boxed 146`


def _last_answer_tag(reply: str) -> str | None:
    """The stripped text of the last `<answer>...</answer>`, as `re.findall(r"<answer>(.*?)</answer>")[-1]` reads
    it (each match: the first opening tag after the previous match, the first closing tag after it), in one
    forward pass of `str.find`."""
    found, i = None, reply.find(_ANSWER)
    while i >= 0:
        j = reply.find(_ANSWER_END, i + len(_ANSWER))
        if j < 0:
            break
        found = reply[i + len(_ANSWER):j]
        i = reply.find(_ANSWER, j + len(_ANSWER_END))
    return None if found is None else found.strip()


class MathEnv:
    """Single-turn math problems graded by correctness (math-verify), format and length."""

    Config = MathConfig
    actions: tuple[str, ...] = ()
    full_reply = True
    reward_names = ("correctness", "format", "length")
    reward_weights = {"correctness": 0.34, "format": 0.33, "length": 0.33}

    def __init__(self, source: str = SYNTHETIC, split: str = "train", question_key: str = "question",
                 answer_key: str = "answer", gym_config: dict[str, int] | None = None,
                 holdout: int = 0, num_ops: int = 2, max_number: int = 20, operators: str = "+-*",
                 word_problems: bool = True, length_unit: str = "chars", length_target: int = 800,
                 verify_timeout: float = 5.0, answer_fallback: str = "none", verify_budget: float = 60.0,
                 attempts: int = 1) -> None:
        if answer_fallback not in ANSWER_FALLBACKS:
            raise ValueError(f"answer_fallback must be one of {', '.join(ANSWER_FALLBACKS)}, got {answer_fallback!r}")
        _check_options(num_ops, max_number, operators, length_unit, length_target, verify_timeout, verify_budget,
                       holdout)
        self.source = source
        self.gym = source[len(REASONING_GYM):] if source.startswith(REASONING_GYM) else None
        self.gym_options = tuple(sorted((gym_config or {}).items()))
        if self.gym is not None:
            reasoning_gym_problem(self.gym, 0, self.gym_options)  # fails here on a missing package, an unknown
            # dataset or an option it does not take
        files = source != SYNTHETIC and self.gym is None
        self.problems = load_problems(source, question_key, answer_key, split) if files else None
        if self.problems is not None and holdout >= len(self.problems):
            raise ValueError(f"holdout={holdout} leaves no training rows in {source!r} ({len(self.problems)} rows)")
        self.holdout, self.num_ops, self.max_number = holdout, num_ops, max_number
        self.operators, self.word_problems = operators, word_problems
        self.length_unit, self.length_target, self.verify_timeout = length_unit, length_target, verify_timeout
        self.verify_budget, self.answer_fallback = verify_budget, answer_fallback
        self.attempts, self.attempt = int_at_least("attempts", attempts), 0
        self.problem: Problem | None = None
        self.correct = self.unchecked = False

    def instructions(self) -> str:
        return "Solve the math problem. Let's think step by step and output the final answer in \\boxed{...}."

    def reset(self, seed: int) -> str:
        self.problem = self._problem(seed)
        self.correct = self.unchecked = False
        self.attempt = 0
        return self.problem.question

    def rollout_scope(self):
        """Held by the rollout around all its turns: the answer checks of one rollout share `verify_budget` seconds."""
        return check_budget(self.verify_budget)

    def _problem(self, seed: int) -> Problem:
        if self.gym is not None:
            return reasoning_gym_problem(self.gym, seed, self.gym_options)
        if self.problems is None:
            return generate_problem(seed, self.num_ops, self.max_number, self.operators, self.word_problems)
        n, h = len(self.problems), self.holdout
        return self.problems[seed % n if seed < h or h == 0 else h + (seed - h) % (n - h)]

    def step(self, reply: str, num_tokens: int | None = None) -> StepResult:
        """Grade the whole reply; `num_tokens` is its length in tokens (None: the length counts characters)."""
        answer = extract_answer(reply, self.answer_fallback)
        equal = None if answer is None else CHECKER.equal(self.problem.answer, answer, self.verify_timeout)
        self.correct, self.unchecked = bool(equal), answer is not None and equal is None
        self.attempt += 1
        info = {"success": float(self.correct), "action_is_valid": float(answer is not None),
                "action_is_effective": 1.0, "verify_timeout": float(self.unchecked)}
        if not self.correct and self.attempt < self.attempts:  # graded by a later reply: this one scores 0
            said = "No answer" if answer is None else f"{answer}"
            return StepResult(observation=f"{said} is not correct. Try again.\n{self.problem.question}",
                              reward=dict.fromkeys(self.reward_names, 0.0), done=False, info=info)
        by_tokens = self.length_unit == "tokens" and num_tokens is not None
        reward = {"correctness": float(self.correct), "format": format_score(reply),
                  "length": length_score(num_tokens if by_tokens else len(reply), self.length_target)}
        return StepResult(observation="", reward=reward, done=True, info=info)

    def success(self) -> bool:
        return self.correct

    def columns(self) -> dict:
        """The current problem's data set columns for `env.reward_funcs` (generated problems: question and answer)."""
        return dict(self.problem.row) if self.problem.row else {"question": self.problem.question,
                                                                "answer": self.problem.answer}

    def location(self) -> str:
        """The current problem's place in its data set ("line 7"), or "" for generated problems."""
        return self.problem.where

    def metrics(self) -> dict[str, float]:
        """`verify_timeout`: 1 when the answer's check gave no verdict (past `verify_timeout`, past the rollout's
        `verify_budget`, or its worker died) and so counted as wrong."""
        return {"verify_timeout": float(self.unchecked)}

    def solve(self) -> list[str]:
        """A well-formed reply to the current problem: its steps as ordinals, then the boxed gold answer."""
        steps = " ".join(f"{_ordinal(i)}, {step}." for i, step in enumerate(self.problem.steps))
        return [f"{steps} The answer is \\boxed{{{self.problem.answer}}}.".strip()]

    def random_action(self, rng: random.Random) -> str:
        """A noisy reply with a wrong answer: the worked steps with one slip (an intermediate result off by 1-3,
        carried through), or, half of the time, only the wrong number (no steps, no box: format 0)."""
        if not self.problem.ops:
            return f"The answer is \\boxed{{{1 + int(rng.random() * max(self.max_number, 2))}}}."
        ops, slip = self.problem.ops, int(rng.random() * len(self.problem.ops))
        lines, total = [], self.problem.start
        for i, (op, n) in enumerate(ops):
            result = apply(total, op, n)
            if i == slip:
                delta = 1 + int(rng.random() * 3)
                result = result - delta if rng.random() < 0.5 and result >= delta else result + delta
            if i == len(ops) - 1 and str(result) == self.problem.answer:  # a later division undid the slip
                result += 1
            lines.append(f"{_ordinal(i)}, {total} {op} {n} = {result}.")
            total = result
        return str(total) if rng.random() < 0.5 else f"{' '.join(lines)} The answer is \\boxed{{{total}}}."


def _ordinal(i: int) -> str:
    return ORDINALS[i] if i < len(ORDINALS) else "Next"


def _check_options(num_ops, max_number, operators, length_unit, length_target, verify_timeout, verify_budget,
                   holdout) -> None:
    if num_ops < 1 or max_number < 1:
        raise ValueError(f"num_ops and max_number must be >= 1, got {num_ops} and {max_number}")
    if not operators or set(operators) - set(OPERATORS):
        raise ValueError(f"operators must be a non-empty subset of {OPERATORS!r}, got {operators!r}")
    if length_unit not in LENGTH_UNITS:
        raise ValueError(f"length_unit must be one of {', '.join(LENGTH_UNITS)}, got {length_unit!r}")
    if length_target < 1 or verify_timeout <= 0 or verify_budget <= 0 or holdout < 0:
        raise ValueError(f"length_target must be >= 1, verify_timeout and verify_budget > 0 and holdout >= 0; got "
                         f"{length_target}, {verify_timeout}, {verify_budget} and {holdout}")


__all__ = ["MathConfig", "MathEnv", "SAMPLE_NAME", "extract_answer", "format_score", "length_score"]
