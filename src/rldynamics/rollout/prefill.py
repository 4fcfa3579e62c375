"""Shared-prompt prefill: encode each distinct prompt of a generation batch once and share its KV cache.

The members of a group start from the same prompt, so a batch of G groups x n holds only G distinct prompts
(in the first turn). `shared_prompt_cache` runs the prompt tokens but the last through the model once per
distinct prompt and copies the key/value cache to every row that has that prompt; `generate` then runs only
the last prompt token and the new tokens. Positions and attention follow `generate`'s own rules for a
left-padded batch (position = number of attended tokens before it), so the cache holds what `generate`'s own
prefill would have computed, up to float rounding of the smaller batch.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache


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
    kwargs = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    model(input_ids=input_ids[first, :-1], attention_mask=attn, position_ids=positions, past_key_values=cache,
          use_cache=True, **kwargs)
    cache.batch_select_indices(inverse)
    return cache
