"""Inner products of flat gradient vectors that may be split over ranks: Gram matrices per layer group.

Every probe metric of a set of gradients (norms, cosines, the regulariser's norm, reward-component cosines per
layer group, bootstrap resamples) is a function of their inner products. Each rank holds the same coordinates of
every vector (`models.sharding.grad_spans`: global [start, end) spans of the flat layout, in the order of the local
vector), so the inner products are the sum over ranks of the local ones: one all-reduce of a few scalars per layer
group, whatever the parameter count. In one process the local vector is the whole vector.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rldynamics.dist import collective_device, distributed

CHUNK = 2**17  # coordinates per float64 block: a K x 1 MiB buffer, near the CPU's caches, whatever the parameter count


def local_slices(spans: list[tuple[int, int]], groups: dict[str, list[tuple[int, int]]]
                 ) -> dict[str, list[tuple[int, int]]]:
    """Where each group's coordinates lie in this rank's local vector: local [start, end) slices per group.

    Args:
        spans: global [start, end) coordinates of the local vector, in its order.
        groups: group name -> global [start, end) spans (`reward_grad.layer_groups`; they partition [0, P)).
    """
    out: dict[str, list[tuple[int, int]]] = {}
    for name, parts in groups.items():
        slices = []
        offset = 0
        for start, end in spans:
            for lo, hi in parts:
                a, b = max(start, lo), min(end, hi)
                if a < b:
                    slices.append((offset + a - start, offset + b - start))
            offset += end - start
        out[name] = slices
    return out


def gram(vectors: list[torch.Tensor], slices: dict[str, list[tuple[int, int]]]) -> torch.Tensor:
    """Inner products of `vectors` (each the local [p] part) within each group, summed over ranks. [G, K, K] float64

    Args:
        vectors: K local vectors with the same layout.
        slices: `local_slices` of the layout (G groups).
    """
    k, device = len(vectors), vectors[0].device if vectors else torch.device("cpu")
    out = torch.zeros(len(slices), k, k, dtype=torch.float64, device=device)  # [G, K, K]
    buffer = torch.empty(k, CHUNK, dtype=torch.float64, device=device)  # [K, CHUNK], reused by every block
    for g, parts in enumerate(slices.values()):
        for start, end in parts:
            for a in range(start, end, CHUNK):  # each vector's next CHUNK coordinates, cast into the buffer
                n = min(CHUNK, end - a)
                block = buffer[:, :n]  # [K, n]
                for row, v in zip(block, vectors, strict=True):
                    row.copy_(v[a:a + n])
                out[g] += block @ block.T  # [K, K]
    if distributed():
        out = out.to(collective_device())  # [G, K, K]
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.cpu()  # [G, K, K]


def dot64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """<a, b> of two same-sized tensors on one rank, accumulated in float64 over blocks of `CHUNK`. 0-dim float64"""
    a, b = a.reshape(-1), b.reshape(-1)  # [n], [n]
    total = torch.zeros((), dtype=torch.float64, device=a.device)
    for start in range(0, a.numel(), CHUNK):
        total += torch.dot(a[start:start + CHUNK].double(), b[start:start + CHUNK].double())
    return total


def cosine(gram: torch.Tensor, a: int, b: int) -> float:
    """cos of vectors `a` and `b` from their Gram matrix `gram` [K, K]; NaN when either is exactly zero."""
    na, nb = float(gram[a, a]), float(gram[b, b])
    if na <= 0.0 or nb <= 0.0:
        return float("nan")
    return float(gram[a, b]) / (na ** 0.5 * nb ** 0.5)


def norm(gram: torch.Tensor, coefs: torch.Tensor) -> float:
    """‖Σ_k coefs_k v_k‖ from the Gram matrix `gram` [K, K] of the vectors and `coefs` [K]."""
    c = coefs.to(torch.float64)  # [K]
    return float((c @ gram @ c).clamp_min(0.0).sqrt())


def group_gram(stacked: list[torch.Tensor]) -> torch.Tensor:
    """Inner products ``⟨v_cj, v_dk⟩`` of K components' per-group vectors (each local [m, p]), summed over ranks.
    [K, K, m, m] float64"""
    k, m = len(stacked), stacked[0].shape[0]
    flat = gram([row for rows in stacked for row in rows], {"all": [(0, stacked[0].shape[1])]})[0]  # [K*m, K*m]
    return flat.reshape(k, m, k, m).permute(0, 2, 1, 3)  # [K, K, m, m]
