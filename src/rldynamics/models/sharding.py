"""Models over several ranks: FSDP2 sharding or full replicas, passes on gathered weights, full state dicts.

- `wrap(model, shard=True)`: PyTorch FSDP2 (`fully_shard`) on every transformer block (the classes a HF model
  lists in `_no_split_modules`) and on the root, so parameters, gradients and optimizer state are split over the
  ranks. Gradients are summed over ranks, not averaged (`set_gradient_divide_factor(1)`): each rank's loss is
  already weighted by its rows' share of the global batch, so the sum is the gradient of the whole batch.
  `shard=False` keeps a full replica on every rank; `sync_gradients` then all-reduces (sums) the gradients.
- `gathered(*models)`: the no-grad passes (generation, old / reference log-probs, values) run on gathered full
  weights: every rank unshards every block once, runs its own rows with no collective (so ranks may generate
  different numbers of tokens), then reshards. Peak memory: the full weights, as during generation anywhere.
- In one process nothing is wrapped and every function here is the identity or the plain single-process call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from rldynamics.dist import all_true, distributed, on_main

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def wrap(model: torch.nn.Module, shard: bool) -> torch.nn.Module:
    """The model prepared for this process group: FSDP2-sharded (`shard`) or as it is (a replica, or one process)."""
    if not distributed() or not shard:
        return model
    blocks = {name for m in model.modules() for name in (getattr(m, "_no_split_modules", None) or [])}
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module)
    fully_shard(model)
    for module in fsdp_modules(model):
        module.set_gradient_divide_factor(1.0)  # sums: each rank's loss carries its rows' global share
        module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    return model


def fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    """The FSDP2 units of `model` (empty when it is not sharded)."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: torch.nn.Module) -> bool:
    """True when `model` is FSDP2-sharded: every forward and backward is then a collective of all ranks."""
    return isinstance(model, FSDPModule)


@contextmanager
def gathered(*models: torch.nn.Module | None) -> Iterator[None]:
    """Run the block with the full weights of every sharded model on every rank (no collective inside)."""
    units = [u for m in models if m is not None for u in fsdp_modules(m)]
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_reshard_after_forward(True, recurse=False)
            unit.reshard()


