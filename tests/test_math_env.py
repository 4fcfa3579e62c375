"""The math env: answer extraction and checking (math-verify, timeout in any thread), rldynamic's format and
length formulas, the synthetic generator, file loaders, and the whole-reply protocol in a rollout."""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from rldynamics.config import ConfigError, make_config
from rldynamics.envs import make_env
from rldynamics.envs.answer_check import CHECKER, AnswerChecker
from rldynamics.envs.math import MathEnv, extract_answer, format_score, length_score
from rldynamics.envs.math_data import generate_problem, load_problems, sample_path, write_sample


def equal(gold: str, pred: str) -> bool | None:
    return CHECKER.equal(gold, pred, timeout=30.0)


@pytest.mark.parametrize("gold, pred", [
    ("\\frac{1}{2}", "\\dfrac12"), ("\\frac{1}{2}", "0.5"), ("\\frac{1}{2}", "1/2"), ("0.5", "\\frac{1}{2}"),
    ("\\frac{1}{2}", "\\frac {1} {2}"), ("12", "  12 "), ("1000", "1,000"), ("1,000,000", "1000000"),
    ("3\\sqrt{2}", "\\sqrt{18}"), ("3\\sqrt2", "\\sqrt{18}"), ("-5", "-5"), ("-3", "−3"),
    ("5", "5\\text{ cm}"), ("18", "18 \\mathrm{cm}"), ("5", "\\$5"), ("5", "\\$5.00"),
    ("50\\%", "50"), ("50\\%", "0.5"), ("0.18", "18\\%"), ("3", "x = 3"), ("18", "18.00"),
    ("\\text{Evelyn}", "\\text{Evelyn}"),
    ("-45", "-45\\%"), ("-45\\%", "-45"), ("-0.45", "-45\\%"), ("-45", "−45\\%"), ("-0.045", "-4.5\\%"),  # as 50\%
])
def test_equivalent_answers(gold, pred):
    assert equal(gold, pred) is True


@pytest.mark.parametrize("gold, pred", [
    ("-5", "5"), ("5", "-5"), ("12", "13"), ("\\frac{1}{2}", "\\frac{1}{3}"), ("12", "1 2"),  # "1 2" reads as 1 + 2
    ("5", "5 dollars"),  # a plain-word unit is not stripped (math-verify reads a product of symbols)
    ("1,5", "15"),  # "1,5" is the set {1, 5}, not a thousands separator
    ("45", "-45\\%"), ("-45", "45\\%"), ("-45\\%", "45"), ("0.45", "-45\\%"),
])
def test_different_answers(gold, pred):
    assert equal(gold, pred) is False


