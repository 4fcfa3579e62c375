"""Mixed precision and activation checkpointing for the models a run trains.

Mixed precision (`model.dtype=bfloat16`), as verl and every large-scale trainer do it: the trained weights, their
gradients and the AdamW state stay float32, and forward and backward run in bfloat16. An Adam step of ~1e-6 is
below bfloat16's resolution for weights of ~1e-2 (8 bits of mantissa: a relative step under 2^-9 rounds away), so
stepping bfloat16 weights directly loses almost every update; float32 master weights keep them all.
Which dtype a run computes in (`model.dtype=auto`) is `models.hardware`'s rule.
`compute_in(model, dtype)` makes every call of `model` run under `torch.autocast` in `dtype`: generation, log-prob
passes, the update's forward (its backward follows the forward's dtypes) and the gradient analysis, because they all
call the model. The frozen reference model gets the same treatment, so at step 0 its log-probs equal the actor's
exactly (no precision gap reads as KL).

Activation checkpointing (`model.gradient_checkpointing=true`): every transformer block keeps only its input in
the forward and recomputes its activations in backward (`torch.utils.checkpoint`, non-reentrant), trading one extra
forward for memory. Only calls with gradients are checkpointed; generation and no-grad passes run as before. A block
that writes a key/value cache cannot be recomputed (the recompute would append its keys twice), so a checkpointed
call runs with no cache: the shared-prefix forward (which extends a prefix's cache) is not used for gradient passes
while checkpointing is on (`checkpointing`), and a block given a non-empty cache runs without checkpointing.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def compute_in(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """Run every call of `model` under autocast in `dtype` (float32: unchanged). Parameters stay as they are."""
    if dtype == "float32":
        return model
    device = next(model.parameters()).device.type
    model.forward = torch.autocast(device_type=device, dtype=COMPUTE_DTYPES[dtype])(model.forward)
    if hasattr(model, "generate"):  # one autocast around all decode steps: each weight is cast once per generate
        model.generate = torch.autocast(device_type=device, dtype=COMPUTE_DTYPES[dtype])(model.generate)
    model.rldyn_compute_dtype = dtype
    return model


def float32_region(model: torch.nn.Module):
    """A context in which autocast is off (e.g. a float32 value head inside an autocast forward)."""
    device = next(model.parameters()).device.type
    return torch.autocast(device_type=device, enabled=False)


def enable_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    """Checkpoint every transformer block of `model` (the classes it lists in `_no_split_modules`) in gradient passes.

    Raises ValueError when the model names no block class (nothing would be checkpointed)."""
    blocks = {name for m in model.modules() for name in (getattr(m, "_no_split_modules", None) or [])}
    layers = [m for m in model.modules() if type(m).__name__ in blocks]
    if not layers:
        raise ValueError(f"model.gradient_checkpointing=true: {type(model).__name__} lists no transformer block class "
                         "(_no_split_modules), so there is nothing to checkpoint; set model.gradient_checkpointing=false")
    for layer in layers:
        layer.forward = _checkpointed(layer.forward)
    model.rldyn_checkpointing = True
    return model


def checkpointing(model: torch.nn.Module) -> bool:
    """Whether a gradient pass through `model` checkpoints its blocks (then it takes no key/value cache)."""
    return torch.is_grad_enabled() and getattr(_unwrapped(model), "rldyn_checkpointing", False)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


def _checkpointed(forward):
    """`forward` of one block, recomputed in backward when gradients are on and it holds no cached positions."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        name = "cache" if "cache" in kwargs else "past_key_values"  # transformers 5.24 renamed the keyword
        cache = kwargs.get(name)
        if not torch.is_grad_enabled() or (cache is not None and cache.get_seq_length() > 0):
            return forward(*args, **kwargs)
        kwargs[name] = None  # an empty cache made by the model's forward: nothing to read, nothing kept
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        return checkpoint(functools.partial(forward, **kwargs), *args, use_reentrant=False)

    return run
