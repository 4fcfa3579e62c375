"""Generation's linear layers through oneDNN with each weight packed once per rollout (CPU, float32 or bfloat16).

A decode step multiplies a few rows (one per active trajectory) by every weight of the model. PyTorch runs a
float32 `F.linear` on the CPU through MKL's GEMM, which at 16 rows reaches a fraction of the machine's rate (on an
AMD EPYC Zen 4 SmolLM2's 1536 x 576 MLP weights ran at about 4 GB/s of weights, where the memory gives 24): MKL
takes its AVX2 code on AMD CPUs, and a GEMM that short spends its time repacking the weight. oneDNN's inner
product (`torch.ops.mkldnn._linear_pointwise`, what `torch.compile` freezing uses for linears on a CPU) on a
weight reordered once into its own blocked layout (`torch.ops.mkldnn._reorder_linear_weight`) runs the same
products 1.2-1.7x faster at 16 to 368 rows; the figures, CPU and command are in docs/benchmarks.md.

`packed_linears(model, rows)` packs each float32 `nn.Linear` weight of at least `MIN_ELEMENTS` entries on the CPU
(smaller ones lose to oneDNN's fixed cost per call) in the model's compute dtype, and routes the module's calls
through the packed copy until the context exits. A bfloat16 run's autocast casts each weight once per `generate`;
its packed copy is cast once per rollout. The rollout loop holds the context for one rollout, during which the
weights do not change (an HF engine's rollout generates with the trainer's model between updates, or with the lagged
sampler's own copy). A call that needs what a packed copy cannot give (gradients, autocast to another dtype, an
input of another dtype or device) runs the module's own forward, and a module with a forward set on the instance
(accelerate's hooks) is left alone. The results equal `F.linear`'s up to the rounding of their dtype (another order
of summation: ~1e-6 relative in float32); the log-probs a rollout records are those of the logits it sampled from,
so the trainer's mismatch metrics see the difference as what it is. The packed copies hold one more copy of those
weights while the rollout runs (SmolLM2-135M: 0.5 GB in float32, 0.25 GB in bfloat16).
"""

from __future__ import annotations

import contextlib

import torch

from rldynamics.models.precision import COMPUTE_DTYPES, compute_dtype

MIN_ELEMENTS = 1 << 18  # a weight this large or larger is packed (512 x 512); below it F.linear is as fast


def available() -> bool:
    """Whether this PyTorch build has oneDNN's packed linear."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packable(module: torch.nn.Module) -> bool:
    """A plain float32 `nn.Linear` on the CPU, large enough to gain from packing, whose forward is its class's (a
    forward set on the instance, as accelerate's hooks do, may do more than the product: left alone)."""
    weight = getattr(module, "weight", None)
    return (isinstance(module, torch.nn.Linear) and "forward" not in module.__dict__
            and type(weight) is torch.nn.Parameter and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.numel() >= MIN_ELEMENTS)


class PackedLinear:
    """The forward of a `nn.Linear` through a copy of its weight packed in `dtype`, as the module's instance
    `forward`: float32 with autocast off, or bfloat16 under the CPU's bfloat16 autocast (the input, weight and bias
    cast as autocast would, the output bfloat16)."""

    def __init__(self, module: torch.nn.Linear, rows: int, dtype: torch.dtype, own_forward):
        self.own_forward, self.dtype = own_forward, dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach().to(dtype), rows)
        self.bias = None if module.bias is None else module.bias.detach().to(dtype)

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # [..., in] -> [..., out]
        if args or kwargs or not self.serves(x):  # more than `F.linear` takes (peft passes through what it gets)
            return self.own_forward(x, *args, **kwargs)
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, self.bias, "none", [], "")

    def serves(self, x: torch.Tensor) -> bool:
        """Whether the packed copy computes what the module would for `x`: no gradients, on the CPU, and in the
        packed dtype (autocast's, or float32 with autocast off)."""
        if torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype not in (torch.float32, self.dtype):
            return False
        if torch.is_autocast_enabled("cpu"):
            return torch.get_autocast_dtype("cpu") == self.dtype
        return self.dtype == torch.float32 == x.dtype


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module, rows: int):
    """Route the packable linears of `model` through weights packed for about `rows` rows (a hint for oneDNN's
    layout) in the model's compute dtype (`models.precision.compute_in`) until exit; yields how many were packed.
    Nothing changes where oneDNN's packed linear is missing."""
    dtype = COMPUTE_DTYPES[compute_dtype(model)]
    modules = [m for m in model.modules() if packable(m)] if available() else []
    packed = []
    try:
        for module in modules:
            module.forward = PackedLinear(module, max(rows, 1), dtype, module.forward)
            packed.append(module)
        yield len(modules)
    finally:
        for module in packed:
            del module.forward  # the class's forward again
