"""Attention with grouped key/value heads on the CPU, without copying the keys and values per query head.

Models with fewer key/value heads than query heads (grouped-query attention: SmolLM2 has 9 query and 3 key/value
heads, Qwen2 and Llama 3 likewise) attend through transformers' SDPA function, which repeats every key and value
head for its query heads (`repeat_kv`, a copy) whenever an attention mask is given, because some CUDA kernels take
grouped heads only without a mask. Every forward this project runs has a mask (left-padded generation, padded and
packed rows), and PyTorch's CPU kernel takes grouped heads with a mask (`enable_gqa=True`). `GQA_SDPA` is
transformers' SDPA attention that passes the grouped heads to the kernel as they are in that case: the same output
(the kernel reads each key/value head for its query heads instead of a copy), with the key and value gradients
summed over a group inside the kernel rather than by the copy's backward (a last-bit difference, ~1e-7 relative).
On SmolLM2's heads a decode step's attention is about 5x faster, a training micro-batch's forward + backward about
1.3x (`bench/attention.py --gqa`; the figures, CPU and commit: docs/benchmarks.md). The critic's backbone attends
the same way.

Everything else is transformers' own function: no mask (it passes grouped heads itself), another device, a paged
cache or a position bias.
"""

from __future__ import annotations

import torch

GQA_SDPA = "rldyn_sdpa_gqa"  # transformers' SDPA attention, grouped key/value heads unrepeated under a mask on a CPU


def grouped_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                         is_causal=None, **kwargs):
    """transformers' `sdpa_attention_forward` (same arguments: query [B, H, Q, D], key and value [B, KV, K, D],
    attention_mask [B, 1, Q, K] or None; returns ([B, Q, H, D], None)), with `enable_gqa` where it would copy."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    grouped = getattr(module, "num_key_value_groups", 1) > 1
    plain = kwargs.get("position_bias") is None and kwargs.get("cache") is None
    if not (grouped and plain and attention_mask is not None and query.device.type == "cpu"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(  # with a mask transformers passes is_causal=False too
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)  # [B, H, Q, D]
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make `GQA_SDPA` a transformers attention implementation (its masks: SDPA's); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_SDPA, grouped_sdpa_forward)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)


def attend_grouped(model: torch.nn.Module) -> torch.nn.Module:
    """Switch a transformers model with grouped key/value heads that attends with SDPA to `GQA_SDPA` (others are
    left as they are; the saved config keeps the model's own implementation: transformers does not write it)."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    grouped = heads is not None and getattr(config, "num_key_value_heads", None) not in (None, heads)
    sdpa = getattr(config, "_attn_implementation", None) == "sdpa" and hasattr(model, "set_attn_implementation")
    if grouped and sdpa:
        register()
        model.set_attn_implementation(GQA_SDPA)
    return model
