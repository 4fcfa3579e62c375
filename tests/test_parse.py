"""Action parsing: RAGEN's tag formats, case-insensitive mapping, silent cap, and never raising."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rldynamics.rollout.parse import ParsedTurn, parse_answer, parse_response, strip_special_tokens

ACTIONS = ("Up", "Down", "Left", "Right")


def _parse(text: str, max_actions: int = 2, enable_think: bool = False) -> ParsedTurn:
    return parse_response(text, ACTIONS, max_actions=max_actions, enable_think=enable_think)


@pytest.mark.parametrize(
    ("text", "max_actions", "actions", "format_ok"),
    [
        ("<answer>Up</answer>", 2, ["Up"], True),
        ("<answer> Up || Left </answer>", 2, ["Up", "Left"], True),
        ("<answer>up || LEFT</answer>", 2, ["Up", "Left"], True),
        ("<answer>Up || || Down ||</answer>", 2, ["Up", "Down"], True),
        ("<answer>Up || Jump</answer>", 2, ["Up"], False),
        ("<answer>Jump</answer>", 2, [], False),
        ("<answer>Up || Down || Left</answer>", 2, ["Up", "Down"], True),
        ("<answer>Up || Down || Jump</answer>", 2, ["Up", "Down"], True),
        ("<answer>Up || Jump || Left</answer>", 2, ["Up"], False),
        ("<answer></answer>", 2, [], False),
        ("<answer>Up", 2, [], False),
        ("Up || Down", 2, [], False),
        ("", 2, [], False),
        ("reasoning first <answer>Right</answer> trailing", 2, ["Right"], True),
        ("<answer>Left<|im_end|></answer><|endoftext|>", 2, ["Left"], True),
        ("<answer>Down</answer><answer>Up</answer>", 2, ["Down"], True),
        ("<answer>Up\n||\nDown</answer>", 5, ["Up", "Down"], True),
    ],
)
def test_parse_without_think(text: str, max_actions: int, actions: list[str], format_ok: bool) -> None:
    parsed = _parse(text, max_actions=max_actions)
    assert (parsed.actions, parsed.format_ok, parsed.think) == (actions, format_ok, "")


@pytest.mark.parametrize(
    ("text", "actions", "format_ok", "think"),
    [
        ("<think> box is left </think>\n<answer>Left</answer>", ["Left"], True, "box is left"),
        ("<think>a</think><answer>Up || Down</answer><|im_end|>", ["Up", "Down"], True, "a"),
        ("<think>go<|im_end|> up</think> <answer>Up</answer>", ["Up"], True, "go up"),
        ("<answer>Up</answer>", [], False, ""),
        ("<think>unfinished <answer>Up</answer>", [], False, ""),
        ("<think>x</think> words <answer>Up</answer>", [], False, ""),
        ("<think>x</think><answer>nope</answer>", [], False, "x"),
    ],
)
def test_parse_with_think(text: str, actions: list[str], format_ok: bool, think: str) -> None:
    parsed = _parse(text, enable_think=True)
    assert (parsed.actions, parsed.format_ok, parsed.think) == (actions, format_ok, think)


@pytest.mark.parametrize(
    ("text", "enable_think", "actions", "think"),
    [  # docs/differences-from-ragen.md: RAGEN strips the tags from the matched text and gives Up for the first two
        ("<answer><answer>Up</answer>", False, [], ""),
        ("<answer>Up</think></answer>", False, [], ""),
        ("<answer>Up<|endoftext|></answer>", False, ["Up"], ""),  # RAGEN keeps <|endoftext|>: unknown action
        ("<answer>Up</s> || Left</answer>", False, ["Up", "Left"], ""),
        ("<think>a<think>b</think><answer>Up</answer>", True, ["Up"], "a<think>b"),
    ],
)
def test_tags_inside_a_match_are_text_and_special_tokens_are_removed_first(text, enable_think, actions, think):
    parsed = _parse(text, enable_think=enable_think)
    assert (parsed.actions, parsed.format_ok, parsed.think) == (actions, bool(actions), think)


def test_strip_special_tokens() -> None:
    assert strip_special_tokens("a<|im_end|>b<|endoftext|>c</s><s>") == "abc"
    assert strip_special_tokens("x || y <answer>") == "x || y <answer>"


@pytest.mark.parametrize(
    ("valid_actions", "max_actions", "message"),
    [
        ((), 2, "at least one"),
        (("Up", "up"), 2, "differ only by case"),
        (("Up", " Down"), 2, "outer whitespace"),
        (("Up||Down",), 2, "separator"),
        (ACTIONS, 0, "max_actions"),
        (ACTIONS, True, "max_actions"),
    ],
)
def test_bad_configuration_raises(valid_actions: tuple[str, ...], max_actions: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_response("<answer>Up</answer>", valid_actions, max_actions=max_actions)


_PIECES = st.sampled_from(
    [
        "<think>",
        "</think>",
        "<answer>",
        "</answer>",
        "||",
        " ",
        "\n",
        "<|im_end|>",
        "<|endoftext|>",
        "<|",
        "|>",
        "Up",
        "down",
        "LEFT",
        "right",
        "jump",
        "√",
        "\x00",
    ]
)
_TEXT = st.lists(st.one_of(st.text(max_size=20), _PIECES), max_size=30).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=_TEXT, max_actions=st.integers(1, 5), enable_think=st.booleans())
def test_never_raises_and_respects_invariants(text: str, max_actions: int, enable_think: bool) -> None:
    parsed = parse_response(text, ACTIONS, max_actions=max_actions, enable_think=enable_think)
    assert len(parsed.actions) <= max_actions and all(a in ACTIONS for a in parsed.actions)
    assert parsed.actions or not parsed.format_ok
    assert enable_think or parsed.think == ""


@settings(max_examples=200, deadline=None)
@given(
    chosen=st.lists(st.sampled_from(ACTIONS), min_size=1, max_size=4),
    casing=st.sampled_from([str.lower, str.upper, str]),
    pad=st.sampled_from(["", " ", "\n"]),
    enable_think=st.booleans(),
)
def test_well_formed_answers_round_trip(chosen: list[str], casing, pad: str, enable_think: bool) -> None:
    answer = "||".join(pad + casing(a) + pad for a in chosen)
    text = ("<think>plan</think>" if enable_think else "") + f"<answer>{answer}</answer><|im_end|>"
    parsed = parse_response(text, ACTIONS, max_actions=4, enable_think=enable_think)
    assert parsed == ParsedTurn(actions=chosen, format_ok=True, think="plan" if enable_think else "")


# The matching rules as the lazy regexes state them: a slow, independent reference for small texts.
_REF_THINK_ANSWER = re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL)
_REF_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_WS_PIECES = st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", " ", "\t", "\n", "\u00a0", "\u2003",
                              "\x1c", "Up", "x", "||", "<", ">", "/"])


@settings(max_examples=500, deadline=None)
@given(text=st.lists(_WS_PIECES, max_size=25).map("".join), enable_think=st.booleans())
def test_matches_the_regex_definition(text: str, enable_think: bool) -> None:
    match = (_REF_THINK_ANSWER if enable_think else _REF_ANSWER).search(text)
    parsed = parse_response(text, ACTIONS, max_actions=5, enable_think=enable_think)
    if match is None:
        assert parsed == ParsedTurn()
    else:
        expected = parse_response(f"<answer>{match.groups()[-1]}</answer>", ACTIONS, max_actions=5)
        assert (parsed.actions, parsed.format_ok) == (expected.actions, expected.format_ok)
        assert parsed.think == (match.group(1).strip() if enable_think else "")


_MB = 1 << 20
# Each case: (text, enable_think, expected (actions, format_ok, think)). A quadratic matcher takes hours on these.
_HUGE = {
    "answer_repeated": ("'<answer>' * (_MB // 8)", False, ([], False, "")),
    "answer_repeated_closed": ("'<answer>' * (_MB // 8) + 'Up</answer>'", False, ([], False, "")),
    "think_answer_repeated": ("'<think></think><answer>' * (_MB // 23)", True, ([], False, "")),
    "think_close_repeated": ("'<think>' + '</think> ' * (_MB // 9) + '<answer>Up</answer>'", True,
                             (["Up"], True, "</think> " * (_MB // 9 - 2) + "</think>")),
    "spaces_after_think": ("'<think>a</think>' + ' ' * _MB + '<answer>Left</answer>'", True, (["Left"], True, "a")),
    "special_token_starts": ("'<|' * (_MB // 2) + '<answer>Down</answer>'", False, (["Down"], True, "")),
}


@pytest.mark.parametrize("case", sorted(_HUGE))
def test_megabyte_responses_parse_in_linear_time(case: str) -> None:
    """1 MB adversarial responses parse correctly within a generous limit (a quadratic matcher needs hours).

    The parse runs in a child process so that a regression fails this test instead of hanging the suite.
    """
    expr, think, expected = _HUGE[case]
    code = (f"from rldynamics.rollout.parse import parse_response\n_MB = {_MB}\n"
            f"p = parse_response({expr}, ('Up', 'Down', 'Left', 'Right'), max_actions=2, enable_think={think})\n"
            "print(repr((p.actions, p.format_ok, p.think)))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"parsing the 1 MB response {case!r} did not finish in 120 s")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr(expected)


@pytest.mark.parametrize(
    ("text", "enable_think", "expected"),
    [
        ("<answer> (3 + 5) * 2 </answer>", False, ParsedTurn(actions=["(3 + 5) * 2"], format_ok=True)),
        ("<answer>  </answer>", False, ParsedTurn()),
        ("no tags", False, ParsedTurn()),
        ("<think>add</think><answer>7 - 2</answer>", True, ParsedTurn(actions=["7 - 2"], format_ok=True, think="add")),
        ("<answer>7 - 2</answer>", True, ParsedTurn()),  # think required
    ],
)
def test_free_form_answers(text: str, enable_think: bool, expected: ParsedTurn) -> None:
    assert parse_answer(text, enable_think=enable_think) == expected


@settings(max_examples=200, deadline=None)
@given(text=_TEXT, enable_think=st.booleans())
def test_free_form_parser_never_raises(text: str, enable_think: bool) -> None:
    parsed = parse_answer(text, enable_think=enable_think)
    assert parsed.format_ok == bool(parsed.actions) and len(parsed.actions) <= 1


@pytest.mark.parametrize(
    ("text", "format_ok"),
    [
        ("<answer>6 - 1</answer>", True),
        ("<answer>6 - 1</answer> \n<|im_end|>", True),  # whitespace and the end-of-turn token are not text
        ("<answer>6 - 1</answer>6 - 1</answer>", False),  # a policy that writes on past its answer
        ("<answer>6 - 1</answer>.", False),
        ("so: <answer>6 - 1</answer>", True),  # text before the answer stays RAGEN's tolerance
    ],
)
def test_answer_only_makes_text_after_the_answer_malformed_and_keeps_the_answer(text: str, format_ok: bool) -> None:
    strict = parse_answer(text, answer_only=True)
    assert strict == ParsedTurn(actions=["6 - 1"], format_ok=format_ok)
    assert parse_answer(text) == ParsedTurn(actions=["6 - 1"], format_ok=True)  # the default tolerates it
    words = parse_response(text.replace("6 - 1", "Up"), ACTIONS, max_actions=2, answer_only=True)
    assert words == ParsedTurn(actions=["Up"], format_ok=format_ok)


@settings(max_examples=300, deadline=None)
@given(text=st.lists(_WS_PIECES, max_size=25).map("".join), enable_think=st.booleans())
def test_answer_only_is_the_regex_match_followed_by_nothing(text: str, enable_think: bool) -> None:
    match = (_REF_THINK_ANSWER if enable_think else _REF_ANSWER).search(strip_special_tokens(text))
    strict = parse_response(text, ACTIONS, max_actions=5, enable_think=enable_think, answer_only=True)
    loose = parse_response(text, ACTIONS, max_actions=5, enable_think=enable_think)
    assert strict.actions == loose.actions and strict.think == loose.think
    rest = "" if match is None else strip_special_tokens(text)[match.end():].strip()
    assert strict.format_ok == (loose.format_ok and not rest)
