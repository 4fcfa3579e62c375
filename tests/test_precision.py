"""Mixed precision (float32 weights, bfloat16 compute) and activation checkpointing: updates are kept, gradients exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import micro_model_batch
from rldynamics.config import ConfigError, make_config
from rldynamics.models.forward import token_logprobs
from rldynamics.models.precision import compute_in, enable_checkpointing
from rldynamics.train.setup import base_model_path
from rldynamics.train.trainer import train


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return micro_model_batch(tmp_path_factory.mktemp("cache"), 2)  # two turns, groups share their prompt


def _changed_fraction(run, base) -> float:
    after = load_file(str(run / "checkpoints" / "step_2" / "actor" / "model.safetensors"))
    before = load_file(str(base / "model.safetensors"))
    changed = sum(int((after[k].float() != before[k].float()).sum()) for k in after)
    return changed / sum(v.numel() for v in after.values())


def test_a_small_bfloat16_step_changes_almost_every_weight(fast_overrides):
    """lr 1e-6 is far below bfloat16's resolution for these weights: stepping bfloat16 weights would keep ~1 % of the
    updates; float32 master weights keep them all, and the checkpoint stores them."""
    common = [*fast_overrides, "train.lr=1e-6", "checkpoint.every=2", "algo.adv_estimator=grpo", "filter.strategy=none",
              "train.env_groups=4", "train.group_size=4", "train.mini_batch_size=16", "train.micro_batch_size=8",
              "algo.entropy_coef=0.01"]  # every weight has a gradient
    base = base_model_path(make_config(overrides=common))
    run = train(make_config(overrides=[*common, "log.name=mixed", "model.dtype=bfloat16"]))
    assert _changed_fraction(run, Path(base)) > 0.95
    weights = load_file(str(run / "checkpoints" / "step_2" / "actor" / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in weights.values())

    # The same step applied to bfloat16 weights loses most of it (what `model.dtype=bfloat16` used to do).
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    kept = sum(int((v != before[k]).sum()) for k, v in model.state_dict().items()) / sum(v.numel() for v in before.values())
    assert kept < 0.2


def test_compute_in_bfloat16_keeps_float32_parameters(setup):
    model, _, batch = setup
    ids, attn = batch.input_ids[:2], batch.attention_mask[:2]
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=attn).logits
    import copy

    mixed = compute_in(copy.deepcopy(model), "bfloat16")
    with torch.no_grad():
        low = mixed(input_ids=ids, attention_mask=attn).logits
    assert all(p.dtype == torch.float32 for p in mixed.parameters())
    assert low.dtype == torch.bfloat16
    assert not torch.equal(low.float(), full)  # it really ran in bfloat16 ...
    torch.testing.assert_close(low.float(), full, rtol=0.05, atol=0.05)  # ... and stays close


def _grads(model, ids, attn, mask, shared_prefix=True):
    model.zero_grad(set_to_none=True)
    lp, ent = token_logprobs(model, ids, attn, temperature=0.7, with_entropy=True, positions=mask,
                             shared_prefix=shared_prefix)  # [N, L]
    weights = torch.linspace(-1, 2, ids.shape[1])  # [L]
    ((lp * weights * mask).sum() + (ent * mask).sum()).backward()
    return lp.detach(), [p.grad.clone() for p in model.parameters()]


def test_gradient_checkpointing_gives_the_same_gradients(setup):
    """The blocks recompute their activations in backward (counted) and the gradients do not change."""
    import copy

    model, _, batch = setup
    ids, attn, mask = batch.input_ids, batch.attention_mask, batch.response_mask
    lp, grads = _grads(model, ids, attn, mask)
    ckpt = enable_checkpointing(copy.deepcopy(model))
    calls = []
    block = ckpt.model.layers[0]
    block.register_forward_pre_hook(lambda *_: calls.append(1))  # outside the checkpoint: one call per forward
    inner = block.self_attn
    inner.register_forward_pre_hook(lambda *_: calls.append(2))  # inside: again when backward recomputes
    lp_c, grads_c = _grads(ckpt, ids, attn, mask)
    assert calls.count(1) == 1 and calls.count(2) == 2  # one plain forward (no shared prefix), one recompute
    torch.testing.assert_close(lp_c, lp, rtol=1e-5, atol=1e-6)
    for g, g_c in zip(grads, grads_c, strict=True):
        torch.testing.assert_close(g_c, g, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # no-grad passes keep their caches (generation, old log-probs): nothing recomputed
        token_logprobs(ckpt, ids, attn, positions=mask)


def test_checkpointed_training_equals_plain_training(fast_overrides):
    common = [*fast_overrides, "checkpoint.every=2", "algo.adv_estimator=gae", "algo.kl_coef=0.01"]
    plain = train(make_config(overrides=[*common, "log.name=plain"]))
    ckpt = train(make_config(overrides=[*common, "log.name=ckpt", "model.gradient_checkpointing=true"]))
    a = load_file(str(plain / "checkpoints" / "step_2" / "actor" / "model.safetensors"))
    b = load_file(str(ckpt / "checkpoints" / "step_2" / "actor" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)


def test_float16_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="model.dtype=bfloat16"):
        make_config(overrides=["model.dtype=float16"])


class _Casts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the float32 -> bfloat16 copies of tensors shaped like `shapes` (the model's weights)."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.count = shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16
                and args[0].dtype == torch.float32 and tuple(args[0].shape) in self.shapes):
            self.count += 1
        return func(*args, **kwargs)


def _two_calls(model, ids, attn, mask, once: bool):
    """The gradients of two calls' summed log-probs (two micro-batches of one step) and the weight casts counted."""
    import contextlib

    from rldynamics.models.precision import weights_cast_once

    model.zero_grad(set_to_none=True)
    casts = _Casts({tuple(p.shape) for p in model.parameters() if p.dim() == 2})
    with casts, (weights_cast_once(model) if once else contextlib.nullcontext()):
        for rows in (slice(0, 2), slice(2, 4)):
            lp, _ = token_logprobs(model, ids[rows], attn[rows], positions=mask[rows], shared_prefix=False)
            (lp * mask[rows]).sum().backward()
    return [p.grad.clone() for p in model.parameters()], casts.count


