"""Several processes under `torchrun`: the process group, this process's rank, and the few collectives we use.

`torchrun --nproc-per-node W -m rldynamics.cli train ...` starts W processes with `RANK`, `WORLD_SIZE` and
`LOCAL_RANK` set; `init_from_env` joins them into one process group (NCCL on GPUs, each rank on `cuda:LOCAL_RANK`;
gloo on CPU). In one process (no torchrun, or W = 1) every function here answers for a world of one and runs no
collective, so single-process code paths are untouched.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

TIMEOUT = timedelta(minutes=30)  # a collective waiting longer than this for a peer fails instead of hanging


def init_from_env() -> None:
    """Join the process group described by torchrun's environment (`WORLD_SIZE` > 1); otherwise do nothing."""
    if distributed() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    # Imported once a group exists, FSDP keeps a reference to it that outlives `destroy_process_group`: the group's
    # threads then run into interpreter shutdown, and a rank that exits right after a collective (an error raised on
    # every rank) aborts ("terminate called without an active exception") instead of exiting with its code.
    import torch.distributed.fsdp  # noqa: F401

    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())
        dist.init_process_group("nccl", timeout=TIMEOUT)
    else:
        dist.init_process_group("gloo", timeout=TIMEOUT)


_before_leaving: list[Callable[[], None]] = []


def before_leaving(close: Callable[[], None]) -> None:
    """Have `close` called when this process leaves the process group (`close` below), after the ranks waited for
    each other and before the group is destroyed. The colocated vLLM engine needs it: its shutdown tears down the
    groups it made in ours, the world group included."""
    _before_leaving.append(close)


def close(finished: bool = False) -> None:
    """Leave the process group (if joined). After a job every rank finished, the ranks first wait for each other, so
    that no rank tears its group down while a peer's communication threads still serve it (gloo then aborts the peer
    at exit: "terminate called without an active exception"); after an error the rank leaves at once. What was
    registered with `before_leaving` runs in between, in one process too."""
    ours = distributed()
    if ours and finished:
        dist.barrier()
    while _before_leaving:
        _before_leaving.pop()()
    if ours and dist.is_initialized():  # a vLLM engine's shutdown may have destroyed it already
        dist.destroy_process_group()


def barrier() -> None:
    """Every rank waits here until all have come (nothing in one process)."""
    if distributed():
        dist.barrier()


def distributed() -> bool:
    """True when running under an initialised ``torch.distributed`` process group of several ranks (the colocated
    vLLM engine makes a group of one of its own, which is not a multi-rank run and is not ours to destroy)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world() -> int:
    """Number of ranks (1 in one process)."""
    return dist.get_world_size() if distributed() else 1


def rank() -> int:
    """This process's rank (0 in one process)."""
    return dist.get_rank() if distributed() else 0


def local_rank() -> int:
    """This process's rank on its machine (`LOCAL_RANK`; 0 in one process): its GPU index."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    """True on rank 0, the one rank that writes the run directory and the console."""
    return rank() == 0


def collective_device() -> torch.device:
    """The device tensors must live on for collectives of the default backend."""
    if distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_sum(values: list[float]) -> list[float]:
    """Element-wise sum of ``values`` over ranks, in float64 (identity in one process)."""
    if not distributed():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=collective_device())  # [K]
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def sum_tensors(*tensors: torch.Tensor) -> None:
    """Each tensor summed element-wise over ranks, in place (nothing in one process). For tensors whose rows each
    rank filled for its own rows alone, zeros elsewhere: the sum is the whole, exactly."""
    if not distributed():
        return
    for t in tensors:
        on = t.to(collective_device())
        dist.all_reduce(on, op=dist.ReduceOp.SUM)
        t.copy_(on)


def all_true(flag: bool) -> bool:
    """True when ``flag`` is true on every rank."""
    if not distributed():
        return flag
    t = torch.tensor([float(flag)], device=collective_device())  # [1]
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def gather(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order, on every rank (picklable objects; ``[obj]`` in one process)."""
    if not distributed():
        return [obj]
    out: list[Any] = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def on_main(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` run on rank 0 only; every rank returns its result, or raises the error it raised.

    For the checks and decisions one process must make (the run directory, a checkpoint's files, building a
    cached model) with the outcome, success or a one-line error, the same on every rank.
    """
    if not distributed():
        return fn(*args, **kwargs)
    box: list[Any] = [None]
    if is_main():
        try:
            box[0] = (True, fn(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 (handed to every rank, raised there)
            box[0] = (False, e)
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def main_checked(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` run on rank 0 only, its result kept there (None on the other ranks); an error it raises is
    raised on every rank. For what only rank 0 needs but every rank must know failed (a file to read and check)."""
    if not distributed():
        return fn(*args)
    value, box = None, [None]
    if is_main():
        try:
            value = fn(*args)
        except Exception as e:  # noqa: BLE001 (handed to every rank, raised there)
            box[0] = e
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise box[0]
    return value


def rank_seed(seed: int) -> int:
    """The global-RNG seed of this rank for a stream seeded with ``seed`` (``seed`` itself on rank 0)."""
    return (seed + rank() * 1_000_000_007) % (2**63 - 1)


def rank_block(n: int, r: int | None = None) -> slice:
    """The contiguous block of `n` ordered rows that rank `r` (default: this rank) takes: blocks of equal size up
    to one row, the larger first. Contiguous, so rows kept together by their order (the members of a group, which
    share a prompt) mostly stay on one rank."""
    r = rank() if r is None else r
    size, extra = divmod(n, world())
    start = r * size + min(r, extra)
    return slice(start, start + size + (r < extra))


def rank_chunks(order: torch.Tensor, size: int, lockstep: bool) -> list[torch.Tensor | None]:
    """This rank's micro-batches of a row order [n]: its contiguous block of `order` (`rank_block`), in chunks of
    at most `size`. `lockstep` pads the list with None up to the largest rank's count (rank 0's), for passes in
    which every forward and backward is a collective of all ranks (FSDP2)."""
    mine = list(torch.split(order[rank_block(len(order))], size))
    if not lockstep:
        return mine
    most = math.ceil(math.ceil(len(order) / world()) / size)
    return mine + [None] * (most - len(mine))


def too_few_groups(key: str, value: int, ranks: int) -> str:
    """The refusal of a config key giving fewer groups than the ranks that roll them out."""
    return (f"{key}={value} is fewer groups than the {ranks} ranks (each rank rolls out whole groups); set "
            f"{key} >= {ranks} or use fewer ranks")