@pytest.mark.parametrize("reply, answer", [
    ("First, 2 + 3 = 5. \\boxed{5}", "5"),
    ("\\boxed{4} then corrected: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last box
    ("\\boxed{\\frac{\\sqrt{2}}{2}}.", "\\frac{\\sqrt{2}}{2}"),  # nested braces matched
    ("<answer>First, 7. So 7</answer>", "First, 7. So 7"),  # no box: the <answer> text
    ("<answer>1</answer> <answer> 2 </answer>", "2"),
    ("<answer>\\boxed{12</answer>", None),  # a malformed \boxed{ is no answer, even inside <answer>
    ("\\boxed{3} and \\boxed{4", None),  # the last \boxed{ never closes
    ("the answer is 12", None),
    ("\\fbox{146}", "146"), ("\\boxed{1} then \\fbox{\\frac{1}{2}}", "1"),  # \boxed before \fbox, as MATH's grader
    ("so $\\boxed 146$.", "146"), ("\\boxed 146.\nDone.", "146."),  # the space form: up to `$` or the line end
    ("\\boxed {146}", "146"), ("\\fbox 7", "7"), ("\\boxed{5} and \\boxed 6", "6"),
    ("\\boxed{5} in \\boxedtext", "5"), ("\\boxed{5} then \\boxed", "5"),  # not a box: the earlier one counts
    ("<answer>1</answer></answer>", "1"), ("<answer><answer>2</answer>", "<answer>2"),  # as the lazy regex reads them
])
def test_extract_answer(reply, answer):
    assert extract_answer(reply) == answer


def _reference_answer(reply: str) -> str | None:
    """The <answer> rule as the lazy regex states it (quadratic on hostile replies; fine on short ones)."""
    found = re.findall(r"<answer>(.*?)</answer>", reply, re.DOTALL)
    return found[-1].strip() if found else None


def test_answer_tags_read_as_the_lazy_regex_reads_them():
    rng = random.Random(0)
    pieces = ("<answer>", "</answer>", "<answer", "answer>", "x", " ", "\n", "<", ">", "/")
    for _ in range(3000):
        reply = "".join(rng.choice(pieces) for _ in range(rng.randrange(12)))
        assert extract_answer(reply) == _reference_answer(reply), reply


@pytest.mark.parametrize("reply", [
    "<answer>" * 50_000, "<answer>x</answer>" * 22_000, "\\boxed{" * 57_000, "\\boxed{" + "{" * 400_000,
    "\\boxed " * 57_000, "\\boxedx" * 50_000, "<answer>" + "\\boxe" * 80_000,
])
def test_extraction_is_linear_on_hostile_replies(reply):
    """Replies of about 400 KB built to make a lazy regex or a brace scan quadratic end: a linear scan takes
    milliseconds, a quadratic one some 1e11 character steps (hours). The bound only tells the two apart, so a
    loaded machine cannot fail it (it failed at 1 s beside two training runs)."""
    start = time.perf_counter()
    extract_answer(reply)
    format_score(reply)
    assert time.perf_counter() - start < 60.0


def test_malformed_box_scores_zero_correctness():
    env = make_env("math")
    env.reset(3)
    gold = env.problem.answer
    assert env.step(f"<answer>\\boxed{{{gold}</answer>").reward["correctness"] == 0.0
    assert env.step(f"<answer>\\boxed{{{gold}}}</answer>").reward["correctness"] == 1.0


def test_format_score_by_hand():
    assert format_score("") == 0.0
    assert format_score("First, add. Second, subtract.") == 0.5
    assert format_score("firstly, secondary, thirdly") == 0.0  # whole words only
    assert format_score("At first ... THIRD") == 0.5
    assert format_score("Step 1: x. Step 2: y.") == 0.5  # "step1" / "step2" once spaces are removed
    assert format_score("\\boxed{3}") == 0.4
    assert format_score("First, Step 1 \\boxed{1}") == pytest.approx(0.9)
    assert format_score("First second third step1 step2 \\boxed{1}") == 1.0  # 1.65 capped


def test_length_score_by_hand():
    assert length_score(0, 800) == 0.0
    assert length_score(400, 800) == 0.5
    assert length_score(800, 800) == 1.0
    assert length_score(1000, 800) == pytest.approx(0.75)
    assert length_score(1600, 800) == 0.0 and length_score(5000, 800) == 0.0


def test_step_components_in_chars_and_tokens():
    reply = "First, 1 + 1 = 2. \\boxed{2}"
    env = make_env("math", length_target=len(reply) * 2)
    env.reset(0)
    result = env.step(reply, num_tokens=7)
    assert result.done and result.reward["format"] == pytest.approx(0.65) and result.reward["length"] == 0.5
    tokens = make_env("math", length_unit="tokens", length_target=14)
    tokens.reset(0)
    assert tokens.step(reply, num_tokens=7).reward["length"] == 0.5


def test_check_times_out_in_a_worker_thread():
    """`9^{9^{9^9}}` makes sympy compute forever; the check gives up, the worker is replaced, checks go on."""
    checker, out = AnswerChecker(), {}

    def run():
        out["hang"] = checker.equal("1", "9^{9^{9^{9}}}", timeout=1.0)
        out["after"] = checker.equal("\\frac{1}{2}", "0.5", timeout=30.0)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(120)
    checker.close()
    assert out == {"hang": None, "after": True} and checker.timeouts == 1


def test_generator_is_deterministic_across_processes():
    code = ("from rldynamics.envs.math_data import generate_problem as g; import json; "
            "print(json.dumps([g(s, 3, 30, '+-*/').question for s in range(20)]))")
    other = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True).stdout)
    assert other == [generate_problem(s, 3, 30, "+-*/").question for s in range(20)]
    assert len(set(other)) == 20