def sync_gradients(model: torch.nn.Module) -> None:
    """Replicas: sum every gradient over the ranks (a missing gradient counts as zero). Sharded or one process:
    nothing to do (FSDP2 reduce-scatters in backward)."""
    if not distributed() or is_sharded(model):
        return
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def clip_gradients(params: list[torch.Tensor], max_norm: float, norms: list[torch.Tensor] | None = None) -> float:
    """`clip_grad_norm_` over all ranks' parameters (sharded ones included); returns the global pre-clip norm.

    The gradients are scaled only where the factor `max_norm / (norm + 1e-6)` is below 1: `clip_grad_norm_`
    multiplies them by 1 otherwise, a pass over every gradient that changes no bit. `norms`: each float32
    gradient's norm (parameters without a gradient left out) where the caller has taken them already (unsharded
    parameters only); the total is their norm, as `clip_grad_norm_` takes it, bit for bit, and costs no second pass
    over the gradients."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms is not None else torch.nn.utils.get_total_norm(grads)
    whole = whole_tensor(total)  # a sharded run's DTensor gathered: every rank decides alike
    if bool(max_norm / (whole + 1e-6) < 1.0):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(whole)


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` whole: a DTensor (an FSDP2 shard) gathered from every rank (a collective), any other tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter or gradient (the tensor itself when it is not sharded)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def all_finite(*models: torch.nn.Module | None) -> bool:
    """True when every parameter of the given models (None skipped) is finite, on every rank.

    A NaN or an infinity in a tensor makes its norm non-finite, so finite norms (`torch._foreach_norm`: one read of
    each parameter, no [P] boolean tensor) answer at once; only a non-finite norm, which a sum of squares of finite
    but huge values can also give, is settled entry by entry."""
    params = [local(p).detach() for m in models if m is not None for p in m.parameters()]
    finite = not params or bool(torch.stack(torch._foreach_norm(params)).isfinite().all())
    return all_true(finite or bool(torch.stack([torch.isfinite(p).all() for p in params]).all()))


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """Sharded: the full weights gathered on rank 0 (CPU; an empty dict elsewhere; collective), tied weights (an
    embedding shared with the LM head) one tensor again, as `save_pretrained` expects. Otherwise None: the model's
    own state dict is complete."""
    if not is_sharded(model):
        return None
    state = get_model_state_dict(model, options=_FULL)
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for tied in names.values():
        for name in tied[1:]:
            if tied[0] in state and name in state:
                state[name] = state[tied[0]]
    return state


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer state as one process keys it (indices of the optimizer's parameters, in its order), complete:
    gathered on rank 0 when sharded (collective; empty elsewhere)."""
    if not is_sharded(model):
        return optimizer.state_dict()
    if not optimizer.state:  # before the first step: torch's gathering would take a zero step to make the state
        return optimizer.state_dict() if dist.get_rank() == 0 else {}  # (its step counts then start at 1)
    state = get_optimizer_state_dict(model, optimizer, options=_FULL)
    if not state:
        return {}
    index = {name: i for i, name in enumerate(_optimized_names(model, optimizer))}
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": [{**g, "params": [index[name] for name in g["params"]]} for g in state["param_groups"]]}


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict | None) -> None:
    """Restore a state written by `full_optimizer_state`. Sharded: `state` is read on rank 0 only (None elsewhere)
    and each rank receives its shards (collective)."""
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    groups = on_main(lambda: None if state["state"] else state["param_groups"])
    if groups is not None:  # a state from before the first step: the settings alone (torch's loading would step)
        optimizer.load_state_dict({"state": {}, "param_groups": groups})
        return
    full = {}
    if state is not None:
        names = _optimized_names(model, optimizer)
        full = {"state": {names[i]: value for i, value in state["state"].items()},
                "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, full,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _optimized_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the parameters `optimizer` steps, in the order its state dict numbers them (its groups' order):
    every parameter of a fully trained model, the adapters alone of a LoRA actor (its frozen base has no state)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def grad_spans(model: torch.nn.Module, params: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The coordinates of the flat gradient [P] (`params` flattened and concatenated, in order) that this rank
    holds, as increasing global [start, end) spans in the order of its local vector (`local_flat`).

    One process: everything. Sharded (FSDP2 splits every parameter along dim 0, `torch.chunk`-style): each
    parameter's rows of this rank. Replicas: a contiguous 1/world of the flat vector (`replica_shard`)."""
    total = sum(p.numel() for p in params)
    if not distributed():
        return [(0, total)]
    world, rank = dist.get_world_size(), dist.get_rank()
    if not is_sharded(model):
        chunk = _replica_chunk(total)
        return [(min(rank * chunk, total), min((rank + 1) * chunk, total))]
    spans, offset = [], 0
    for p in params:
        rows, row = p.shape[0], p.numel() // max(p.shape[0], 1)
        chunk = -(-rows // world)
        start, end = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
        if end - start != local(p).shape[0]:
            raise RuntimeError(f"unexpected FSDP2 shard of a parameter of shape {list(p.shape)}: rows "
                               f"{local(p).shape[0]}, expected {end - start}")
        if end > start:
            spans.append((offset + start * row, offset + end * row))
        offset += p.numel()
    return spans


def local_flat_grad(params: list[torch.Tensor]) -> torch.Tensor:
    """This rank's part of the accumulated gradient of sharded `params`, flat float32 in `grad_spans` order. [p]"""
    parts = [local(p.grad).reshape(-1).float() if p.grad is not None else
             torch.zeros(local(p).numel(), device=local(p).device) for p in params]
    return torch.cat(parts) if parts else torch.zeros(0)  # [p]


def replica_shard(flat: torch.Tensor) -> torch.Tensor:
    """Replicas: the sum over ranks of a full flat vector [P], then this rank's `grad_spans` part of it. [p]"""
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    chunk = _replica_chunk(flat.numel())
    return flat[dist.get_rank() * chunk:(dist.get_rank() + 1) * chunk].clone()  # [p]


def _replica_chunk(total: int) -> int:
    """Coordinates of the flat vector [P] each replica keeps (the last rank may keep fewer): ceil(P / world)."""
    return -(-total // dist.get_world_size())
