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



def test_settings_the_demonstrations_do_not_read_leave_the_key_alone():
    """A demonstration plays model.warm_start_turns turns whatever env.max_turns is, and a one-turn
    one shows no reward (the reward reaches the prompt only between turns): neither changes the key
    then; with several demonstrated turns the weights are in the prompts and do."""
    base = "/a/tiny/0123abcd"
    key = warm_start_key(base, make_config())
    same = (["env.reward_weights.box=2"], ["env.max_turns=3"], ["env.reward_weights.solved=0.5"],
            ["env.answer_only=true"])  # a demonstration has no text after its answer
    for overrides in same:
        assert warm_start_key(base, make_config(overrides=overrides)) == key, overrides
    longer = make_config(overrides=["env.max_new_tokens=30"])  # in the system prompt
    assert warm_start_key(base, longer) != key
    two = ["model.warm_start_turns=2"]
    weighted = make_config(overrides=[*two, "env.reward_weights.box=2"])
    assert warm_start_key(base, weighted) != warm_start_key(base, make_config(overrides=two))


def test_a_reward_weight_reuses_the_cached_warm_start(fast_overrides, monkeypatch):
    """Changing a reward weight finds the warm start in the cache (nothing is trained again);
    changing an input of the warm start does not."""
    from rldynamics.train import warmstart
    from rldynamics.train.setup import base_model_path

    fits = []
    real = warmstart.supervised_warm_start
    monkeypatch.setattr(warmstart, "supervised_warm_start",
                        lambda *a, **k: fits.append(1) or real(*a, **k))

    def warm(*overrides: str) -> str:
        return base_model_path(make_config(overrides=[*fast_overrides, *overrides]))

    first = warm("model.warm_start_seed=7")
    reweighted = warm("model.warm_start_seed=7", "env.reward_weights.box=3", "env.max_turns=4")
    assert reweighted == first
    assert len(fits) <= 1  # the first call trained it (unless an earlier test did); not the second
    fits.clear()
    assert warm("model.warm_start_seed=8") != first
    assert fits == [1]


def test_reward_weights_leave_one_turn_demonstrations_unchanged():
    """The claim behind the key: the demonstrated tokens of one-turn episodes do not depend on the
    reward weights."""
    import random

    from rldynamics.models.tiny import build_tiny_tokenizer
    from rldynamics.rollout.agent import rollout
    from rldynamics.train.sft_data import solver_policy
    from rldynamics.train.warmstart import tiny_corpus

    batches = []
    for weights in ([], ["env.reward_weights.box=5", "env.reward_weights.solved=0.1"]):
        env = make_config(overrides=["env.max_turns=1", *weights]).env
        tokenizer = build_tiny_tokenizer(tiny_corpus(env, num_seeds=10))
        respond = solver_policy(tokenizer, env, 0.4, random.Random(0))
        seeds = list(range(5_000_000, 5_000_032))
        batches.append(rollout(None, tokenizer, seeds, 1, env, respond=respond))
    assert torch.equal(batches[0].input_ids, batches[1].input_ids)
    assert torch.equal(batches[0].response_mask, batches[1].response_mask)
    assert not torch.equal(batches[0].scores, batches[1].scores)  # the weights changed the rewards