def test_generator_knobs_and_exact_arithmetic():
    for seed in range(200):
        p = generate_problem(seed, num_ops=3, max_number=12, operators="+-*/", word_problems=False)
        assert len(p.ops) == 3 and int(p.answer) >= 0
        assert all(0 <= n <= 12 for _, n in p.ops) and p.question.startswith("Compute ((")
        assert eval(p.question[len("Compute "):-1].replace("/", "//")) == int(p.answer)  # exact division
    word = generate_problem(7, num_ops=1, max_number=9, operators="+")
    assert word.question.endswith("have now?") and " more " in word.question


def test_solver_reply_is_correct_and_noisy_reply_is_not():
    import random

    env = make_env("math", num_ops=2, operators="+-*/")
    for seed in range(30):
        env.reset(seed)
        assert env.step(env.solve()[0]).reward["correctness"] == 1.0
        env.reset(seed)
        assert env.step(env.random_action(random.Random(seed))).reward["correctness"] == 0.0


def test_shipped_sample_is_ours(tmp_path):
    write_sample(tmp_path / "sample.jsonl")
    assert (tmp_path / "sample.jsonl").read_text() == sample_path().read_text()
    problems = load_problems("sample")
    assert len(problems) == 64 and problems[0].steps[0].startswith("First, ")


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_gsm8k_and_math500_files(tmp_path):
    gsm = _jsonl(tmp_path / "gsm.jsonl", [
        {"question": "Tom has 3 apples and buys 1,000 more. How many?", "answer": "3+1000=<<3+1000=1003>>1003\n"
                                                                             "#### 1,003"},
        {"question": "Half of 1?", "answer": "#### 0.5"}])
    problems = load_problems(gsm)
    assert [p.answer for p in problems] == ["1,003", "0.5"] and problems[0].steps == ("3+1000=1003",)
    math500 = _jsonl(tmp_path / "m.jsonl", [{"problem": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}"}])
    env = make_env("math", source=math500, question_key="problem")
    assert env.reset(0) == "What is 1/2 + 1/4?"
    assert env.step("so \\boxed{0.75}").reward["correctness"] == 1.0
    env = make_env("math", source=gsm)
    env.reset(0)
    assert env.step("<answer>1003</answer>").reward["correctness"] == 1.0
    assert make_env("math", source=gsm).reset(1) == "Half of 1?"


def test_parquet_file(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "m.parquet"
    pq.write_table(pa.table({"problem": ["1+1?", "2+2?"], "solution": ["2", "4"]}), path)
    problems = load_problems(str(path), "problem", "solution")
    assert [(p.question, p.answer) for p in problems] == [("1+1?", "2"), ("2+2?", "4")]
    with pytest.raises(ValueError, match=r"m.parquet: row 0 has no column 'question' \(columns: problem, solution"):
        load_problems(str(path))


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "m.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError, match=r"needs pyarrow: pip install 'rldynamics\[parquet\]'"):
        load_problems(str(path))


@pytest.mark.parametrize("rows, message", [
    ([], r"holds no rows"),
    (["", "  "], r"holds no rows"),
    ([{"question": "q"}], r"line 1 has no column 'answer' \(columns: question\)"),
    ([{"question": "q", "answer": "1"}, '{"question": "q2", "answer": '], r"line 2 is not valid JSON"),
    (["[1, 2]"], r"line 1 is a JSON list, not an object"),
    ([{"question": "q", "answer": "work #### "}], r"line 1 has an empty gold answer after '####'"),
    ([{"question": " ", "answer": "1"}], r"line 1 has an empty 'question'"),
])
def test_malformed_files(tmp_path, rows, message):
    with pytest.raises(ValueError, match=message):
        load_problems(_jsonl(tmp_path / "bad.jsonl", rows))


@pytest.mark.parametrize("answer, kind", [
    (True, "bool"), ([1, 2], "list"), ({"value": 3}, "dict"), (float("nan"), "float nan"),
    (float("inf"), "float inf"), (-math.inf, "float -inf"),
])
def test_answers_that_are_not_text_or_a_finite_number_are_refused(tmp_path, answer, kind):
    path = tmp_path / "bad.jsonl"
    rows = [{"question": "q", "answer": "1"}, {"question": "q", "answer": answer}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=rf"bad.jsonl: line 2: 'answer' is a {kind}, not text or a finite number"):
        load_problems(str(path))


def test_numbers_are_answers(tmp_path):
    """JSON integers keep their digits, also past Python's 4,300-digit conversion limit; other numbers are floats."""
    long = "9" * 5000
    path = tmp_path / "n.jsonl"
    path.write_text('{"question": "a", "answer": 72}\n{"question": "b", "answer": 0.50}\n'
                    f'{{"question": "c", "answer": {long}}}\n')
    assert [p.answer for p in load_problems(str(path))] == ["72", "0.5", long]
    env = make_env("math", source=str(path))
    env.reset(2)
    assert env.step(f"\\boxed{{{long}}}").reward["correctness"] == 1.0
    assert env.step("\\boxed{7}").reward["correctness"] == 0.0
    path.write_text('{"question": "a", "answer": 1e400}\n')
    with pytest.raises(ValueError, match=r"n.jsonl: line 1: 'answer' is a float inf, not text or a finite number"):
        load_problems(str(path))


def test_parquet_bytes_and_nan_answers_are_refused(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["q"], "answer": [b"12"]}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"b.parquet: row 0: 'answer' is a bytes, not text or a finite number"):
        load_problems(str(tmp_path / "b.parquet"))
    pq.write_table(pa.table({"question": ["q", "r"], "answer": [1.5, float("nan")]}), tmp_path / "f.parquet")
    with pytest.raises(ValueError, match=r"f.parquet: row 1: 'answer' is a float nan, not text or a finite number"):
        load_problems(str(tmp_path / "f.parquet"))


def test_bad_utf8_names_the_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"question": "q", "answer": "1"}\n{"question": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"latin1.jsonl: line 2 is not valid UTF-8 \(byte 0xe9 at column 18\)"):
        load_problems(str(path))


def test_deeply_nested_json_is_a_one_line_error(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"question": "q", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(ValueError, match=r"deep.jsonl: line 1 nests arrays or objects too deeply to parse"):
        load_problems(str(path))


def test_bad_files_fail_at_config_time(tmp_path):
    bad = _jsonl(tmp_path / "bad.jsonl", [{"q": "1+1?", "answer": "2"}])
    with pytest.raises(ConfigError, match=r"env.math.*bad.jsonl: line 1 has no column 'question'"):
        make_config("math-tiny", overrides=[f"env.math.source={bad}"])
    with pytest.raises(ConfigError, match=r"env.math.*does not exist"):
        make_config("math-tiny", overrides=[f"env.math.source={tmp_path / 'missing.jsonl'}"])
    with pytest.raises(ConfigError, match=r"unsupported type '.txt'"):
        make_config("math-tiny", overrides=[f"env.math.source={_jsonl(tmp_path / 'x.txt', ['a,b'])}"])
    one = _jsonl(tmp_path / "one.jsonl", [{"question": "q", "answer": "1"}])
    with pytest.raises(ConfigError, match=r"holdout=1 leaves no training rows"):
        make_config("math-tiny", overrides=[f"env.math.source={one}", "env.math.holdout=1"])
    with pytest.raises(ConfigError, match=r"operators must be a non-empty subset"):
        make_config("math-tiny", overrides=["env.math.operators=+^"])


def test_holdout_rows_only_reach_low_seeds(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"question": f"q{i}", "answer": str(i)} for i in range(10)])
    env = make_env("math", source=path, holdout=3)
    assert [env.reset(s) for s in range(3)] == ["q0", "q1", "q2"]
    assert {env.reset(s) for s in range(3, 1000)} == {f"q{i}" for i in range(3, 10)}
    assert [make_env("math", source=path).reset(s) for s in (0, 9, 10, 23)] == ["q0", "q9", "q0", "q3"]


