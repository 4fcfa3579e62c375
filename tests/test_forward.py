"""Per-token log-probs at response positions only: same values and gradients as the full forward."""

from __future__ import annotations

import pytest
import torch

from conftest import micro_model_batch
from rldynamics.models import forward
from rldynamics.models.forward import token_logprobs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model, tokenizer, batch = micro_model_batch(tmp_path_factory.mktemp("cache"), 2)  # two turns: scattered responses
    pad = torch.zeros(len(batch), 3, dtype=torch.long)  # [N, 3] trailing padding every row shares
    ids = torch.cat([batch.input_ids, pad + tokenizer.pad_token_id], 1)  # [N, L+3]
    attn = torch.cat([batch.attention_mask, pad], 1)  # [N, L+3]
    mask = torch.cat([batch.response_mask, pad.float()], 1)  # [N, L+3]
    return model, ids, attn, mask


class NoLogitsToKeep(torch.nn.Module):
    """A causal LM whose forward takes only ids and mask (as some remote-code models do)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask)


def _loss_and_grads(model, ids, attn, mask, **kw):
    model.zero_grad(set_to_none=True)
    lp, ent = token_logprobs(model, ids, attn, temperature=0.7, with_entropy=True, **kw)  # [N, L]
    weights = torch.linspace(-1, 2, ids.shape[1])  # [L]
    ((lp * weights * mask).sum() + (ent * mask).sum()).backward()
    return lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("variant", ["logits_to_keep", "chunked", "no_logits_to_keep"])
def test_response_positions_only_equal_the_full_forward(setup, variant, monkeypatch):
    model, ids, attn, mask = setup
    lp, ent, grads = _loss_and_grads(model, ids, attn, mask)
    if variant == "chunked":  # 3 tokens per chunk, recomputed in backward
        monkeypatch.setattr(forward, "CHUNK_ELEMENTS", 3 * model.config.vocab_size)
    other = NoLogitsToKeep(model) if variant == "no_logits_to_keep" else model
    lp_s, ent_s, grads_s = _loss_and_grads(other, ids, attn, mask, positions=mask)
    assert lp_s.shape == lp.shape and mask.sum() > 10
    torch.testing.assert_close(lp_s, lp * mask, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent_s, ent * mask, rtol=1e-5, atol=1e-6)
    assert (lp_s[mask == 0] == 0).all() and (ent_s[mask == 0] == 0).all()
    for g, g_s in zip(grads, grads_s, strict=True):
        torch.testing.assert_close(g_s, g, rtol=1e-5, atol=1e-6)


def test_chunked_log_softmax_matches_one_chunk(setup, monkeypatch):
    model, ids, attn, mask = setup
    with torch.no_grad():
        one, _ = token_logprobs(model, ids, attn, positions=mask)
        monkeypatch.setattr(forward, "CHUNK_ELEMENTS", 1)  # one token per chunk
        many, _ = token_logprobs(model, ids, attn, positions=mask)
    assert torch.equal(one, many)
