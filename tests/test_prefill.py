"""Shared-prompt prefill: the cached prompt gives generate's own logits and samples."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList
from transformers.cache_utils import DynamicLayer

from rldynamics.config import make_config
from rldynamics.models.loading import load_model_and_tokenizer
from rldynamics.models.tiny import ensure_tiny_model
from rldynamics.rollout.agent import generate
from rldynamics.rollout.chat import ChatPrompts
from rldynamics.rollout.prefill import RoomyLayer, TurnCaches, shared_prompt_cache
from rldynamics.rollout.sampling import CdfSampling
from rldynamics.train.warmstart import tiny_corpus


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = make_config(overrides=["env.max_new_tokens=6"])
    path = ensure_tiny_model(lambda: tiny_corpus(cfg.env, num_seeds=10), tmp_path_factory.mktemp("cache"),
                             hidden_size=32, num_layers=2, intermediate_size=64)
    model, tokenizer = load_model_and_tokenizer(str(path))
    long = tokenizer("Turn 1:\nState:\n#####\n#_P_#\n#####\nYou have 10 actions left.")["input_ids"]
    prompts = [long] * 3 + [long[:-7]] * 2 + [long[3:]]  # groups of different lengths (left padding) and a single
    return model, tokenizer, prompts


def _left_pad(prompts, pad):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # [B, W]
    return ids, (ids != pad).long() if pad not in sum(prompts, []) else None


def test_cached_prompt_gives_the_full_forward_logits(setup):
    model, tokenizer, prompts = setup
    ids, attn = _left_pad(prompts, tokenizer.pad_token_id)  # [B, W]
    cache = shared_prompt_cache(model, ids, attn)
    assert cache is not None and cache.get_seq_length() == ids.shape[1] - 1
    positions = (attn.cumsum(-1) - 1).masked_fill(attn == 0, 0)  # [B, W]
    with torch.no_grad():
        last = model(input_ids=ids[:, -1:], attention_mask=attn, position_ids=positions[:, -1:],
                     past_key_values=cache).logits[:, -1]  # [B, V]
        full = model(input_ids=ids, attention_mask=attn, position_ids=positions).logits[:, -1]  # [B, V]
    torch.testing.assert_close(last, full, rtol=1e-5, atol=1e-5)


def test_no_cache_when_every_prompt_differs(setup):
    model, tokenizer, prompts = setup
    ids, attn = _left_pad([prompts[0], prompts[3]], tokenizer.pad_token_id)
    assert shared_prompt_cache(model, ids, attn) is None


def test_generate_samples_what_plain_generate_samples(setup):
    model, tokenizer, prompts = setup
    stop_ids = ChatPrompts(tokenizer, model=model).stop_ids
    torch.manual_seed(3)
    shared = generate(model, tokenizer, prompts, 12, 1.0, stop_ids)
    ids, attn = _left_pad(prompts, tokenizer.pad_token_id)
    torch.manual_seed(3)
    out = model.generate(input_ids=ids, attention_mask=attn, do_sample=False, temperature=1.0, max_new_tokens=12,
                         eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id,
                         logits_processor=LogitsProcessorList([CdfSampling()]))  # the sampler `generate` uses
    plain = [[t for t in row] for row in out[:, ids.shape[1]:].tolist()]
    plain = [row[:next((i + 1 for i, t in enumerate(row) if t in stop_ids), len(row))] for row in plain]
    assert shared == plain
    assert len({tuple(r) for r in shared[:3]}) > 1  # group members still sample their own tokens


def _two_turns(model, tokenizer, prompts, caches, seed=5):
    """Turn 1 from `prompts`, then turn 2 from each prompt + its response + an observation; both turns' samples."""
    stop_ids = ChatPrompts(tokenizer, model=model).stop_ids
    keys = list(range(len(prompts)))
    torch.manual_seed(seed)
    first = generate(model, tokenizer, prompts, 8, 1.0, stop_ids, caches=caches, cache_keys=keys if caches else None)
    observation = tokenizer("\nReward: 0\nTurn 2:\nState:\n#_P#")["input_ids"]
    following = [p + r + observation[: 3 + i] for i, (p, r) in enumerate(zip(prompts, first, strict=True))]
    second = generate(model, tokenizer, following, 8, 1.0, stop_ids, caches=caches, cache_keys=keys if caches else None)
    return first, following, second