def test_rollout_passes_the_whole_reply_without_format_penalty():
    """A full-reply env gets the decoded reply (think opener included) and its token count; no format_penalty."""
    from rldynamics.models.tiny import build_tiny_tokenizer
    from rldynamics.rollout.agent import rollout

    cfg = make_config("math-tiny", overrides=["env.enable_think=true", "env.math.length_unit=tokens",
                                              "env.math.length_target=100"])
    tokenizer = build_tiny_tokenizer(["First, 1 + 1 = 2. The answer is \\boxed{2}."])
    close = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    env = make_env("math", **cfg.env.options())
    replies = []
    for seed in (0, 1):
        env.reset(seed)
        replies.append(f"First, I add.</think> Step 1: \\boxed{{{env.problem.answer}}}")
    ids = [tokenizer(r, add_special_tokens=False)["input_ids"] + close for r in replies]
    batch = rollout(None, tokenizer, [0, 1], 2, cfg.env, respond=lambda trajs: [ids[t.group_id] for t in trajs])
    assert batch.reward_names == ("correctness", "format", "length")
    assert batch.reward_components[:, 0].tolist() == [1.0] * 4
    assert batch.reward_components[:, 1].tolist() == [pytest.approx(0.25 + 0.25 + 0.4)] * 4
    lengths = [len(i) for i in ids for _ in range(2)]
    assert batch.reward_components[:, 2].tolist() == [pytest.approx(n / 100) for n in lengths]
    weights = (0.34, 0.33, 0.33)
    assert batch.reward_weights == weights
    expected = [sum(w * v for w, v in zip(weights, row, strict=True)) for row in batch.reward_components.tolist()]
    assert batch.scores.tolist() == pytest.approx(expected)


