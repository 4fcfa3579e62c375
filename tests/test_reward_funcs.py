"""Reward functions the way TRL users bring them (`env.reward_funcs`), from modules written to disk here."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import require_package
from rldynamics.cli import main
from rldynamics.config import ConfigError, make_config
from rldynamics.envs import reward_funcs
from rldynamics.envs.reward_funcs import load_reward_funcs, score
from rldynamics.tracking.run_dir import read_metrics, read_rewards

MODULE = '''
def brevity(completions, **kwargs):
    """TRL's signature: completions (and the data set's columns) in, one float per completion out."""
    return [1.0 / (1 + len(c)) for c in completions]


def mentions_answer(prompts, completions, answer, **kwargs):
    return [float(str(a) in c) for a, c in zip(answer, completions)]


def fragile(completions, question, **kwargs):
    """Fails on every row whose question holds an odd first number."""
    out = []
    for q in question:
        if int(q.split()[2]) % 2:
            raise ZeroDivisionError("odd")
        out.append(0.5)
    return out
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """my_rewards.py in this test's tmp_path, on the import path; imports and printed warnings start afresh (a process
    imports each function once and prints each function's first failure once)."""
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("my_rewards", "topical"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(reward_funcs, "_LOADED", {})
    monkeypatch.setattr(reward_funcs, "_WARNED", set())
    return tmp_path / "my_rewards.py"


def test_functions_get_completions_and_columns_and_a_failing_row_costs_only_that_row(user_module):
    funcs = load_reward_funcs(["my_rewards:brevity", "my_rewards:mentions_answer", "my_rewards:fragile"])
    assert [f.name for f in funcs] == ["brevity", "mentions_answer", "fragile"]
    lines = []
    graded = score(funcs, ["Ava has 2 pens.", "Ben has 3 pens."], ["so 2", "x"],
                   [{"question": "Ava has 2 pens.", "answer": "2"}, {"question": "Ben has 3 pens.", "answer": "3"}],
                   ["line 1 (env seed 0)", "line 2 (env seed 1)"], lines.append)
    assert graded.values["brevity"] == [1 / 5, 1 / 2] and graded.values["mentions_answer"] == [1.0, 0.0]
    assert graded.values["fragile"] == [0.5, 0.0] and graded.errors == [0, 1]  # row 1 kept its value
    [line] = lines
    assert line.startswith("warning: reward function my_rewards:fragile failed on line 2 (env seed 1)")
    assert "'Ben has 3 pens.'" in line and "ZeroDivisionError: odd" in line and "\n" not in line
    score(funcs[2:], ["Ben has 3 pens."], ["x"], [{"question": "Ben has 3 pens."}], ["row 0"], lines.append)
    assert len(lines) == 1  # printed once per function, then only counted


def test_bad_specs_and_envs_fail_at_config_time(user_module):
    for spec, message in [("my_rewards:nothing", "has no function 'nothing'"),
                          ("no_such_module:f", "cannot import 'no_such_module'"),
                          ("brevity", "not of the form module:function"),
                          ("[my_rewards:brevity, my_rewards:brevity]", "two functions called 'brevity'")]:
        value = spec if spec.startswith("[") else f"[{spec}]"
        with pytest.raises(ConfigError, match=message):
            make_config("math-tiny", overrides=[f"env.reward_funcs={value}"])
    with pytest.raises(ConfigError, match="env 'sokoban' has env.max_turns=5"):
        make_config("sokoban-tiny", overrides=["env.reward_funcs=[my_rewards:brevity]"])
    cfg = make_config("math-tiny", overrides=[f"env.reward_funcs=[{user_module}:brevity]",
                                              "env.reward_weights.brevity=2"])
    assert cfg.env.reward_funcs == [f"{user_module}:brevity"]


def test_training_on_math_data_with_a_user_reward_from_a_file(fast_overrides, user_module, tmp_path, capsys):
    code = main(["train", "--preset", "math-tiny", *fast_overrides, "log.name=r",
                 f"env.reward_funcs=[{user_module}:brevity, my_rewards:fragile]", "env.reward_weights.brevity=2",
                 "env.reward_weights.correctness=0", "analysis.enabled=false"])
    assert code == 0
    err = capsys.readouterr().err
    assert err.count("warning: reward function my_rewards:fragile failed on env seed") == 1  # synthetic problems
    run = tmp_path / "runs" / "r"
    rows = read_rewards(run)
    assert rows and all(set(r["reward"]) == {"correctness", "format", "length", "brevity", "fragile"} for r in rows)
    for r in rows:  # the trained reward is the weighted sum, with the user's weight
        assert r["weighted"]["brevity"] == pytest.approx(2 * r["reward"]["brevity"])
        assert r["total"] == pytest.approx(sum(r["weighted"].values()), abs=1e-5)
        assert r["reward"]["fragile"] in (0.0, 0.5)
    metrics = read_metrics(run)
    errors = [m["train/math/reward_func_errors"] for m in metrics if "train/math/reward_func_errors" in m]
    assert errors and any(e > 0 for e in errors) and all(0 <= e <= 1 for e in errors)
    assert "val-reward/brevity/mean" in metrics[0]


def test_any_prompt_data_set_without_an_env_class(fast_overrides, user_module, tmp_path):
    require_package("datasets", 'pip install -e ".[datasets]"')
    import datasets
    rows = [{"prompt": f"Say the number {i}.", "answer": str(i), "topic": "numbers"} for i in range(6)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(tmp_path / "ds")
    (tmp_path / "topical.py").write_text("def on_topic(completions, topic, **kw):\n"
                                         "    return [1.0 if t == 'numbers' else 0.0 for t in topic]\n")
    with pytest.raises(ConfigError, match="env 'prompts' has no reward of its own"):
        make_config(None, overrides=["env.name=prompts", f"env.prompts.source={tmp_path / 'ds'}", "env.max_turns=1"])
    code = main(["train", *fast_overrides, "env.name=prompts", f"env.prompts.source={tmp_path / 'ds'}",
                 "env.max_turns=1", "model.warm_start_episodes=0", "log.name=p",
                 "env.reward_funcs=[my_rewards:mentions_answer, topical:on_topic]", "env.prompts.success_threshold=1"])
    assert code == 0
    run = tmp_path / "runs" / "p"
    rewards = read_rewards(run)
    assert rewards and all(r["reward"]["on_topic"] == 1.0 and r["total"] >= 1.0 and r["correct"] for r in rewards)
    assert read_metrics(run)[0]["val-env/prompts/success"] == 1.0  # success: trained reward >= success_threshold
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[0])
    assert "Say the number" in sample["text"]


def test_reward_functions_leave_the_cached_warm_start_of_the_tiny_model_valid(user_module):
    from rldynamics.train.warmstart import warm_start_key

    plain = make_config("math-tiny")
    with_funcs = make_config("math-tiny", overrides=["env.reward_funcs=[my_rewards:brevity]"])
    assert warm_start_key("/cache/tiny/x", plain) == warm_start_key("/cache/tiny/x", with_funcs)


def test_math_file_columns_reach_the_functions_and_a_failing_row_is_named_by_its_line(fast_overrides, user_module,
                                                                                        tmp_path, capsys):
    rows = [{"question": f"Ava has {n} pens. How many?", "answer": f"{n}\n#### {n}", "difficulty": n % 3}
            for n in range(2, 10)]
    (tmp_path / "set.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "by_column.py").write_text(
        "def hard(completions, difficulty, answer, **kw):\n"
        "    assert all(a.split('#### ')[1] in ('2','3','4','5','6','7','8','9') for a in answer)  # raw column\n"
        "    return [1.0 / d for d in difficulty]  # difficulty 0 raises ZeroDivisionError\n")
    code = main(["train", "--preset", "math-tiny", *fast_overrides, "log.name=f", "analysis.enabled=false",
                 f"env.math.source={tmp_path / 'set.jsonl'}", f"env.reward_funcs=[{tmp_path / 'by_column.py'}:hard]",
                 "val.seed_base=0", "val.env_groups=8"])
    assert code == 0
    [line] = [x for x in capsys.readouterr().err.splitlines() if "reward function" in x]
    assert f"{tmp_path / 'by_column.py'}:hard failed on line " in line and "ZeroDivisionError" in line
    number = int(line.split("failed on line ")[1].split()[0])
    assert rows[number - 1]["difficulty"] == 0  # the named line is one the function cannot grade
    val = read_metrics(tmp_path / "runs" / "f")[0]
    assert val["val-env/math/reward_func_errors"] == pytest.approx(3 / 8)  # rows with difficulty 0: n = 3, 6, 9
    expected = sum(0.0 if r["difficulty"] == 0 else 1 / r["difficulty"] for r in rows) / 8  # validation: every row
    assert val["val-reward/hard/mean"] == pytest.approx(expected)


HOSTILE = '''
import sys


def huge(completions, **kwargs):
    return [1.7e308 if c == "big" else 1.0 for c in completions]


def editor(completions, **kwargs):
    completions[:] = ["edited"] * len(completions)
    return [0.0] * len(completions)


def reader(completions, **kwargs):
    return [float(c == "edited") for c in completions]


def appender(completions, tags, **kwargs):
    for t in tags:
        t.append("x")
    return [float(len(t)) for t in tags]


def quitter(completions, **kwargs):
    sys.exit(3)
'''


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    (tmp_path / "hostile.py").write_text(HOSTILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "hostile", raising=False)
    monkeypatch.setattr(reward_funcs, "_LOADED", {})
    monkeypatch.setattr(reward_funcs, "_WARNED", set())
    return lambda *names: load_reward_funcs([f"hostile:{n}" for n in names])


def _grade(funcs, completions, columns=None, lines=None):
    n = len(completions)
    return score(funcs, ["p"] * n, completions, columns or [{}] * n, [f"row {i}" for i in range(n)],
                 (lines if lines is not None else []).append)


def test_a_reward_float32_cannot_hold_fails_its_row_instead_of_training_on_infinity(hostile):
    lines = []
    graded = _grade(hostile("huge"), ["big", "small"], lines=lines)
    assert graded.values["huge"] == [0.0, 1.0] and graded.errors == [1, 0]
    assert "1.7e+308" in lines[0] and "float32" in lines[0]


def test_each_function_and_each_call_gets_its_own_copy_of_the_inputs(hostile):
    graded = _grade(hostile("editor", "reader"), ["a", "b"])
    assert graded.values["reader"] == [0.0, 0.0]  # the editor's in-place change reached no other function
    cell = ["seed"]  # one list cell shared by a group's rows, as the data set cache hands it out
    columns = [{"tags": cell} for _ in range(4)]
    for _ in range(2):  # and no later step
        assert _grade(hostile("appender"), ["a"] * 4, columns).values["appender"] == [2.0] * 4
    assert cell == ["seed"]


def test_a_function_calling_sys_exit_fails_its_rows_with_a_line_and_the_run_goes_on(hostile):
    lines = []
    graded = _grade(hostile("quitter"), ["a", "b"], lines=lines)
    assert graded.values["quitter"] == [0.0, 0.0] and graded.errors == [1, 1]
    [line] = lines
    assert "hostile:quitter failed on row 0" in line and "SystemExit: 3" in line


def test_ctrl_c_inside_a_reward_function_stops_training_in_one_line_leaving_a_resumable_run(
        fast_overrides, tmp_path, capsys, monkeypatch):
    (tmp_path / "stopper.py").write_text(
        "import os\n"
        "def stop_late(completions, **kwargs):\n"
        "    if os.path.exists(os.environ['STOP_FILE']):\n"
        "        raise KeyboardInterrupt\n"
        "    return [0.0] * len(completions)\n")
    monkeypatch.setenv("STOP_FILE", str(tmp_path / "runs" / "s" / "checkpoints" / "step_1"))
    monkeypatch.setattr(reward_funcs, "_LOADED", {})
    args = ["train", "--preset", "math-tiny", *fast_overrides, "log.name=s", "checkpoint.every=1", "train.steps=3",
            f"env.reward_funcs=[{tmp_path / 'stopper.py'}:stop_late]"]
    assert main(args) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stopped by Ctrl-C" in err[0] and "checkpoint.resume=latest" in err[0]
    run = tmp_path / "runs" / "s"
    assert [m["step"] for m in read_metrics(run) if "train/math/reward_func_errors" in m] == [1]
    monkeypatch.setenv("STOP_FILE", str(tmp_path / "never"))
    assert main([*args, "checkpoint.resume=latest"]) == 0  # the run directory was left consistent: it resumes
    assert [m["step"] for m in read_metrics(run) if "train/math/reward_func_errors" in m] == [1, 2, 3]


def documented_reward_module() -> str:
    """The `my_rewards.py` of docs/environments.md ("Your data sets and reward functions"), as a file's text."""
    text = (Path(__file__).parents[1] / "docs" / "environments.md").read_text()
    block = text[text.index("    # my_rewards.py"):].split("\n\n")[0]
    return textwrap.dedent(block)


def test_the_documented_rewards_give_an_untrained_tiny_model_a_gradient(fast_overrides, tmp_path, monkeypatch):
    """The docs' example on the README's prompts command: the untrained tiny model (no solver to warm-start from)
    gets rewards that differ within groups, and success is not handed to every reply."""
    (tmp_path / "my_rewards.py").write_text(documented_reward_module())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    monkeypatch.setattr(reward_funcs, "_LOADED", {})
    rows = [{"prompt": f"What is {i} + {i % 3}?", "answer": str(i + i % 3)} for i in range(12)]
    (tmp_path / "set.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["train", *fast_overrides, "env.name=prompts", "env.max_turns=1", f"env.prompts.source={tmp_path}/set.jsonl",
                 "env.reward_funcs=[my_rewards:says_answer,my_rewards:near_20_chars]",
                 "env.reward_weights.near_20_chars=0.5", "train.group_size=4", "env.max_new_tokens=24", "log.name=doc"])
    assert code == 0
    run = tmp_path / "runs" / "doc"
    groups: dict = {}
    for r in read_rewards(run):
        groups.setdefault((r["step"], r["group"]), []).append(r["total"])
    assert sum(len(set(totals)) == 1 for totals in groups.values()) / len(groups) <= 0.25
    assert not all(r["correct"] for r in read_rewards(run))
