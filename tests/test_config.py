import subprocess
import sys

import pytest

from rldynamics.config import ConfigError, all_keys, help_text, load_config, make_config, parse_overrides, save_config


def test_defaults_and_overrides():
    cfg = make_config(overrides=["train.lr=1e-5", "filter.value=0.9", "algo.clip_c=null", "env.dim_room=[7, 7]"])
    assert cfg.train.lr == 1e-5 and cfg.filter.value == 0.9 and cfg.algo.clip_c is None
    assert cfg.env.dim_room == [7, 7] and cfg.model.path == "tiny"


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
        ("nonsense", "key=value"),
    ],
)
def test_bad_config_is_reported_clearly(override, expected):
    with pytest.raises(ConfigError, match=expected.replace("+", r"\+")):
        make_config(overrides=[override])


def test_unknown_preset():
    with pytest.raises(ConfigError, match="sokoban-ppo"):
        make_config("sokoban-ppx")


def test_save_load_roundtrip(tmp_path):
    cfg = make_config(overrides=["seed=7", "analysis.env_groups=4"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


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