def test_rollout_budget_bounds_hostile_checks_and_counts_them():
    """Replies whose answers make sympy compute forever: the rollout's checks share `env.math.verify_budget` seconds,
    so at most about budget / verify_timeout of them reach the worker; each counts as wrong and in verify_timeout."""
    from rldynamics.models.tiny import build_tiny_tokenizer
    from rldynamics.rollout.agent import env_metric_summary, rollout

    cfg = make_config("math-tiny", overrides=["env.math.verify_timeout=1", "env.math.verify_budget=1.5"])
    env = make_env("math", **cfg.env.options())
    env.reset(0)
    replies = ["\\boxed{9^{9^{9^{9}}}}", f"\\boxed{{{env.problem.answer}.0}}"]  # hangs; equal, says math-verify
    tokenizer = build_tiny_tokenizer(replies)
    hostile, fine = (tokenizer(r, add_special_tokens=False)["input_ids"] for r in replies)
    CHECKER.equal("\\frac{1}{2}", "0.5", timeout=120.0)  # the worker is up: its first start is paid by no budget
    before = CHECKER.timeouts
    batch = rollout(None, tokenizer, [0, 1, 2, 3], 2, cfg.env, respond=lambda trajs: [hostile for _ in trajs])
    assert CHECKER.timeouts - before <= 2  # without the budget: 8, at 1 s and a worker restart each
    assert batch.reward_components[:, 0].tolist() == [0.0] * 8
    assert env_metric_summary(batch, "train/math", 2)["train/math/verify_timeout"] == 1.0
    ok = rollout(None, tokenizer, [0], 2, cfg.env, respond=lambda trajs: [fine for _ in trajs])
    assert ok.reward_components[:, 0].tolist() == [1.0, 1.0]  # a new rollout has a new budget
    assert [m["verify_timeout"] for m in ok.env_metrics] == [0.0, 0.0]


def test_worker_killed_during_a_step_grades_the_reply_wrong_and_training_goes_on():
    env = make_env("math", verify_timeout=60.0)
    env.reset(0)
    killer = threading.Thread(target=lambda: (_wait_busy(), os.kill(CHECKER.worker_pid, signal.SIGKILL)))
    killer.start()
    result = env.step("\\boxed{9^{9^{9^{9}}}}")
    killer.join(60)
    assert result.reward["correctness"] == 0.0 and env.metrics() == {"verify_timeout": 1.0}
    assert env.step(env.solve()[0]).reward["correctness"] == 1.0
    assert env.step(f"\\boxed{{{env.problem.answer}.0}}").reward["correctness"] == 1.0  # math-verify's case


def _wait_busy() -> None:
    deadline = time.monotonic() + 120
    while not CHECKER.busy and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)


def test_gsm8k_presets_need_a_file_and_carry_the_documented_settings():
    for preset in ("gsm8k-grpo", "gsm8k-cispo"):
        with pytest.raises(ConfigError, match=r"env.math.*/path/to/gsm8k/train.jsonl.*does not exist"):
            make_config(preset)
    grpo = make_config("gsm8k-grpo", overrides=["env.math.source=sample", "env.math.holdout=8"])
    assert (grpo.train.env_groups, grpo.train.group_size, grpo.train.lr, grpo.algo.kl_coef) == (32, 8, 1e-6, 0.001)
    assert grpo.algo.norm_adv_by_std and grpo.env.math.length_target == 800 and grpo.env.math.length_unit == "chars"
    cispo = make_config("gsm8k-cispo", overrides=["env.math.source=sample", "env.math.holdout=8"])
    assert (cispo.algo.policy_loss, cispo.algo.clip_high, cispo.train.lr) == ("cispo", 0.28, 1e-5)
    assert cispo.algo.cispo_clip_low is None  # the IS weight is capped at 1.28 and has no lower bound
    assert not cispo.algo.norm_adv_by_std and cispo.train.max_grad_norm == 1.0 and cispo.train.temperature == 1.0


