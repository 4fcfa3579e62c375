"""Per-token log-probs at response positions only: same values and gradients as the full forward."""

from __future__ import annotations

import pytest
import torch

from conftest import micro_model_batch
from rldynamics.algo import logprobs
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
        monkeypatch.setitem(logprobs.CHUNK_ELEMENTS, "cpu", 3 * model.config.vocab_size)
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
        monkeypatch.setitem(logprobs.CHUNK_ELEMENTS, "cpu", 1)  # one token per chunk
        many, _ = token_logprobs(model, ids, attn, positions=mask)
    assert torch.equal(one, many)


class Recording(torch.nn.Module):
    """A causal LM that records the [N, L] shape of every input it is given (`input_ids` or `inputs_embeds`) and
    which of the two it was."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config, self.shapes, self.embedded = model, model.config, [], []

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def forward(self, input_ids=None, attention_mask=None, logits_to_keep=0, past_key_values=None,
                position_ids=None, use_cache=None, inputs_embeds=None):
        given = input_ids if input_ids is not None else inputs_embeds
        self.shapes.append(tuple(given.shape[:2]))
        self.embedded.append(inputs_embeds is not None)
        return self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                          logits_to_keep=logits_to_keep, past_key_values=past_key_values, position_ids=position_ids,
                          use_cache=use_cache)


def _uneven_prefix_batch(vocab: int):
    """Rows of two groups whose prompts differ in length (5 and 9 tokens), responses in two turns, right padding.

    Returns ids [6, 24], attention [6, 24], response mask [6, 24]."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (5,), generator=gen), torch.randint(3, vocab, (9,), generator=gen)]
    ids = torch.zeros(6, 24, dtype=torch.long)
    attn = torch.zeros(6, 24, dtype=torch.long)
    mask = torch.zeros(6, 24)
    for i, (g, turns) in enumerate([(0, [3, 2]), (0, [1]), (0, [4, 4]), (1, [2, 5]), (1, [6]), (1, [1, 1])]):
        row = [prompts[g]]
        flags = [torch.zeros(len(prompts[g]))]
        for k, n in enumerate(turns):
            row.append(torch.randint(3, vocab, (n,), generator=gen))
            flags.append(torch.ones(n))
            if k < len(turns) - 1:  # an observation between the two responses
                row.append(torch.randint(3, vocab, (3,), generator=gen))
                flags.append(torch.zeros(3))
        row, flags = torch.cat(row), torch.cat(flags)
        ids[i, : len(row)], attn[i, : len(row)], mask[i, : len(row)] = row, 1, flags
    return ids, attn, mask


@pytest.mark.parametrize("data", ["rollout", "uneven_prefixes"])
def test_shared_prefix_forward_equals_the_full_forward(setup, data):
    """Each distinct prompt is forwarded once and the rest of each row on its cache: same log-probs, entropies
    and gradients as forwarding every row whole (float rounding apart)."""
    model, ids, attn, mask = setup
    if data == "uneven_prefixes":
        ids, attn, mask = _uneven_prefix_batch(model.config.vocab_size)
    first, labels = forward.prefix_groups(ids, mask)
    assert len(set(labels)) == 2 < len(labels)  # two distinct prompts, shared by the rows of each group
    lp, ent, grads = _loss_and_grads(model, ids, attn, mask)
    recording, lookups = Recording(model), []
    hook = model.get_input_embeddings().register_forward_hook(lambda *_: lookups.append(1))
    try:
        lp_s, ent_s, grads_s = _loss_and_grads(recording, ids, attn, mask, positions=mask)
    finally:
        hook.remove()
    width = int(attn.sum(1).max())
    suffixes = (attn.sum(1) - first).tolist()
    packed = len(forward.pack_segments(suffixes, labels, max(suffixes)))
    if data == "uneven_prefixes":  # suffixes 8, 1, 11 | 10, 6, 5 in rows of 11: [11] [8 1] | [10] [6 5]
        assert packed == 4
    assert recording.shapes == [(2, int(first.max())), (packed, max(suffixes))], width
    assert recording.embedded == [True, True] and len(lookups) == 1  # one embedding lookup for both calls
    torch.testing.assert_close(lp_s, lp * mask, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent_s, ent * mask, rtol=1e-5, atol=1e-6)
    assert (lp_s[mask == 0] == 0).all() and (ent_s[mask == 0] == 0).all()
    for g, g_s in zip(grads, grads_s, strict=True):
        torch.testing.assert_close(g_s, g, rtol=1e-4, atol=1e-6)
    recording.shapes.clear()
    lp_u, _, _ = _loss_and_grads(recording, ids, attn, mask, positions=mask, shared_prefix=False)
    assert recording.shapes == [(len(ids), width)]  # switched off: one forward of whole rows
    torch.testing.assert_close(lp_u, lp_s, rtol=1e-5, atol=1e-6)


