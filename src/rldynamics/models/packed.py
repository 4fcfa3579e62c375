"""Linear layers with prepacked weights for the no-grad float32 forwards of generation on a CPU.

A float32 `F.linear` on a CPU is one MKL SGEMM call, which copies ("packs") the whole weight into the kernel's
blocked layout on every call. A training forward amortises that over thousands of rows; a decode step has one row
per sequence (16 in a SmolLM2 group batch), so the copy costs about as much as the product itself. MKL packs a weight
once (`torch.ops.mkl._mkl_reorder_linear_weight`, what torch.compile's CPU freezing uses for float32 linears) and
multiplies against the packed copy (`torch.ops.mkl._mkl_linear`): the same GEMM kernel, so on contiguous rows the
same sums in the same order and outputs equal to `F.linear`'s bit for bit. Where `F.linear` itself takes another
path (a strided [B, 1, in] view such as HF's last-position logits, multiplied row by row; a bias added to a 3-D
output) the two differ by float rounding (`tests/test_packed.py`), which can move a sampled token only where two
tokens' cumulative probabilities meet within it (a seeded SmolLM2 generation samples the same tokens:
`tests/test_real_model.py`). Measured on SmolLM2's shapes at 16 rows, one thread: 1.4-1.6x faster per call.

`packed_linears(model, rows)` packs every plain float32 `nn.Linear` of a CPU model for the duration of a `with`
block (one generation call: the weights do not change inside it) and restores the layers after. A packed layer runs
its packed product only where nothing else is asked of it: no gradient, no autocast, a float32 input; otherwise it
is the plain `F.linear`. Weights that are not plain CPU float32 tensors (bfloat16, FSDP2 shards, a GPU) are left as
they are, and so is everything where torch has no MKL.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F


def packable(module: torch.nn.Module) -> bool:
    """Whether `module` is an `nn.Linear` whose weight MKL can pack: a plain float32 CPU tensor."""
    weight = getattr(module, "weight", None)
    return (isinstance(module, torch.nn.Linear) and type(weight) is torch.nn.Parameter
            and weight.dtype == torch.float32 and weight.device.type == "cpu")


@contextmanager
def packed_linears(model: torch.nn.Module, rows: int):
    """Within the block, the float32 linears of `model` multiply against weights packed once for `rows` rows (a
    hint to MKL's blocking; any row count gives the same outputs)."""
    layers = [m for m in model.modules() if packable(m)] if torch.backends.mkl.is_available() else []
    for layer in layers:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(layer.weight.detach(), max(rows, 1))
        layer.forward = _packed_forward(layer, packed, max(rows, 1))  # an instance attribute shadows the class's
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def _packed_forward(layer: torch.nn.Linear, packed: torch.Tensor, rows: int):
    def forward(x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or x.dtype != torch.float32:
            return F.linear(x, layer.weight, layer.bias)
        return torch.ops.mkl._mkl_linear(x, packed, layer.weight, layer.bias, rows)
    return forward
