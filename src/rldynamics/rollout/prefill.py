"""Shared-prompt prefill: encode each distinct prompt of a generation batch once and share its KV cache.

The members of a group start from the same prompt, so a batch of G groups x n holds only G distinct prompts
(in the first turn). `shared_prompt_cache` runs the prompt tokens but the last through the model once per
distinct prompt and copies the key/value cache to every row that has that prompt; `generate` then runs only
the last prompt token and the new tokens. Positions and attention follow `generate`'s own rules for a
left-padded batch (position = number of attended tokens before it), so the cache holds what `generate`'s own
prefill would have computed, up to float rounding of the smaller batch.

`with_room` makes a cache's layers write each decode step's keys and values into spare room (`RoomyLayer`) instead
of concatenating the whole cache anew at every step.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rldynamics.models.forward import caches_plainly, with_cache
from rldynamics.models.lora import underlying


@torch.no_grad()
def shared_prompt_cache(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> DynamicCache | None:
    """The KV cache of `input_ids[:, :-1]` [B, W-1] computed once per distinct row; None when all rows differ.

    Args:
        input_ids: [B, W] left-padded prompts.
        attention_mask: [B, W].
    """
    distinct, inverse = torch.unique(input_ids, dim=0, return_inverse=True)  # [U, W], [B]
    if distinct.shape[0] == input_ids.shape[0] or input_ids.shape[1] < 2:
        return None
    rows = torch.arange(len(inverse), device=input_ids.device)  # [B]
    first = torch.zeros(len(distinct), dtype=torch.long, device=input_ids.device).scatter_(0, inverse, rows)  # [U]
    attn = attention_mask[first, :-1]  # [U, W-1]
    positions = (attn.long().cumsum(-1) - 1).masked_fill(attn == 0, 0)  # [U, W-1] as generate numbers them
    cache = DynamicCache(config=model.config)
    takes_keep = "logits_to_keep" in inspect.signature(underlying(model).forward).parameters  # not the peft wrapper's
    kwargs = {"logits_to_keep": 1} if takes_keep else {}
    model(input_ids=input_ids[first, :-1], attention_mask=attn, position_ids=positions, **with_cache(model, cache),
          use_cache=True, **kwargs)
    cache.batch_select_indices(inverse)
    return cache


class TurnCaches:
    """Each trajectory's key/value cache from its earlier turns, so a later turn forwards only its new tokens.

    After a turn's `generate`, `keep` stores, per trajectory, the cache entries of its prompt and response (all
    but the last sampled token, which generate never forwards) with the ids they encode. Before the next turn,
    `batch_cache` lays them out left-padded under that turn's prompts: positions follow `generate`'s rules for a
    left-padded batch (a token's position is the number of tokens before it in its own row), so a token's cached
    keys and values do not depend on the padding around it. The cache covers the first C columns of the padded
    batch, C being the most that every row has cached (generate starts from one common cache length); a row whose
    prompt does not start with its cached ids (or that has none) recomputes its tokens. Models whose cache drops
    positions (sliding windows) keep nothing and prefill every turn in full.
    """

    def __init__(self, model):
        self.enabled = caches_plainly(model)
        self.config = model.config
        self.rows: dict[int, tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]] = {}  # key -> (ids, [(k, v)])

    def batch_cache(self, keys: list[int], prompts: list[list[int]]) -> DynamicCache | None:
        """A DynamicCache for the left-padded batch of `prompts` (one per trajectory in `keys`), or None."""
        width = max(len(p) for p in prompts)
        cached = [self._reusable(k, p) for k, p in zip(keys, prompts, strict=True)]
        common = min(min(width - len(p) + n for p, n in zip(prompts, cached, strict=True)), width - 1)  # C
        if common <= 0:  # generate needs at least one uncached token to predict from
            return None
        like = self.rows[keys[cached.index(max(cached))]][1]  # one row's [(k [H, n, D], v)] per layer
        layers = []
        for layer, (ref, _) in enumerate(like):
            pairs = [self._row_layer(k, layer, width - len(p), common, ref) for k, p in zip(keys, prompts, strict=True)]
            layers.append((torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])))  # [B, H, C, D]
        return DynamicCache(layers, config=self.config)

    def keep(self, cache: DynamicCache, keys: list[int], prompts: list[list[int]], responses: list[list[int]]) -> None:
        """Store each row's entries of the cache `generate` filled for the left-padded `prompts`."""
        if not self.enabled:
            return
        width = max(len(p) for p in prompts)
        for row, (key, prompt, response) in enumerate(zip(keys, prompts, responses, strict=True)):
            start, end = width - len(prompt), width + len(response) - 1  # the row's forwarded tokens
            self.rows[key] = (prompt + response[:-1], [(layer.keys[row, :, start:end], layer.values[row, :, start:end])
                                                       for layer in cache.layers])

    def drop(self, key: int) -> None:
        """Forget a finished trajectory's cache."""
        self.rows.pop(key, None)

    def _reusable(self, key: int, prompt: list[int]) -> int:
        """How many leading tokens of `prompt` the cache of `key` holds (0 when it holds other ids)."""
        ids = self.rows.get(key, ([], []))[0]
        return len(ids) if 0 < len(ids) < len(prompt) and prompt[: len(ids)] == ids else 0

    def _row_layer(self, key: int, layer: int, pad: int, common: int,
                   like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A row's keys and values for `layer` over the first `common` padded columns: zeros under its `pad`
        columns of left padding, then its first `common - pad` cached tokens. ([H, C, D], [H, C, D])"""
        real = max(common - pad, 0)
        zeros = like.new_zeros(like.shape[0], common - real, like.shape[2])  # [H, C - real, D]
        if real == 0:
            return zeros, zeros
        k, v = self.rows[key][1][layer]  # [H, n, D]
        return torch.cat([zeros, k[:, :real]], 1), torch.cat([zeros, v[:, :real]], 1)


class RoomyLayer(DynamicLayer):
    """A DynamicLayer whose keys and values live in a buffer with room for `room` more positions: an update copies
    only the new positions, where DynamicLayer's `torch.cat` copies the whole cache at every decode step (about a
    tenth of SmolLM2's generation time on a CPU). `keys` / `values` are views of the buffer's first positions, with
    the values DynamicLayer would hold, so generation gives the same tokens bit for bit (`tests/test_prefill.py`).
    An operation that replaces them (`batch_select_indices`, `batch_repeat_interleave`) leaves tensors that are not
    views of the buffer; the next update copies them into a new one."""

    room = 32
    key_buffer: torch.Tensor | None = None  # [B, H, capacity, D]; None until the first update
    value_buffer: torch.Tensor | None = None

    @classmethod
    def of(cls, layer: DynamicLayer, room: int) -> RoomyLayer:
        """The same layer state (initialised or not), updated with room for `room` positions ahead."""
        roomy = cls()
        roomy.__dict__.update(layer.__dict__)
        roomy.room = room
        return roomy

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.get_seq_length()
        self.keys, self.key_buffer = _appended(self.keys, self.key_buffer, key_states, n, self.room)
        self.values, self.value_buffer = _appended(self.values, self.value_buffer, value_states, n, self.room)
        return self.keys, self.values


def _appended(cached: torch.Tensor, buffer: torch.Tensor | None, new: torch.Tensor, n: int, room: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(`cached` [B, H, n, D] followed by `new` [B, H, m, D] as a view [B, H, n + m, D] of a buffer, that buffer):
    `buffer` itself when `cached` is its first n positions and m more fit, else a new one with `room` to spare."""
    b, h, m, d = new.shape
    fits = (buffer is not None and buffer.shape[:2] == (b, h) and buffer.dtype == new.dtype
            and n + m <= buffer.shape[2] and (n == 0 or (cached.data_ptr() == buffer.data_ptr()
                                                          and cached.stride() == buffer.stride())))
    if not fits:
        buffer = new.new_empty(b, h, n + m + room, d)  # [B, H, n + m + room, D]
        if n:
            buffer[:, :, :n].copy_(cached)
    buffer[:, :, n:n + m].copy_(new)
    return buffer[:, :, :n + m], buffer


def with_room(cache: DynamicCache, room: int) -> DynamicCache:
    """`cache` with each plain DynamicLayer made a `RoomyLayer` with room for `room` positions (in place)."""
    cache.layers = [RoomyLayer.of(layer, room) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
