"""Generation's linears through oneDNN with packed weights (`models.packed`): the same outputs as `F.linear` up to
float32 rounding, the module's own forward wherever a packed copy cannot serve, everything restored on exit, and a
rollout whose recorded log-probs are the trainer's."""

from __future__ import annotations

import pytest
import torch

from rldynamics.config import make_config
from rldynamics.models.forward import batch_logprobs
from rldynamics.models.loading import load_model_and_tokenizer
from rldynamics.models.packed import MIN_ELEMENTS, PackedLinear, available, packed_linears
from rldynamics.models.precision import compute_in
from rldynamics.models.tiny import ensure_tiny_model
from rldynamics.rollout.agent import rollout
from rldynamics.train.warmstart import tiny_corpus

pytestmark = pytest.mark.skipif(not available(), reason="this PyTorch build has no oneDNN packed linear")


def _linear(bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(0)
    layer = torch.nn.Linear(576, 512, bias=bias)  # 294,912 weights: over MIN_ELEMENTS
    assert layer.weight.numel() >= MIN_ELEMENTS
    return layer


@pytest.mark.parametrize("shape", [(16, 576), (16, 1, 576), (2, 37, 576), (1, 576)])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_linear_gives_f_linear_up_to_rounding(shape, bias):
    layer = _linear(bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        want = torch.nn.functional.linear(x, layer.weight, layer.bias)  # [..., 512]
        with packed_linears(layer, rows=16) as count:
            assert count == 1 and isinstance(layer.forward, PackedLinear)
            got = layer(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert "forward" not in layer.__dict__  # the class's own forward again


def test_calls_a_packed_copy_cannot_serve_run_the_modules_own_forward():
    """With gradients or under autocast the call is the module's own, bit for bit."""
    layer = _linear()
    x = torch.randn(4, 576)
    plain = layer(x)  # with gradients
    with packed_linears(layer, rows=4):
        assert torch.equal(layer(x), plain)  # gradients on: the module's own forward
        layer(x).sum().backward()  # and its gradients reach the weight
        assert layer.weight.grad is not None
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            want = torch.nn.functional.linear(x, layer.weight, layer.bias)
            assert want.dtype == torch.bfloat16 and torch.equal(layer(x), want)  # as the module computes it


def test_a_bfloat16_model_packs_bfloat16_weights_for_its_autocast():
    """A model computing in bfloat16 (float32 weights under autocast): the packed copy is bfloat16 and serves the
    autocast calls with autocast's result up to bfloat16 rounding; calls without autocast run the module's own."""
    layer = _linear()
    layer.rldyn_compute_dtype = "bfloat16"  # as `models.precision.compute_in` marks a model
    x = torch.randn(2, 5, 576)
    with torch.no_grad(), packed_linears(layer, rows=10) as count:
        assert count == 1 and layer.forward.packed.dtype == torch.bfloat16
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = torch.nn.functional.linear(x, layer.weight, layer.bias)
            got = layer(x)
        assert got.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))  # float32: its own


def test_small_linears_other_dtypes_and_instance_forwards_are_left_alone():
    small = torch.nn.Linear(64, 64)
    half = _linear().to(torch.bfloat16)
    hooked = _linear()

    def own(x):  # a forward set on the instance, as accelerate's hooks do
        return torch.nn.functional.linear(x, hooked.weight, hooked.bias) + 1

    hooked.forward = own
    model = torch.nn.Sequential(small, half, hooked, _linear())
    with packed_linears(model, rows=8) as count:
        assert count == 1  # only the plain float32 one over the size
        assert "forward" not in small.__dict__ and "forward" not in half.__dict__ and hooked.forward is own
        assert isinstance(model[3].forward, PackedLinear)
    assert hooked.forward is own and "forward" not in model[3].__dict__


def test_the_module_is_restored_when_the_body_raises():
    layer = _linear()
    with pytest.raises(RuntimeError, match="env failed"), packed_linears(layer, rows=2):
        raise RuntimeError("env failed")
    assert "forward" not in layer.__dict__


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_rollout_through_packed_weights_records_the_trainers_log_probs(tmp_path, monkeypatch, dtype):
    """A model whose linears are packed (hidden 512): the rollout computes through the packed copies, and its
    log-probs of the sampled tokens are the trainer's (no packing) within 1e-4 in float32 and within bfloat16's
    rounding in bfloat16, over several turns; the weights are untouched."""
    cfg = make_config(overrides=["env.max_turns=3", "env.max_new_tokens=6"])
    path = ensure_tiny_model(lambda: tiny_corpus(cfg.env, num_seeds=10), tmp_path, hidden_size=512, num_layers=2,
                             num_heads=8, num_kv_heads=4, intermediate_size=1024)
    model, tokenizer = load_model_and_tokenizer(str(path))
    model = compute_in(model, dtype)
    with packed_linears(model, rows=4) as count:
        assert count == 2 * 5 + 1  # q, o, gate, up, down of both layers and the head (512 x 512); not k, v
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []
    through = PackedLinear.__call__
    monkeypatch.setattr(PackedLinear, "__call__", lambda self, x: calls.append(x.shape[0]) or through(self, x))
    batch = rollout(model, tokenizer, [3, 4], 2, cfg.env, temperature=1.0, row_seed=7)
    assert calls and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all("forward" not in m.__dict__ for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert int(batch.response_mask.sum()) > 4 * 6  # more than one turn's replies
    old, _ = batch_logprobs(model, batch.input_ids, batch.attention_mask, micro_batch_size=4,
                            positions=batch.response_mask)  # [N, L]
    mask = batch.response_mask.bool()
    assert (batch.rollout_logprobs[mask] - old[mask]).abs().max() < (1e-4 if dtype == "float32" else 5e-2)


def test_a_lora_models_frozen_base_linears_are_packed_under_its_adapters():
    """peft's LoRA layer calls its base linear and adds the adapter's path: packed, the output is the unpacked one
    within float32 rounding, and the adapters (small, trainable) are left alone."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(576, 512), torch.nn.ReLU(), torch.nn.Linear(512, 576))
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"]))
    for name, p in adapted.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # a trained adapter, so that its path counts
    x = torch.randn(3, 7, 576)
    with torch.no_grad():
        want = adapted(x)
        with packed_linears(adapted, rows=3) as count:
            assert count == 2  # the two base layers, not the rank-4 adapters
            got = adapted(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(want, model[2].base_layer(torch.relu(model[0].base_layer(x))))  # the adapters counted
