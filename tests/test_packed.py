"""Prepacked float32 linears (`models.packed`): outputs equal `F.linear`'s bit for bit on contiguous rows and within
float rounding elsewhere (where `F.linear` itself takes another kernel), the plain product wherever a gradient or
autocast is asked for, and the layers restored after the block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rldynamics.models.packed import packable, packed_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL packs nothing")


def _layers() -> torch.nn.Sequential:
    """SmolLM2's linear shapes: q / o (576 x 576), k / v (192 x 576), gate / up (1536 x 576), down (576 x 1536)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(576, 1536, bias=False), torch.nn.Linear(1536, 576),
                               torch.nn.Linear(576, 192, bias=False), torch.nn.Linear(192, 576))


@pytest.mark.parametrize("shape", [(1, 576), (16, 576), (352, 576), (16, 1, 576), (2, 176, 576)])
def test_packed_outputs_equal_the_plain_product(shape):
    model = _layers()
    x = torch.randn(shape)
    with torch.no_grad():
        plain, packed, h = [], [], x
        for layer in model:
            plain.append(F.linear(h, layer.weight, layer.bias))
            h = plain[-1]
        with packed_linears(model, rows=16):
            assert all("forward" in layer.__dict__ for layer in model)  # packed inside the block
            h = x
            for layer, expected in zip(model, plain, strict=True):
                packed.append(layer(h))
                h = expected  # each layer on the same input as its plain product
            hidden = torch.randn(16, 30, 576)
            last = model[0](hidden[:, -1:, :])  # what HF's logits take: the last position, a strided view
    for layer, a, b in zip(model, packed, plain, strict=True):
        if x.dim() == 2 or layer.bias is None:  # one GEMM on either side: the same sums in the same order
            assert torch.equal(a, b)
        else:  # F.linear adds a bias to [B, T, out] in another order
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # F.linear multiplies a strided [B, 1, in] row by row (another order of the sums): equal within rounding
    torch.testing.assert_close(last, F.linear(hidden[:, -1:, :], model[0].weight), rtol=1e-5, atol=1e-6)
    assert all("forward" not in layer.__dict__ for layer in model)  # restored


def test_gradients_autocast_and_other_weights_take_the_plain_product():
    model = _layers()
    x = torch.randn(4, 576)
    with packed_linears(model, rows=4):
        out = model(x).square().sum()  # gradients on: the plain product, so autograd reaches the weights
        out.backward()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert model(x).dtype == torch.bfloat16  # autocast still casts
    assert all(layer.weight.grad is not None for layer in model)
    assert not packable(torch.nn.Linear(4, 4).to(torch.bfloat16)) and not packable(torch.nn.Conv1d(1, 1, 1))
    assert packable(torch.nn.Linear(4, 4))
