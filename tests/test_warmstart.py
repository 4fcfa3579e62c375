"""Warm-start cache keys: same inputs, same key wherever the cache lives; any weight-changing input, new key."""

from __future__ import annotations

from pathlib import Path

import torch

from rldynamics.config import make_config
from rldynamics.train.warmstart import warm_start_key


def test_warm_start_key_ignores_the_cache_location():
    cfg = make_config()
    assert warm_start_key("/a/tiny/0123abcd", cfg) == warm_start_key("/elsewhere/cache/tiny/0123abcd", cfg)
    assert warm_start_key("/a/tiny/0123abcd", cfg) != warm_start_key("/a/tiny/fedc9876", cfg)


def test_warm_start_key_changes_with_every_input():
    base = "/a/tiny/0123abcd"
    keys = {warm_start_key(base, make_config(overrides=ov)) for ov in (
        [], ["model.warm_start_noise=0.3"], ["model.warm_start_episodes=16"], ["model.warm_start_epochs=2"],
        ["model.warm_start_lr=1e-4"], ["model.warm_start_turns=2"], ["model.warm_start_seed=1"],
        ["env.sokoban.observation_format=coord"],
    )}
    assert len(keys) == 8


def test_the_run_seed_leaves_the_warm_start_alone():
    """Runs that differ only in `seed` start from the same warm-started weights (as from one pretrained model)."""
    base = "/a/tiny/0123abcd"
    assert warm_start_key(base, make_config(overrides=["seed=1"])) == warm_start_key(base, make_config())


def test_the_default_warm_start_ships_with_the_package(tmp_path, monkeypatch, capsys):
    """A first `rldyn train` of the default finds its warm start in the package instead of computing it: the cache
    gets exactly the packaged weights. Fails after any change to the tiny model, its corpus, the env's prompts or
    the warm start until `scripts/package_warm_start.py` has packaged the new key."""
    from safetensors.torch import load_file

    from rldynamics.train.setup import base_model_path
    from rldynamics.train.warmstart import packaged_weights

    monkeypatch.setenv("RLDYN_CACHE", str(tmp_path))
    for preset in ("sokoban-tiny", "sokoban-tiny-ppo"):
        warm = Path(base_model_path(make_config(preset)))
        assert packaged_weights(warm.name).is_file(), f"no packaged warm start {warm.name}: run " \
                                                      "scripts/package_warm_start.py"
        assert (warm / "model.safetensors").read_bytes() == packaged_weights(warm.name).read_bytes()
    assert "the packaged weights of this setting" in capsys.readouterr().out
    shipped = load_file(packaged_weights(warm.name))
    assert shipped and all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in shipped.values())