def test_turn_caches_sample_what_a_full_prefill_samples(setup):
    model, tokenizer, prompts = setup
    caches = TurnCaches(model)
    first, following, second = _two_turns(model, tokenizer, prompts, caches)
    assert (first, second) == _two_turns(model, tokenizer, prompts, None)[::2]
    assert all(caches.rows[k][0] == following[k] + second[k][:-1] for k in range(len(prompts)))


def test_turn_cache_gives_the_full_forward_logits(setup):
    """The next turn's cache (rows of different lengths and offsets) + the uncached tail = the full forward."""
    model, tokenizer, prompts = setup
    caches = TurnCaches(model)
    _, following, second = _two_turns(model, tokenizer, prompts, caches)
    third = [f + s + [7, 8, 9][: 1 + i % 3] for i, (f, s) in enumerate(zip(following, second, strict=True))]
    ids, attn = _left_pad(third, tokenizer.pad_token_id)  # [B, W]
    keys = list(range(len(third)))
    cache = caches.batch_cache(keys, third)
    common = cache.get_seq_length()
    assert 0 < common < ids.shape[1] - 1  # most of every row comes from its cache
    positions = (attn.cumsum(-1) - 1).masked_fill(attn == 0, 0)  # [B, W]
    with torch.no_grad():
        tail = model(input_ids=ids[:, common:], attention_mask=attn, position_ids=positions[:, common:],
                     past_key_values=cache).logits  # [B, W - C, V]
        full = model(input_ids=ids, attention_mask=attn, position_ids=positions).logits[:, common:]  # [B, W - C, V]
    real = attn[:, common:].bool()  # [B, W - C]
    torch.testing.assert_close(tail[real], full[real], rtol=1e-5, atol=1e-5)


def test_a_prompt_that_does_not_continue_its_cache_is_recomputed(setup):
    model, tokenizer, prompts = setup
    caches = TurnCaches(model)
    _, following, _ = _two_turns(model, tokenizer, prompts, caches)
    other = [list(reversed(f)) for f in following]  # no longer starts with the cached ids
    assert caches.batch_cache(list(range(len(other))), other) is None


def test_a_roomy_layer_holds_what_a_dynamic_layer_holds_and_copies_only_the_new_positions():
    gen = torch.Generator().manual_seed(0)
    plain, roomy = DynamicLayer(), RoomyLayer.of(DynamicLayer(), room=3)

    def both(apply):
        apply(plain)
        apply(roomy)
        assert torch.equal(roomy.keys, plain.keys) and torch.equal(roomy.values, plain.values)
        assert roomy.get_seq_length() == plain.get_seq_length()

    def update(width, rows=4):
        k, v = (torch.randn(rows, 2, width, 5, generator=gen) for _ in range(2))  # [B, H, m, D]
        return lambda layer: layer.update(k, v)

    both(update(6))  # a prefill: room for 3 more
    buffer = roomy.key_buffer
    for _ in range(3):
        both(update(1))  # decode steps write into the room: the same buffer
        assert roomy.key_buffer is buffer and roomy.keys.data_ptr() == buffer.data_ptr()
    both(update(1))  # full: a new buffer
    assert roomy.key_buffer is not buffer and roomy.keys.shape[2] == 10
    both(lambda layer: layer.crop(-2))  # a view of the buffer: the next update overwrites the cropped positions
    both(update(2))
    both(lambda layer: layer.batch_select_indices(torch.tensor([2, 0])))  # not a view: copied into a new buffer
    both(update(1, rows=2))
    assert roomy.keys.shape[0] == 2 and roomy.keys.data_ptr() == roomy.key_buffer.data_ptr()
