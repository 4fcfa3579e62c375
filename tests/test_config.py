import math
import os
import re
import subprocess
import sys
import typing
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rldynamics.config import (
    Config,
    ConfigError,
    all_keys,
    help_text,
    load_config,
    make_config,
    parse_overrides,
    save_config,
)


def test_defaults_and_overrides():
    cfg = make_config(overrides=["train.lr=1e-5", "filter.value=0.9", "algo.clip_c=null",
                                 "env.sokoban.dim_room=[7, 7]"])
    assert cfg.train.lr == 1e-5 and cfg.filter.value == 0.9 and cfg.algo.clip_c is None
    assert cfg.env.sokoban.dim_room == [7, 7] and cfg.model.path == "tiny"


def test_presets_differ_where_documented():
    ppo, grpo = make_config("sokoban-ppo"), make_config("sokoban-grpo")
    assert (ppo.algo.adv_estimator, grpo.algo.adv_estimator) == ("gae", "grpo")
    assert grpo.algo.loss_agg_mode == "seq-mean-token-mean"
    assert ppo.train.env_groups == 8 and ppo.train.group_size == 16 and ppo.val.env_groups == 512


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.lrr=1", "train.lr"),  # unknown key -> close match suggested
        ("trian.lr=1", "train.lr"),
        ("train.lr=abc", "train.lr"),  # bad type names the key
        ("algo.kl_type=low-var-kl", "low_var_kl"),  # bad choice lists the allowed values
        ("filter.strategy=top_q", "top_p"),
        ("train.env_groups=0", "positive"),
        ("algo.clip_c=0.5", "clip_c"),
        ("algo.cispo_clip_low=1.5", "algo.cispo_clip_low"),
        ("nonsense", "key=value"),
    ],
)
def test_bad_config_is_reported_clearly(override, expected):
    with pytest.raises(ConfigError, match=expected.replace("+", r"\+")):
        make_config(overrides=[override])


def test_answer_only_is_refused_where_the_env_grades_the_whole_reply():
    assert make_config("countdown-tiny", overrides=["env.answer_only=true"]).env.answer_only
    with pytest.raises(ConfigError, match="env.answer_only=true has no effect on env 'math'"):
        make_config("math-tiny", overrides=["env.answer_only=true"])


def test_unknown_preset():
    with pytest.raises(ConfigError, match="sokoban-ppo"):
        make_config("sokoban-ppx")