def test_rows_without_a_shared_prefix_are_packed_into_one_forward(setup):
    """Rows of distinct prompts, 12, 5 and 6 tokens: the two short ones share a packed row as wide as the longest,
    and log-probs, entropies and gradients equal the full forward's."""
    model = setup[0]
    gen = torch.Generator().manual_seed(5)
    ids = torch.zeros(3, 14, dtype=torch.long)
    attn = torch.zeros(3, 14, dtype=torch.long)
    mask = torch.zeros(3, 14)
    for i, (length, prompt) in enumerate([(12, 4), (5, 2), (6, 3)]):
        ids[i, :length] = torch.randint(3, model.config.vocab_size, (length,), generator=gen)
        attn[i, :length], mask[i, prompt:length] = 1, 1
    assert forward.shared_prefix_split(ids, mask[:, 1:].bool()) is None  # nothing shared
    lp, ent, grads = _loss_and_grads(model, ids, attn, mask)
    recording = Recording(model)
    lp_p, ent_p, grads_p = _loss_and_grads(recording, ids, attn, mask, positions=mask)
    assert recording.shapes == [(2, 12)]  # [12] and [6 5], against 3 x 12 padded
    torch.testing.assert_close(lp_p, lp * mask, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent_p, ent * mask, rtol=1e-5, atol=1e-6)
    for g, g_p in zip(grads, grads_p, strict=True):
        torch.testing.assert_close(g_p, g, rtol=1e-4, atol=1e-6)
    recording.shapes.clear()
    _loss_and_grads(recording, ids, attn, mask, positions=mask, shared_prefix=False)
    assert recording.shapes == [(3, 12)]  # switched off: whole rows, padded


def test_packing_under_eager_attention_equals_the_full_forward(setup):
    """Eager attention adds its mask to the scores: the packed mask reaches it as 0 / float32's minimum."""
    import copy

    model = copy.deepcopy(setup[0])
    model.set_attn_implementation("eager")
    ids, attn, mask = _uneven_prefix_batch(model.config.vocab_size)
    assert forward.packs(model)
    lp, ent, grads = _loss_and_grads(model, ids, attn, mask)
    lp_p, ent_p, grads_p = _loss_and_grads(model, ids, attn, mask, positions=mask)
    torch.testing.assert_close(lp_p, lp * mask, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent_p, ent * mask, rtol=1e-5, atol=1e-6)
    for g, g_p in zip(grads, grads_p, strict=True):
        torch.testing.assert_close(g_p, g, rtol=1e-4, atol=1e-6)


def test_pack_segments_fits_the_longest_first_into_bins_of_one_group():
    # lengths 4 3 2 2 1 of groups 0 0 1 0 1 in bins of 5: the 4 alone (the 1 is another group's), 3 + 2, 2 + 1
    assert forward.pack_segments([4, 3, 2, 2, 1], [0, 0, 1, 0, 1], 5) == [[0], [1, 3], [2, 4]]
    assert forward.pack_segments([2, 2, 2], [0, 0, 0], 4) == [[0, 1], [2]]  # ties keep the rows' order
    assert forward.pack_segments([], [], 3) == []


