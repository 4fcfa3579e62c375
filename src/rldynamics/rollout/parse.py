"""Turn a model response into action words, the way RAGEN's context manager does.

Design choices (docs/reference/ragen_behaviour.md §7, "Action parsing"):
- Special tokens (`<|...|>` forms such as `<|im_end|>`, `<|endoftext|>`, plus `<s>` / `</s>`) are
  stripped *before* matching, so a trailing end-of-turn token never hides an answer.
- With `enable_think` the response must contain `<think>...</think>` followed (whitespace allowed) by
  `<answer>...</answer>`; otherwise only `<answer>...</answer>`. Like RAGEN we search, not anchor: text
  around the tags is tolerated. The first match wins.
- The answer is split on `||`, items are trimmed and empty items dropped. The list is then cut to
  `max_actions` **silently** (RAGEN's behaviour: items past the cap are ignored and cost no format
  penalty). The kept items are mapped case-insensitively (`str.casefold`) onto `valid_actions`; unknown
  items are dropped and make the turn malformed.
- `format_ok` is False when the tags do not match, when an item within the cap was unknown, or when no
  valid action remains. The caller applies the format penalty and the "no valid action" handling.
- With `answer_only`, text after the matched `</answer>` (special tokens and whitespace aside) also makes
  `format_ok` False; the actions are parsed as without it (the prompt asks for the answer "with no extra text").
- Parsing never raises on any response text; only a bad `valid_actions` / `max_actions` raises ValueError.
- Free-form envs (no action words) use `parse_answer`: the whole stripped answer is the one action.
- Tags are located with `str.find`, never with a lazy regex over the whole text, so parsing is linear in the
  length of the text whatever it contains (a lazy `<answer>(.*?)</answer>` search is quadratic on a response
  of repeated `<answer>` tags and worse with the think pattern).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

ACTION_SEPARATOR = "||"

_SPECIAL_TOKEN = re.compile(r"<\|[^<>|]*\|>|</?s>")  # linear: a candidate's scan stops at the next "<"
_SPACE = re.compile(r"\s*")
THINK, THINK_END, ANSWER, ANSWER_END = "<think>", "</think>", "<answer>", "</answer>"


@dataclass
class ParsedTurn:
    """One parsed assistant turn.

    Attributes:
        actions: canonical action words (as spelled in `valid_actions`), in order, at most `max_actions`.
        format_ok: False if the tags did not match, an item within the cap was unknown, or no valid
            action remained. Truncation at `max_actions` alone keeps it True.
        think: the stripped reasoning text when `enable_think`, else "".
    """

    actions: list[str] = field(default_factory=list)
    format_ok: bool = False
    think: str = ""


def strip_special_tokens(text: str) -> str:
    """Remove chat special tokens (`<|im_end|>`, `<|endoftext|>`, `</s>`, ...) from `text`."""
    return _SPECIAL_TOKEN.sub("", text)


@lru_cache(maxsize=64)
def _action_lookup(valid_actions: tuple[str, ...]) -> dict[str, str]:
    """Case-folded word -> canonical word; rejects empty, padded, separator-containing or clashing words."""
    if not valid_actions:
        raise ValueError("valid_actions must contain at least one action word")
    lookup: dict[str, str] = {}
    for action in valid_actions:
        if not isinstance(action, str) or not action.strip() or action != action.strip():
            raise ValueError(f"action words must be non-empty strings without outer whitespace, got {action!r}")
        if ACTION_SEPARATOR in action:
            raise ValueError(f"action word {action!r} contains the separator {ACTION_SEPARATOR!r}")
        if action.casefold() in lookup:
            raise ValueError(f"action words {lookup[action.casefold()]!r} and {action!r} differ only by case")
        lookup[action.casefold()] = action
    return lookup


def _match(text: str, enable_think: bool) -> tuple[str, str, str] | None:
    """(think text, answer text, the text after the answer's closing tag) of the first tag match in `text`
    (special tokens stripped; the think and trailing text stripped), or None."""
    text = strip_special_tokens(text)
    found = _find_think_answer(text) if enable_think else _find_answer(text)
    return None if found is None else (found[0].strip(), found[1], found[2].strip())


def _find_answer(text: str, start: int = 0) -> tuple[str, str, str] | None:
    """("", answer, the rest of the text) of the first `<answer>...</answer>` at or after `start`, or None.

    Same match as `re.search(r"<answer>(.*?)</answer>", text, re.DOTALL)`: the first opening tag and the
    first closing tag after it (if the first opening tag has no closing tag, no later one has).
    """
    i = text.find(ANSWER, start)
    if i < 0:
        return None
    j = text.find(ANSWER_END, i + len(ANSWER))
    return None if j < 0 else ("", text[i + len(ANSWER):j], text[j + len(ANSWER_END):])


def _find_think_answer(text: str) -> tuple[str, str, str] | None:
    """(think, answer, the rest of the text) of the first `<think>...</think>` + whitespace +
    `<answer>...</answer>`, or None.

    Same match as `re.search(r"<think>(.*?)</think>\\s*<answer>(.*?)</answer>", text, re.DOTALL)`: the first
    `<think>`, then the first `</think>` after it that is followed (whitespace allowed) by `<answer>` with a
    `</answer>` somewhere after. Whether a `</think>` qualifies does not depend on where the think text began,
    so a later `<think>` can never match where the first one did not; each `</think>` is visited once.
    """
    i = text.find(THINK)
    if i < 0:
        return None
    body = i + len(THINK)
    end = text.find(THINK_END, body)
    while end >= 0:
        k = _SPACE.match(text, end + len(THINK_END)).end()
        if text.startswith(ANSWER, k):
            found = _find_answer(text, k)
            return None if found is None else (text[body:end], found[1], found[2])
        end = text.find(THINK_END, end + len(THINK_END))
    return None


def parse_response(
    text: str, valid_actions: tuple[str, ...], *, max_actions: int, enable_think: bool = False,
    answer_only: bool = False,
) -> ParsedTurn:
    """Parse one response into at most `max_actions` canonical action words (see the module docstring).

    Args:
        text: the decoded model response (prefix it with the prompt's trailing `<think>` if any).
        valid_actions: the env's action words, e.g. ("Up", "Down", "Left", "Right").
        max_actions: the cap on actions per turn (>= 1); extra items are ignored without penalty.
        enable_think: require `<think>...</think>` before the answer and return its text.
        answer_only: text after the answer's closing tag makes the turn malformed.
    """
    lookup = _action_lookup(tuple(valid_actions))
    if isinstance(max_actions, bool) or not isinstance(max_actions, int) or max_actions < 1:
        raise ValueError(f"max_actions must be an integer >= 1, got {max_actions!r}")
    found = _match(text, enable_think)
    if found is None:
        return ParsedTurn(actions=[], format_ok=False, think="")
    think, answer, trailing = found
    items = [item.strip() for item in answer.split(ACTION_SEPARATOR)]
    items = [item for item in items if item][:max_actions]
    actions = [lookup[item.casefold()] for item in items if item.casefold() in lookup]
    format_ok = bool(actions) and len(actions) == len(items) and not (answer_only and trailing)
    return ParsedTurn(actions=actions, format_ok=format_ok, think=think)


def parse_answer(text: str, *, enable_think: bool = False, answer_only: bool = False) -> ParsedTurn:
    """Parse a free-form answer (Countdown, math): the stripped `<answer>` text is the one action.

    `format_ok` is True when the tags match and the answer is not empty (and, with `answer_only`, nothing
    follows the closing tag); never raises.
    """
    found = _match(text, enable_think)
    if found is None:
        return ParsedTurn(actions=[], format_ok=False, think="")
    think, answer, trailing = found[0], found[1].strip(), found[2]
    format_ok = bool(answer) and not (answer_only and trailing)
    return ParsedTurn(actions=[answer] if answer else [], format_ok=format_ok, think=think)