def test_reasoning_gym_source():
    pytest.importorskip("reasoning_gym")
    env = make_env("math", source="reasoning_gym:chain_sum")
    question = env.reset(5)
    assert question == make_env("math", source="reasoning_gym:chain_sum").reset(5) != env.reset(6)
    env.reset(5)
    assert env.step(f"\\boxed{{{env.problem.answer}}}").reward["correctness"] == 1.0
    with pytest.raises(ConfigError, match=r"reasoning-gym has no dataset 'no_such_set'"):
        make_config("math-tiny", overrides=["env.math.source=reasoning_gym:no_such_set"])


def test_reasoning_gym_options():
    pytest.importorskip("reasoning_gym")
    env = make_env("math", source="reasoning_gym:chain_sum", gym_config={"min_terms": 2, "max_terms": 2,
                                                                        "max_digits": 1})
    for seed in range(20):
        terms = re.findall(r"\d+", env.reset(seed))
        assert len(terms) == 2 and all(len(t) == 1 for t in terms)  # two one-digit terms, as asked
    with pytest.raises(ConfigError, match=r"chain_sum does not take env.math.gym_config \{'bogus': 2\}"):
        make_config("math-tiny", overrides=["env.math.source=reasoning_gym:chain_sum",
                                            "env.math.gym_config={bogus: 2}"])


@pytest.mark.parametrize(("reply", "answer"), [
    ("So 8 + 4 = 12.", "12"), ("The total is 1,234 apples", "1234"), ("from 5 down to -3.5", "-3.5"),
    ("no number here", None), ("First 3, then \\boxed{7}, then 9", "7"),  # a box wins
    ("<answer>x</answer> 5", "x"), ("\\boxed{5 and 6", None),  # an unclosed box is no answer, even with a fallback
])
def test_last_number_fallback(reply, answer):
    assert extract_answer(reply, "last_number") == answer
    if "\\boxed" not in reply and "<answer>" not in reply:
        assert extract_answer(reply) is None  # the study's rule: no box, no tag, no answer


def test_last_number_fallback_grades_prose_and_is_linear():
    env = MathEnv(num_ops=1, max_number=9, operators="+", answer_fallback="last_number")
    env.reset(3)
    gold = env.problem.answer
    assert env.step(f"Adding them gives {gold}.").reward["correctness"] == 1.0
    env.reset(3)
    assert env.step(f"Adding them gives {int(gold) + 1}.").reward["correctness"] == 0.0
    start = time.perf_counter()
    extract_answer("1," * 200_000 + "x", "last_number")
    assert time.perf_counter() - start < 1.0
    with pytest.raises(ValueError, match="answer_fallback"):
        MathEnv(answer_fallback="first")


def test_a_wrong_reply_gets_another_attempt_and_the_last_one_is_graded():
    env = make_env("math", num_ops=1, max_number=9, operators="+", word_problems=False,
                   answer_fallback="last_number", attempts=2)
    question = env.reset(3)
    gold = env.problem.answer
    first = env.step("The answer is 100.")
    assert not first.done and first.observation == f"100 is not correct. Try again.\n{question}"
    assert first.reward == {"correctness": 0.0, "format": 0.0, "length": 0.0} and not env.success()
    last = env.step(f"The answer is {gold}.")
    assert last.done and last.reward["correctness"] == 1.0 and last.reward["length"] > 0 and env.success()
    env.reset(3)
    assert env.step("no idea").observation.startswith("No answer is not correct.")
    wrong = env.step("still 100")
    assert wrong.done and wrong.reward["correctness"] == 0 and wrong.reward["length"] > 0  # graded, and over
    env.reset(3)
    assert env.step(f"{gold}").done  # right the first time: one turn
    with pytest.raises(ConfigError, match=r"env.math.attempts=2 needs env.max_turns >= 2"):
        make_config("math-retry-smollm2", overrides=["env.max_turns=1"])
