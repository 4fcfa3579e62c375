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

import contextlib
import functools

import torch
from torch.utils.checkpoint import checkpoint

from rldynamics.models.attention import GQA_SDPA, grouped_sdpa_forward
from rldynamics.models.lora import underlying
from rldynamics.models.sharding import is_sharded

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class BoundWrapper:
    """A module's bound method wrapped in an object rather than a closure, so that a deep copy of the module (the
    lagged sampler of `train/lagged.py`) calls the copy's own method: `copy.deepcopy` rebinds a bound method held
    in an object's attributes to the copied module, but shares a closure's captured method with the original."""

    def __init__(self, method):
        functools.update_wrapper(self, method)  # its signature, for callers that inspect `forward`

    def __call__(self, *args, **kwargs):
        return self.__wrapped__(*args, **kwargs)


class InAutocast(BoundWrapper):
    """`method` called under autocast to `dtype` on `device`."""

    def __init__(self, method, device: str, dtype: torch.dtype):
        super().__init__(method)
        self.device, self.dtype = device, dtype

    def __call__(self, *args, **kwargs):
        with torch.autocast(device_type=self.device, dtype=self.dtype):
            return self.__wrapped__(*args, **kwargs)


def compute_dtype(model: torch.nn.Module) -> str:
    """The dtype `compute_in` set `model` to compute in (a key of `COMPUTE_DTYPES`); float32 when none was set."""
    return getattr(model, "rldyn_compute_dtype", "float32")


def compute_in(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """Run every call of `model` under autocast in `dtype` (float32: unchanged). Parameters stay as they are."""
    if dtype == "float32":
        return model
    device = next(model.parameters()).device.type
    if device == "cpu" and dtype == "bfloat16":
        attend_in_float32(model)
    model.forward = InAutocast(model.forward, device, COMPUTE_DTYPES[dtype])
    if hasattr(model, "generate"):  # one autocast around all decode steps: each weight is cast once per generate
        model.generate = InAutocast(model.generate, device, COMPUTE_DTYPES[dtype])
    model.rldyn_compute_dtype = dtype
    return model


FLOAT32_SDPA = "rldyn_sdpa_float32"  # `attention.GQA_SDPA` with its inputs in float32 (`attend_in_float32`)


def attend_in_float32(model: torch.nn.Module) -> None:
    """Make a model that attends with transformers' SDPA compute its attention in float32 (bfloat16 elsewhere).

    On a CPU, PyTorch's fused attention kernel is slower in bfloat16 than in float32 at a training step's shapes
    (SmolLM2's heads, forward and backward, on an Intel Xeon Sapphire Rapids: 3.3x at 8 rows x 60 positions, 1.7x
    at 8 x 150, equal at 2 x 600; `bench/attention.py`), so the bfloat16 model attends in float32 (q, k and v cast
    up, the output back down), with a gradient as far from float32's as bfloat16 attention's (`bench/attention.py
    --gradient-error`). The keys and values kept for generation stay bfloat16. Other attention implementations are
    left as they are; the saved config keeps the model's own (transformers does not write the attention
    implementation)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def attention(module, query, key, value, attention_mask, **kwargs):
        with torch.autocast(query.device.type, enabled=False):
            out, weights = grouped_sdpa_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                                **kwargs)
        return out.to(query.dtype), weights

    AttentionInterface.register(FLOAT32_SDPA, attention)
    AttentionMaskInterface.register(FLOAT32_SDPA, sdpa_mask)
    base = underlying(model)  # a peft model: its transformers model
    if getattr(getattr(base, "config", None), "_attn_implementation", None) in ("sdpa", GQA_SDPA):
        base.set_attn_implementation(FLOAT32_SDPA)


def weights_cast_once(model: torch.nn.Module):
    """A context over several calls of `model` (the micro-batches of one optimizer step) in which each trained
    float32 weight is cast to the compute dtype once, not at every call.

    Autocast keeps the casts of leaf tensors that require gradients until its outermost context exits. This context
    is such an outer one, with autocast itself off (what runs between the calls, such as the loss, computes as
    before); the context `compute_in` puts around each call is an inner one, so the casts made by the first call
    are reused by the rest. Gradients flow through a shared cast into the float32 weights as through one cast per
    call (the contributions of one backward pass are summed in the compute dtype before they reach the float32
    gradient). The weights must not change inside the context (leave it before an optimizer step), and every call
    inside runs in one grad mode: a cast made under `torch.no_grad` carries no gradient to a later call that needs
    one. It holds one copy of the trained weights in the compute dtype until it exits. Float32 models and
    FSDP2-sharded ones (whose unsharded weights are gathered and freed at every call) get a context that does
    nothing."""
    dtype = compute_dtype(model)
    if dtype == "float32" or is_sharded(model):
        return contextlib.nullcontext()
    return torch.autocast(device_type=next(model.parameters()).device.type, dtype=COMPUTE_DTYPES[dtype],
                          enabled=False)


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
        layer.forward = _Checkpointed(layer.forward)
    model.rldyn_checkpointing = True
    return model


def checkpointing(model: torch.nn.Module) -> bool:
    """Whether a gradient pass through `model` checkpoints its blocks (then it takes no key/value cache)."""
    return torch.is_grad_enabled() and getattr(_unwrapped(model), "rldyn_checkpointing", False)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


class _Checkpointed(BoundWrapper):
    """`forward` of one block, recomputed in backward when gradients are on and it holds no cached positions."""

    def __call__(self, *args, **kwargs):
        forward = self.__wrapped__
        name = "cache" if "cache" in kwargs else "past_key_values"  # transformers 5.24 renamed the keyword
        cache = kwargs.get(name)
        if not torch.is_grad_enabled() or (cache is not None and cache.get_seq_length() > 0):
            return forward(*args, **kwargs)
        kwargs[name] = None  # an empty cache made by the model's forward: nothing to read, nothing kept
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        return checkpoint(functools.partial(forward, **kwargs), *args, use_reentrant=False)