def test_packed_mask_keeps_each_token_to_its_prefix_and_its_own_row():
    row = torch.tensor([[0, 0, 1, -1]])  # [1, 4] row 0's tokens 2 and 3, row 1's token 2, one padding slot
    token = torch.tensor([[2, 3, 2, 0]])  # [1, 4]
    prefix = torch.tensor([[1, 1, 0]])  # [1, 3] a 2-token prefix padded to 3
    allowed = forward.packed_mask(row, token, prefix)[0, 0].int()  # [4, 3 + 4]
    assert allowed.tolist() == [[1, 1, 0, 1, 0, 0, 0],
                                [1, 1, 0, 1, 1, 0, 0],
                                [1, 1, 0, 0, 0, 1, 0],
                                [0, 0, 0, 0, 0, 0, 1]]  # padding sees only padding
    assert forward.packed_mask(row, token, None)[0, 0].int().tolist() == [r[3:] for r in allowed.tolist()]


def test_a_packed_layout_puts_each_row_after_the_last_in_its_bin():
    row, token, group = forward.packed_layout(torch.tensor([2, 1, 0]), torch.tensor([5, 3, 1]), [0, 0, 1])
    assert row.tolist() == [[0, 0, 0], [1, 1, -1], [2, -1, -1]]
    assert token.tolist() == [[2, 3, 4], [1, 2, 0], [0, 0, 0]] and group.tolist() == [0, 0, 1]
    row, token, group = forward.packed_layout(torch.tensor([0, 0]), torch.tensor([3, 2]), [0, 0], pack=False)
    assert row.tolist() == [[0, 0, 0], [1, 1, -1]] and token.tolist() == [[0, 1, 2], [0, 1, 0]]


