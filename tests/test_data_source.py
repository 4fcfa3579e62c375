"""Data sets the way users have them: save_to_disk directories, CSV files, cached hub ids, split and column choice."""

from __future__ import annotations

import json
import socket

import pytest

from conftest import require_package
from rldynamics.config import ConfigError, make_config
from rldynamics.envs import make_env
from rldynamics.envs.data_source import read_rows
from rldynamics.envs.math_data import load_problems

require_package("datasets", 'pip install -e ".[datasets]"')
import datasets  # noqa: E402


def saved_dict(path, **splits):
    datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}).save_to_disk(path)
    return str(path)


TRAIN = [{"problem": "1+1?", "solution": "2", "level": 1}, {"problem": "2+3?", "solution": "5", "level": 2}]
TEST = [{"problem": "4+4?", "solution": "8", "level": 1}]


def test_save_to_disk_directory_with_split_and_column_choice(tmp_path):
    source = saved_dict(tmp_path / "ds", train=TRAIN, test=TEST)
    problems = load_problems(source, "problem", "solution", split="test")
    assert [(p.question, p.answer, p.where) for p in problems] == [("4+4?", "8", "row 0")]
    assert problems[0].row == TEST[0]  # every column, for the reward functions
    assert [p.answer for p in load_problems(source, "problem", "solution")] == ["2", "5"]
    with pytest.raises(ValueError, match=r"has no split 'validation'; its splits: train, test"):
        load_problems(source, "problem", "solution", split="validation")
    cfg = make_config("math-tiny", overrides=[f"env.math.source={source}", "env.math.split=test",
                                              "env.math.question_key=problem", "env.math.answer_key=solution"])
    env = make_env("math", **cfg.env.options())
    assert env.reset(0) == "4+4?" and env.step("\\boxed{8}").reward["correctness"] == 1.0
    with pytest.raises(ConfigError, match=r"row 0 has no column 'question' \(columns: problem, solution, level\)"):
        make_config("math-tiny", overrides=[f"env.math.source={source}"])


def test_saved_dataset_and_csv_file(tmp_path):
    datasets.Dataset.from_list(TRAIN).save_to_disk(tmp_path / "one")
    assert [r["problem"] for _, r in read_rows(str(tmp_path / "one"))] == ["1+1?", "2+3?"]
    with pytest.raises(ValueError, match="single Dataset"):
        read_rows(str(tmp_path / "one"), "test")
    csv = tmp_path / "m.csv"
    csv.write_text("question,answer\nWhat is 6*7?,42\nHalf of 9?,4.5\n")
    assert [(p.question, p.answer) for p in load_problems(str(csv))] == [("What is 6*7?", "42"), ("Half of 9?", "4.5")]
    jsonl = tmp_path / "m.jsonl"
    jsonl.write_text(json.dumps({"question": "q", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match="a single file has no split 'test'"):
        read_rows(str(jsonl), "test")


def test_directory_of_data_files_with_splits(tmp_path):
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "train.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    (tmp_path / "set" / "test.jsonl").write_text(json.dumps({"question": "3+3?", "answer": "6"}) + "\n")
    assert [(p.question, p.answer) for p in load_problems(str(tmp_path / "set"), split="test")] == [("3+3?", "6")]
    with pytest.raises(ValueError, match="validation"):
        load_problems(str(tmp_path / "set"), split="validation")


def test_hub_id_not_in_the_cache_fails_at_once_without_the_network(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError(f"a network call was attempted: {args}")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    with pytest.raises(ValueError, match=r"'no-such-org/no-such-set' cannot be read offline.*local cache"):
        read_rows("no-such-org/no-such-set")
    with pytest.raises(ConfigError, match=r"env.math.*missing.jsonl' does not exist"):
        make_config("math-tiny", overrides=["env.math.source=missing.jsonl"])  # a file name, never a hub id


def test_gsm8k_solutions_without_the_marker_are_refused_with_the_fix(tmp_path):
    solution = "Tom has 3 apples.\nHe buys 2 more, so 3 + 2 = 5."
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"question": "a", "answer": "3 + 2 = 5\n#### 5"}) + "\n"
                     + json.dumps({"question": "b", "answer": solution}) + "\n")
    with pytest.raises(ValueError, match=r"line 2's 'answer' has no '#### <answer>' marker, unlike 1 other rows.*"
                                         r"env.math.answer_key"):
        load_problems(str(mixed))
    unmarked = tmp_path / "unmarked.jsonl"
    unmarked.write_text(json.dumps({"question": "b", "answer": solution}) + "\n")
    with pytest.raises(ValueError, match=r"line 1's 'answer' reads as a worked solution \(14 words, 2 lines\).*"
                                         r"'#### <final answer>'"):
        load_problems(str(unmarked))
    with pytest.raises(ConfigError, match="reads as a worked solution"):
        make_config("math-tiny", overrides=[f"env.math.source={unmarked}"])
    final = tmp_path / "final.jsonl"  # MATH-500 style: short final answers, no marker
    final.write_text(json.dumps({"question": "b", "answer": "\\frac{3}{4}"}) + "\n")
    assert load_problems(str(final))[0].answer == "\\frac{3}{4}"


def test_a_directory_mixing_file_types_is_refused_not_read_in_part(tmp_path):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for i in range(2):
        (mixed / f"a{i}.jsonl").write_text(json.dumps({"question": f"{i}+1?", "answer": str(i + 1)}) + "\n")
        (mixed / f"b{i}.csv").write_text("question,answer\n" + "".join(f"{i}+{j}?,{i + j}\n" for j in range(2)))
    with pytest.raises(ValueError, match=r"mixes data file types \(2 \.csv, 2 \.jsonl\).*drop") as e:
        read_rows(str(mixed))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="mixes data file types"):
        make_config("math-tiny", overrides=[f"env.math.source={mixed}"])


def test_a_link_loop_and_an_unclosed_csv_quote_are_named_as_what_they_are(tmp_path, monkeypatch):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    monkeypatch.chdir(tmp_path)
    for source in (str(tmp_path / "loop"), "loop"):  # "loop" also reads as a hub id
        with pytest.raises(ValueError, match="is a link that leads nowhere") as e:
            read_rows(source)
        assert "hub" not in str(e.value)
    unclosed = tmp_path / "q.csv"
    unclosed.write_text('question,answer\n"What is 2+2?,4\nHalf of 8?,4\n')
    with pytest.raises(ValueError, match=r"the row starting on line 2 is not valid CSV .*close every quoted cell"):
        read_rows(str(unclosed))