def test_weights_are_cast_to_bfloat16_once_per_optimizer_step_with_the_same_gradients(setup):
    """`weights_cast_once` around the micro-batches of a step: each weight matrix is cast once instead of at every
    call, and the gradients are those of a cast per call (up to bfloat16 rounding of the summed contributions)."""
    import copy

    model, _, batch = setup
    mixed = compute_in(copy.deepcopy(model), "bfloat16")
    ids, attn, mask = batch.input_ids, batch.attention_mask, batch.response_mask
    matrices = sum(p.dim() == 2 for p in mixed.parameters())
    per_call, n_each = _two_calls(mixed, ids, attn, mask, once=False)
    shared, n_once = _two_calls(mixed, ids, attn, mask, once=True)
    assert n_each == 2 * n_once and n_once == matrices  # embedding and blocks: every matrix, once
    for a, b in zip(per_call, shared, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-4)
    assert all(p.grad.dtype == torch.float32 for p in mixed.parameters())


def test_bfloat16_on_cpu_attends_in_float32(setup):
    """The bfloat16 model's attention runs transformers' SDPA on float32 q, k, v (faster there on a CPU); the
    checkpoint it saves names no attention implementation of ours and loads anywhere."""
    import copy
    import json
    import tempfile

    from transformers import AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from rldynamics.models.attention import GQA_SDPA
    from rldynamics.models.precision import FLOAT32_SDPA

    model, _, batch = setup
    assert model.config._attn_implementation == GQA_SDPA  # the tiny model groups its key/value heads
    mixed = compute_in(copy.deepcopy(model), "bfloat16")
    assert mixed.config._attn_implementation == FLOAT32_SDPA
    seen = []
    module = mixed.model.layers[0].self_attn
    module.register_forward_hook(lambda m, args, out: seen.append(out[0]))
    ids, attn = batch.input_ids[:2], batch.attention_mask[:2]
    with torch.no_grad():
        low = mixed(input_ids=ids, attention_mask=attn).logits
    assert low.dtype == torch.bfloat16 and seen[0].dtype == torch.bfloat16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    from transformers import AttentionInterface

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = AttentionInterface()[FLOAT32_SDPA](module, q, k, v, None, is_causal=True)
    expected, _ = sdpa_attention_forward(module, q.float(), k.float(), v.float(), None, is_causal=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected.to(torch.bfloat16))
    with tempfile.TemporaryDirectory() as tmp:
        mixed.save_pretrained(tmp)
        assert "rldyn" not in json.dumps(json.load(open(f"{tmp}/config.json")))
        assert AutoModelForCausalLM.from_pretrained(tmp).config._attn_implementation == "sdpa"