@pytest.mark.parametrize("kind", ["sdpa", "eager", "gpt2"])
def test_packed_critic_values_and_gradients_equal_padded_rows(setup, kind):
    """The critic's rows (12, 5 and 6 tokens) packed into two rows as wide as the longest give the values and
    gradients of whole padded rows at every real position, and 0 at padding: under SDPA and eager attention, and on
    a GPT-2 backbone, whose learned absolute positions (unlike rotary ones) make each row's position ids count."""
    import copy

    from transformers import GPT2Config, GPT2Model

    from rldynamics.models.loading import ValueModel

    if kind == "gpt2":
        torch.manual_seed(0)
        backbone = GPT2Model(GPT2Config(vocab_size=setup[0].config.vocab_size, n_positions=32, n_embd=32, n_layer=1,
                                        n_head=2, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
                             ).eval()  # eval: no dropout
    else:
        backbone = copy.deepcopy(setup[0].model)
        backbone.set_attn_implementation(kind)
    critic = ValueModel(backbone, backbone.config.hidden_size)
    torch.nn.init.normal_(critic.head.weight, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(7)
    ids, attn = torch.zeros(3, 14, dtype=torch.long), torch.zeros(3, 14, dtype=torch.long)
    for i, length in enumerate([12, 5, 6]):
        ids[i, :length] = torch.randint(3, backbone.config.vocab_size, (length,), generator=gen)
        attn[i, :length] = 1
    seen = []
    critic.register_forward_pre_hook(lambda _, args, kwargs: seen.append(tuple(kwargs["input_ids"].shape)),
                                     with_kwargs=True)
    real = torch.nn.functional.pad(attn[:, :-1], (1, 0)).bool()  # [3, 14] positions whose prefix is real
    weights = torch.linspace(-1, 2, 14)  # [14]

    def values_and_grads(pack):
        critic.zero_grad(set_to_none=True)
        values = forward.token_values(critic, ids, attn, pack=pack)  # [3, 14]
        (values * weights * real).sum().backward()
        return values.detach(), [p.grad.clone() for p in critic.parameters()]

    assert forward.packs(critic)
    padded, grads = values_and_grads(False)
    packed, grads_p = values_and_grads(True)
    assert seen == [(3, 14), (2, 12)]  # whole rows, then [12] and [6 5]
    assert padded[real].abs().min() > 0 and (packed[~real & (torch.arange(14) > 0)] == 0).all()
    torch.testing.assert_close(packed[real], padded[real], rtol=1e-5, atol=1e-6)
    for g, g_p in zip(grads, grads_p, strict=True):
        torch.testing.assert_close(g_p, g, rtol=1e-4, atol=1e-6)


def test_grouped_heads_attend_as_transformers_repeated_heads_do(setup):
    """`GQA_SDPA` (the kernel reads each key/value head for its query heads) against transformers' SDPA (a copy of
    each head per query head) on the tiny model, whose 4 query heads share 2 key/value heads: the same log-probs
    and entropies bit for bit, the gradients within float32 rounding, and the same greedy continuation from a
    left-padded batch (a mask at every decode step)."""
    import copy

    from rldynamics.models.attention import GQA_SDPA

    model, ids, attn, mask = setup
    assert model.config._attn_implementation == GQA_SDPA and model.config.num_key_value_heads == 2
    repeated = copy.deepcopy(model)
    repeated.set_attn_implementation("sdpa")
    lp, ent, grads = _loss_and_grads(model, ids, attn, mask)
    lp_r, ent_r, grads_r = _loss_and_grads(repeated, ids, attn, mask)
    assert torch.equal(lp, lp_r) and torch.equal(ent, ent_r)
    for g, g_r in zip(grads, grads_r, strict=True):  # an entry near 0 may move by 1e-7: compare whole tensors
        assert (g - g_r).norm() <= 1e-5 * g_r.norm()
    prompts = ids[:4, :7].clone()  # [4, 7]: the last two rows left-padded by two below
    prompt_attn = torch.ones_like(prompts)
    prompts[2:, :2], prompt_attn[2:, :2] = 0, 0
    with torch.no_grad():
        out = [m.generate(input_ids=prompts, attention_mask=prompt_attn, do_sample=False, max_new_tokens=6,
                          pad_token_id=0) for m in (model, repeated)]
    assert torch.equal(out[0], out[1])
    model.zero_grad(set_to_none=True)


def test_logits_at_kept_positions_run_the_head_only_there(setup, monkeypatch):
    """`_logits_at` returns the full forward's logits at the kept positions, row-major. Where transformers takes no
    boolean `logits_to_keep` (before 5.23; forced here) the LM head still runs at the kept positions alone: not at
    every position, nor at every row of the columns some row keeps."""
    model, ids, attn, _ = setup
    n, width = ids.shape
    keep = torch.zeros(n, width, dtype=torch.bool)  # [N, L] rows keeping different columns
    keep[0, 1:3] = True
    keep[1:, 4] = True
    keep[-1, width - 2] = True
    full = model(input_ids=ids, attention_mask=attn).logits[keep]  # [M, V]
    head_rows = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: head_rows.append(args[0].shape[:-1].numel()))
    monkeypatch.setattr(forward, "_takes_mask_keep", lambda m: False)
    try:
        got = forward._logits_at(model, ids, attn, keep)  # [M, V]
        every = forward._logits_at(model, ids, attn, torch.ones_like(keep))  # [N L, V] no column left out
    finally:
        hook.remove()
    assert torch.allclose(got, full, atol=1e-5, rtol=1e-5)
    assert torch.allclose(every, model(input_ids=ids, attention_mask=attn).logits.flatten(0, 1), atol=1e-5, rtol=1e-5)
    assert head_rows == [int(keep.sum()), n * width] and int(keep.sum()) == n + 2


def test_logits_at_kept_positions_keep_what_follows_the_head(monkeypatch):
    """A model that transforms its logits after the head (Gemma 2's soft cap, tanh(z / c) c) gives the same
    logits at the kept positions as its whole forward: the head's input is narrowed, the model's forward runs."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, final_logit_softcapping=0.5,
                          attn_implementation="eager")
    model = Gemma2ForCausalLM(config).eval()
    ids = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(0))  # [3, 7]
    attn = torch.ones_like(ids)
    keep = torch.zeros(3, 7, dtype=torch.bool)  # [3, 7]
    keep[0, 1:3], keep[1:, 4] = True, True
    monkeypatch.setattr(forward, "_takes_mask_keep", lambda m: False)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=attn).logits[keep]  # [4, 50]
        got = forward._logits_at(model, ids, attn, keep)  # [4, 50]
        model.config.final_logit_softcapping = None
        uncapped = model(input_ids=ids, attention_mask=attn).logits[keep]  # [4, 50]
    assert not torch.allclose(uncapped, full, atol=1e-4)  # the cap binds
    assert got.shape == (4, 50) and torch.allclose(got, full, atol=1e-6)