def test_save_load_roundtrip(tmp_path):
    cfg = make_config(overrides=["seed=7", "analysis.env_groups=4"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_an_old_config_yaml_with_retired_keys_still_loads(tmp_path, capsys):
    """A run's config.yaml written before probe mode became its own command holds `analysis.only: false`, and the
    tiny model's knobs under `model.tiny_*`: it loads as the same config, with a one-line note per old key;
    `analysis.only=true` (probe mode through training) is refused, naming the command."""
    cfg = make_config(overrides=["seed=7", "tiny.hidden_size=32", "tiny.tie_embeddings=false"])
    save_config(cfg, tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    old = text.replace("tiny:\n  hidden_size: 32\n  layers: 2\n  tie_embeddings: false\n", "").replace(
        "model:\n", "model:\n  tiny_hidden_size: 32\n  tiny_layers: 2\n  tiny_tie_embeddings: false\n").replace(
        "  exit_after: false\n", "  exit_after: false\n  only: false\n")
    assert "only: false" in old and "tiny_hidden_size: 32" in old and "\ntiny:" not in old
    (tmp_path / "config.yaml").write_text(old)
    assert load_config(tmp_path / "config.yaml") == cfg
    err = capsys.readouterr().err
    assert "note: analysis.only" in err and "note: model.tiny_hidden_size" in err and "is now tiny.hidden_size" in err
    assert make_config(overrides=["model.tiny_layers=3"]).tiny.layers == 3  # old command lines too
    with pytest.raises(ConfigError, match="rldyn probe"):
        make_config(overrides=["analysis.only=true"])


def test_parse_overrides_nests_and_keeps_the_typed_text():
    assert parse_overrides(["a.b=1", "a.c=x", "d=true"]) == {"a": {"b": "1", "c": "x"}, "d": "true"}


def test_help_lists_every_key():
    text = help_text()
    for key in all_keys():
        assert key in text, key


def test_cli_rejects_bad_key_before_any_work(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rldynamics.cli", "train", "train.lrr=1",
                          f"log.run_dir={tmp_path}"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "train.lr" in out.stderr and "unknown config key" in out.stderr
    assert not any(tmp_path.iterdir())  # nothing was written


# Runs `rldyn ARGV` in this interpreter, then prints whether torch was ever imported (an atexit hook runs after main).
TORCH_FREE = """
import atexit, sys
atexit.register(lambda: print("torch imported:", "torch" in sys.modules, file=sys.stderr))
from rldynamics.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv", [["train", "train.lrr=1"], ["train", "train.lr=abc"], ["train", "--help-config"],
                                  ["--help"], ["train", "--help"], ["train", "env.name=sokobann"],
                                  ["eval", "tiny", "val.env_groupz=3"], ["eval", "--help"]])
def test_cli_answers_config_and_help_without_importing_torch(tmp_path, argv):
    out = subprocess.run([sys.executable, "-c", TORCH_FREE, *argv, f"log.run_dir={tmp_path}"],
                         capture_output=True, text=True)
    assert "torch imported: False" in out.stderr, out.stderr
    assert out.returncode in (0, 2) and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize(
    "override, key, expected",
    [
        ("log.name=no", "log.name", "no"),  # YAML would read False
        ("log.name=0123", "log.name", "0123"),  # YAML would read the octal 83
        ("log.name=${oc.env:HOME}", "log.name", "${oc.env:HOME}"),  # no interpolation
        ("log.name=[1, 2]", "log.name", "[1, 2]"),
        ("log.name=null", "log.name", None),
        ("train.steps=010", "train.steps", 10),
        ("train.steps=+7", "train.steps", 7),
        ("analysis.enabled=Yes", "analysis.enabled", True),
        ("analysis.enabled=off", "analysis.enabled", False),
        ("train.lr=1e-5", "train.lr", 1e-5),
        ("train.lr=3", "train.lr", 3.0),
        ("algo.clip_c=", "algo.clip_c", None),
        ("model.device=cuda:1", "model.device", "cuda:1"),
    ],
)
def test_values_mean_what_was_typed(override, key, expected):
    cfg = make_config(overrides=[override])
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["analysis.enabled=2"], "analysis.enabled"),  # booleans: only boolean spellings
        (["analysis.enabled=y"], "analysis.enabled"),
        (["train.steps=1e3"], "train.steps"),
        (["train.steps=7.5"], "train.steps"),
        (["train.lr=nan"], "train.lr"),
        (["train.lr=inf"], "train.lr"),
        (["filter.value=1e309"], "filter.value"),
        (["train.lr=-1e-5"], "train.lr"),
        (["train.max_grad_norm=0"], "train.max_grad_norm"),
        (["critic.max_grad_norm=-1"], "critic.max_grad_norm"),
        (["early_stop.val_patience=0"], "early_stop.val_patience"),
        (["early_stop.rv_baseline_steps=0"], "early_stop.rv_baseline_steps"),
        (["train.temperature=0"], "train.temperature"),
        (["val.temperature=-1"], "val.temperature"),
        (["train.temperature=1e-400"], "train.temperature"),  # underflows to 0
        (["model.warm_start_noise=1.5"], "model.warm_start_noise"),
        (["algo.gamma=-0.1"], "algo.gamma"),
        (["algo.kl_coef=-1"], "algo.kl_coef"),
        (["train.mini_batch_size=0"], "train.mini_batch_size"),
        (["seed=-1"], "seed"),
        (["model.device=gpu"], "model.device"),
        (["model.path="], "model.path"),
        (["env.sokoban.dim_room=[2, 6]"], "env.sokoban"),  # checked by the env itself
        (["env.sokoban.dim_room=[6, 6"], "env.sokoban.dim_room"),  # invalid YAML in a list value
        (["env.reward_weights.box=x"], "env.reward_weights.box"),
        (["env.reward_weights.nosuch=1"], "nosuch"),
        (["env.reward_weights=[1]"], "env.reward_weights"),
        (["train.lr.x=1"], "train.lr"),  # a nested key into a scalar
        (["train.lr=1", "train.lr.x=2"], "train.lr"),
        (["train.lr.x=2", "train.lr=1"], "train.lr"),
        (["train=3"], "train"),
        (["train..lr=1"], "train..lr"),  # an empty key part
        (["=1"], "key=value"),
        (["log.name=a\x01b"], "log.name"),  # a control character
        (["log.name=\udcff"], "log.name"),  # an undecodable byte from the shell
        (["train.l\tr=1"], "train.l\\tr"),  # shown escaped
    ],
)
def test_bad_values_are_one_line_errors_naming_the_key(overrides, named):
    with pytest.raises(ConfigError) as e:
        make_config(overrides=overrides)
    assert named in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "text, named",
    [
        ("train:\n  lr: 1e-3\ntrain:\n  steps: 3\n", "'train' appears twice"),
        ("train:\n  lr: 1e-3\n  lr: 2e-3\n", "'lr' appears twice"),
        ("train:\n  lr: [1e-3\n", "not valid YAML"),
        ("train: {steps: 3}\nlog:\n  name: no\n", None),  # valid: name is the text "no"
        ("- 1\n- 2\n", "mapping"),
        ("train:\n  steps: 010\n", None),
        ("log: !!python/object/apply:os.system [echo hi]\n", "log"),
    ],
)
def test_config_file_errors(tmp_path, text, named):
    file = tmp_path / "c.yaml"
    file.write_text(text)
    if named is None:
        cfg = make_config(file=file)
        assert cfg.log.name in (None, "no") and cfg.train.steps in (3, 10)
        return
    with pytest.raises(ConfigError, match=named) as e:
        make_config(file=file)
    assert "\n" not in str(e.value) and str(file) in str(e.value)


def test_overrides_may_come_before_and_after_config_file(tmp_path, capsys):
    """`rldyn train a=1 --config F b=2`: both overrides apply (argparse alone rejects `b=2`); checked with a bad
    value so that no training starts."""
    file = tmp_path / "c.yaml"
    file.write_text("train: {steps: 3}\n")
    from rldynamics.cli import main

    assert main(["train", "log.name=x", "--config", str(file), f"log.run_dir={tmp_path / 'runs'}",
                 "train.lr=abc"]) == 2
    err = capsys.readouterr().err
    assert "train.lr='abc'" in err and "unrecognized" not in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("argv", [["train", "train.lr=1e999", "--config"], ["train", "log.name=a\x07"],
                                  ["probe", "missing_checkpoint", "train.lr=x"]])
def test_cli_bad_values_fail_before_any_work(tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("log: {name: x}\n")
    argv = [*argv, "c.yaml"] if argv[-1] == "--config" else argv
    out = subprocess.run([sys.executable, "-m", "rldynamics.cli", *argv, f"log.run_dir={tmp_path / 'runs'}"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- fuzzing: a one-line ConfigError or the meant value

def _field_type(key: str):
    owner = Config()
    *sections, name = key.split(".")
    for part in sections:
        owner = getattr(owner, part)
    return typing.get_type_hints(type(owner))[name]


FIELD_TYPES = {key: _field_type(key) for key in all_keys()}
_SPECIAL = ["", " ", "0", "1", "-1", "010", "0x10", "1e3", "1.5", "-0", "+3", "nan", "NaN", "inf", "-inf", "1e308",
            "1e309", "1e-400", "true", "False", "yes", "no", "on", "off", "y", "n", "null", "~", "None", "[1, 2]",
            "[6, 6]", "[3, 3]", "{a: 1}", "[", "]", "{", "'x'", '"y"', "${x}", "!!python/object:os.system", "a\x00b",
            "\udcff", "é", "١٢", "1_000", " 5 ", "auto", "cpu", "cuda:0", "grpo", "top_p", "2**8",
            "99999999999999999999", "{}", "{box: 2}", "{success: 0.5}", "{nosuch: 1}"]
_VALUES = st.one_of(st.sampled_from(_SPECIAL), st.text(max_size=12), st.integers(-10**20, 10**20).map(str),
                    st.floats(allow_nan=True, allow_infinity=True).map(repr))
_KEYS = st.one_of(st.sampled_from(all_keys()), st.sampled_from(all_keys()).map(lambda k: k + ".x"),
                  st.sampled_from(["", ".", "train.", ".lr", "train..lr", "trian.lr", "train", "x", "log.name.a.b"]),
                  st.text(max_size=10))


def _meant(raw: str, hint) -> object:
    """The value a user means by `raw` for a field of type `hint`, or INVALID (an independent statement of the
    rules in config.py's docstring)."""
    args = typing.get_args(hint)
    if type(None) in args:
        if raw.strip() in ("null", "Null", "NULL", "~", ""):
            return None
        hint = next(a for a in args if a is not type(None))
    if any(unicodedata.category(c) in ("Cc", "Cs") for c in raw):
        return INVALID
    text = raw.strip()
    if hint is str:
        return raw if raw else INVALID
    if hint is bool:
        return {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}.get(text.lower(),
                                                                                                    INVALID)
    if hint is int:
        digits = text[1:] if text[:1] in "+-" else text
        return int(text) if digits and all(c in "0123456789" for c in digits) and abs(int(text)) < 2**63 else INVALID
    if hint is float:
        try:
            number = float(text)
        except ValueError:
            return INVALID
        return number if math.isfinite(number) else INVALID
    if typing.get_origin(hint) is dict:  # a mapping of at most one name here
        m = re.fullmatch(r"\{\s*(?:(\w+)\s*:\s*([^,{}\s]+)\s*)?\}", text)
        weight = _meant(m.group(2), float) if m and m.group(1) else None
        return INVALID if not m or weight is INVALID else ({m.group(1): weight} if m.group(1) else {})
    if typing.get_origin(hint) is list:
        try:
            items = [x.strip() for x in text.removeprefix("[").removesuffix("]").split(",")]
        except AttributeError:
            return INVALID
        ok = text.startswith("[") and text.endswith("]") and all(i.lstrip("+-").isdigit() for i in items)
        return [int(i) for i in items] if ok and all(i.isascii() for i in items) else INVALID
    return INVALID


INVALID = object()


@settings(max_examples=int(os.environ.get("RLDYN_FUZZ_EXAMPLES", "600")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])  # the fault drill sets RLDYN_FUZZ_EXAMPLES higher
@given(items=st.lists(st.tuples(_KEYS, _VALUES), min_size=1, max_size=3))
def test_fuzzed_overrides_give_a_config_error_or_the_meant_value(items):
    overrides = [f"{k}={v}" for k, v in items]
    try:
        cfg = make_config(overrides=overrides)
    except ConfigError as e:
        assert "\n" not in str(e) and str(e)
        return
    last = {}
    for override in overrides:  # a later override of the same key wins (before any value is read)
        k, v = override.split("=", 1)  # at the first "=", as the parser does: `log.name==` sets log.name to "="
        last[k.strip()] = v
    for key, raw in last.items():
        assert key in FIELD_TYPES, f"unknown key {key!r} was accepted"
        meant = _meant(raw, FIELD_TYPES[key])
        assert meant is not INVALID, f"{key}={raw!r} was accepted"
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        assert value == meant and type(value) is type(meant), (key, raw, value)


def test_tiny_ppo_preset_is_the_tiny_preset_with_the_ppo_changes():
    from rldynamics.config import config_diff

    changed = {key for key, _, _ in config_diff(make_config("sokoban-tiny"), make_config("sokoban-tiny-ppo"))}
    assert changed == {"algo.adv_estimator", "train.env_groups", "train.group_size", "train.steps", "critic.lr",
                       "critic.ppo_epochs", "critic.warmup_steps"}
    ppo = make_config("sokoban-tiny-ppo")
    assert ppo.algo.adv_estimator == "gae" and ppo.train.env_groups * ppo.train.group_size == 64
