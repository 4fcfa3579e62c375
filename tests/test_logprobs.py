"""`algo.logprobs.selected_logprobs`: the chunked log-prob and entropy node against the eager composition it
replaces (forward bit for bit), finite differences (backward, float64 gradcheck), autograd's own backward of the
composition in float64 (float32 and bfloat16 logits), and forward-mode AD (the attribution's `torch.func.jvp`)."""

from __future__ import annotations

import pytest
import torch

from rldynamics.algo.logprobs import selected_logprobs
from rldynamics.algo.losses import entropy_from_logprobs


def composition(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """The eager form: every float temporary of every row kept for autograd."""
    every = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
    return every.gather(-1, targets[:, None]).squeeze(-1), entropy_from_logprobs(every)


def sample(rows: int = 7, vocab: int = 50, dtype=torch.float32, scale: float = 4.0):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * scale).to(dtype)
    return logits, torch.randint(0, vocab, (rows,), generator=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("elements", [1, 100, 10**6])  # a row per chunk, two rows, all rows
def test_forward_equals_the_composition_bit_for_bit(dtype, temperature, elements):
    logits, targets = sample(dtype=dtype)
    logp, ent = selected_logprobs(logits, targets, temperature, True, elements)
    want_logp, want_ent = composition(logits, targets, temperature)
    assert logp.dtype == torch.float32 and torch.equal(logp, want_logp) and torch.equal(ent, want_ent)
    alone, none = selected_logprobs(logits, targets, temperature, False, elements)
    assert torch.equal(alone, want_logp) and none is None


@pytest.mark.parametrize("with_entropy", [False, True])
def test_backward_passes_gradcheck_in_float64(with_entropy):
    logits, targets = sample(rows=5, vocab=9, dtype=torch.float64, scale=2.0)

    def both(z):
        logp, ent = selected_logprobs(z, targets, 0.7, with_entropy, 2 * 9)
        return (logp, ent) if with_entropy else logp

    assert torch.autograd.gradcheck(both, (logits.requires_grad_(),))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_is_as_close_to_float64_as_the_composition(dtype):
    """Upstream weights on both outputs; the node's gradient is within the composition's own distance from the
    float64 gradient (times 2, plus the logits' rounding to their dtype)."""
    logits, targets = sample(rows=12, vocab=300, dtype=dtype, scale=6.0)
    g, h = torch.linspace(-1, 2, 12, dtype=torch.float64), torch.linspace(0.5, -0.5, 12, dtype=torch.float64)

    def grad_of(fn, z):
        z = z.detach().requires_grad_()
        logp, ent = fn(z)
        ((logp * g.to(logp.dtype)).sum() + (ent * h.to(ent.dtype)).sum()).backward()
        return z.grad.double()

    exact = grad_of(lambda z: composition(z, targets, 0.8), logits.double())
    eager = grad_of(lambda z: composition(z, targets, 0.8), logits)
    ours = grad_of(lambda z: selected_logprobs(z, targets, 0.8, True, 3 * 300), logits)
    floor = torch.finfo(dtype).eps * exact.abs().max()
    assert (ours - exact).abs().max() <= 2 * (eager - exact).abs().max() + floor


def test_forward_mode_equals_the_compositions_jvp():
    logits, targets = sample(rows=6, vocab=40, dtype=torch.float64)
    tangent = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    _, (dlogp, dent) = torch.func.jvp(lambda z: selected_logprobs(z, targets, 0.9, True, 2 * 40), (logits,),
                                      (tangent,))
    _, (want_dlogp, want_dent) = torch.func.jvp(lambda z: composition(z, targets, 0.9), (logits,), (tangent,))
    torch.testing.assert_close(dlogp, want_dlogp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dent, want_dent, rtol=1e-12, atol=1e-12)


def test_no_rows_and_an_unused_entropy_still_backpropagate():
    """No wanted position (an empty [0, V]) stays on the graph; an entropy the loss ignores gets a zero gradient."""
    empty = torch.zeros(0, 10, requires_grad=True)
    logp, ent = selected_logprobs(empty, torch.zeros(0, dtype=torch.long), 1.0, True)
    (logp.sum() + ent.sum()).backward()
    assert empty.grad.shape == (0, 10)
    logits, targets = sample()
    z = logits.clone().requires_grad_()
    logp, _ = selected_logprobs(z, targets, 1.0, True, 50)
    logp.sum().backward()
    want = z.detach().clone().requires_grad_()
    composition(want, targets, 1.0)[0].sum().backward()
    torch.testing.assert_close(z.grad, want.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_backward_without_entropy_weight_is_the_compositions_bit_for_bit(dtype, temperature):
    """With the entropy computed but weighted 0 (`algo.entropy_coef=0`), or not asked for, the gradient is the
    eager composition's to the bit, so such runs train exactly as they did before the node."""
    logits, targets = sample(rows=9, vocab=300, dtype=dtype)
    g = torch.linspace(-1, 2, 9)

    def grad_of(fn):
        z = logits.detach().clone().requires_grad_()
        logp, ent = fn(z)
        ((logp * g).sum() + 0.0 * ent.sum()).backward()
        return z.grad

    want = grad_of(lambda z: composition(z, targets, temperature))
    for with_entropy in (True, False):
        got = grad_of(lambda z, e=with_entropy: (selected_logprobs(z, targets, temperature, True, 2 * 300)
                                                 if e else (selected_logprobs(z, targets, temperature, False,
                                                                              2 * 300)[0], torch.zeros(()))))
        assert torch.equal(got, want)
