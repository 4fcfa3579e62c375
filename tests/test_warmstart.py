"""Warm-start cache keys: same inputs, same key wherever the cache lives; any weight-changing input, new key."""

from __future__ import annotations

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
        ["model.warm_start_lr=1e-4"], ["model.warm_start_turns=2"], ["seed=1"],
        ["env.sokoban.observation_format=coord"],
    )}
    assert len(keys) == 8
