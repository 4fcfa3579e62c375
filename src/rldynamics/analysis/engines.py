"""The gradient engines of the probe: the signed, unweighted gradient of every loss term over a set of rows.

- `bucket_gradients`: one bucket's rows, micro-batch by micro-batch, each forwarded once through
  ``analysis.objective.actor_terms`` and each term differentiated, scaled by the micro-batch's ``sub_batch_share``.
  Two engines do the differentiating: `plain_gradients` (one process, or replicas: ``torch.autograd.grad`` of each
  term, then each replica keeps its slice) and `sharded_gradients` (FSDP2: a forward and a backward per term, the
  ``.grad`` shards read and cleared).
- `group_gradients` (``analysis.per_group``): every group of a bucket alone, the bucket's gradient their
  share-weighted sum.
- `layouts`: which coordinates a pass holds: this rank's of every parameter, or one ``chunk_bounds`` chunk at a time
  (``analysis.memory_chunks``).

The probe (``analysis/probe.py``) sums their results into Gram matrices and sketches; ``analysis/probe_metrics.py``
turns those into metrics. Term names are the code's (``pg``, ``entropy``, ``kl``, ``reward/<name>``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rldynamics import dist
from rldynamics.algo.losses import PolicyLossSettings, term_coefs
from rldynamics.algo.shares import sub_batch_share
from rldynamics.analysis.gram import local_slices
from rldynamics.analysis.objective import ActorInputs, actor_terms
from rldynamics.analysis.reward_grad import layer_groups
from rldynamics.analysis.sketch import GradientSketcher
from rldynamics.metric_names import TERM_COMPONENT
from rldynamics.models.sharding import grad_spans, is_sharded, local_flat_grad, replica_shard
from rldynamics.rollout.batch import RolloutBatch


@dataclass
class Terms:
    """What every pass of one probe differentiates: the term names (``pg``, ``entropy``, ``kl``, ``reward/<name>``),
    the reward components' advantages, the loss settings (built once per probe), and how the rows are forwarded."""

    names: list[str]
    components: dict[str, torch.Tensor]
    loss_settings: PolicyLossSettings
    micro_batch_size: int
    temperature: float
    shared_prefix: bool


@dataclass
class Layout:
    """Which coordinates of the flat gradient this pass holds, and the projections that read them."""

    params: list[torch.Tensor]
    spans: list[tuple[int, int]]  # global [start, end) coordinates of the local vector (`grad_spans`, or a chunk's)
    slices: dict[str, list[tuple[int, int]]]  # layer group -> local [start, end) slices
    sketcher: GradientSketcher | None
    total: int  # coordinates of the whole flat gradient (P)

    @property
    def size(self) -> int:
        return sum(end - start for start, end in self.spans)


def chunk_bounds(numels: list[int], chunks: int) -> list[tuple[int, int]]:
    """Split parameters (their sizes ``numels``, in order) into at most ``chunks`` consecutive runs of whole
    parameters of about equal size: each cut is the parameter boundary nearest to a multiple of P / chunks.
    Returns [lo, hi) parameter index ranges, none empty; a parameter larger than P / chunks is a chunk alone."""
    ends = torch.tensor(numels, dtype=torch.float64).cumsum(0)  # [n] coordinate after each parameter
    total = float(ends[-1]) if len(numels) else 0.0
    cuts = {0, len(numels)}
    for k in range(1, chunks):
        cuts.add(int((ends - k * total / chunks).abs().argmin()) + 1)  # after the parameter ending nearest k·P/C
    bounds = sorted(cuts)
    return [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True) if hi > lo]


def layouts(model, sketch_dim: int, sketch_seed: int, chunks: int) -> Iterator[Layout]:
    """The layouts the probe's passes run over, one at a time: one (this rank's coordinates of every parameter)
    with ``chunks`` = 1, else the ``chunk_bounds`` chunks in order, each with its piece of the sketch projection."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    numels = [p.numel() for p in params]
    total = sum(numels)
    groups = layer_groups([n for n, _ in named], numels)
    if chunks == 1 or len(params) < 2:
        spans = grad_spans(model, params)
        sketcher = GradientSketcher([p.shape for p in params], sketch_dim, sketch_seed, spans) if sketch_dim > 0 \
            else None
        yield Layout(params, spans, local_slices(spans, groups), sketcher, total)
        return
    offsets = [0, *torch.tensor(numels).cumsum(0).tolist()]  # [n + 1] first coordinate of each parameter
    generator = torch.Generator().manual_seed(sketch_seed)  # the chunks' sketchers draw the projection in order
    for lo, hi in chunk_bounds(numels, chunks):
        spans = [(offsets[lo], offsets[hi])]
        yield Layout(params[lo:hi], spans, local_slices(spans, groups),
                      GradientSketcher([p.shape for p in params[lo:hi]], sketch_dim, generator=generator)
                      if sketch_dim > 0 else None, total)


def bucket_gradients(model, batch: RolloutBatch, rows: torch.Tensor, inputs: ActorInputs, layout: Layout,
                      terms: Terms) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """This rank's part ``[p]`` of the signed, unweighted gradient of each term over the bucket ``rows``, and the
    term's unweighted loss value.

    Each micro-batch's terms are scaled by its share of the bucket's aggregation weight; each rank takes every
    contiguous block of rows (``dist.rank_chunks``), and the parts are summed over ranks (module docstring).
    """
    names, settings = terms.names, terms.loss_settings
    mask = batch.response_mask[rows]  # [n_b, L]
    sharded = is_sharded(model)
    chunks = dist.rank_chunks(torch.arange(rows.numel()), terms.micro_batch_size, lockstep=sharded)
    shares = [0.0 if c is None else sub_batch_share(mask, c, settings.agg) for c in chunks]
    signs = term_signs()
    losses = torch.zeros(len(names), dtype=torch.float64)  # [K]

    def forward(positions: torch.Tensor | None, share: float) -> dict[str, torch.Tensor]:
        values, _ = actor_terms(model, batch, rows[positions if positions is not None else slice(0, 1)], inputs,
                                settings, temperature=terms.temperature, component_advantages=terms.components,
                                shared_prefix=terms.shared_prefix)
        if share:
            losses.add_(torch.tensor([share * values[n].item() for n in names], dtype=torch.float64))  # [K]
        return values

    if sharded:
        grads = sharded_gradients(forward, chunks, shares, names, signs, layout)
    else:
        grads = plain_gradients(forward, chunks, shares, names, signs, layout)
    return grads, dict(zip(names, dist.global_sum(losses.tolist()), strict=True))


def plain_gradients(forward, chunks, shares, names, signs, layout: Layout) -> dict[str, torch.Tensor]:
    """One process or replicas: one forward per micro-batch, ``torch.autograd.grad`` of each term; replicas then sum
    the whole vectors over ranks and keep their slice."""
    params = layout.params
    full = {n: zeros_full(params) for n in names}  # name -> [P]
    views = {n: param_views(full[n], params) for n in names}
    for positions, share in zip(chunks, shares, strict=True):
        if share == 0.0:  # no response tokens: contributes nothing to the aggregated loss
            continue
        terms = forward(positions, share)
        for i, n in enumerate(names):
            if not terms[n].requires_grad:
                continue
            parts = torch.autograd.grad(terms[n], params, retain_graph=i < len(names) - 1, allow_unused=True)
            for view, part in zip(views[n], parts, strict=True):
                if part is not None:
                    view.add_(part.float(), alpha=share * signs.get(n, 1.0))  # param shape (reward/*: +1)
    if not dist.distributed():
        return full
    return {n: replica_shard(full[n]) for n in names}


def sharded_gradients(forward, chunks, shares, names, signs, layout: Layout) -> dict[str, torch.Tensor]:
    """FSDP2: per term, a forward and a backward per micro-batch in step with every rank; FSDP2 sums the ranks'
    parts into the ``.grad`` shards, which are read and cleared."""
    params = layout.params
    grads = {}
    for i, n in enumerate(names):
        for positions, share in zip(chunks, shares, strict=True):
            terms = forward(positions, share if i == 0 else 0.0)  # the losses are taken once
            loss = terms[n] * (share * signs.get(n, 1.0))
            if not loss.requires_grad:
                loss = loss + 0.0 * terms["pg"]  # a term without a graph: every rank must still run backward
            loss.backward()
        grads[n] = local_flat_grad(params)  # [p]
        for p in params:
            p.grad = None
    return grads


@dataclass
class GroupGradient:
    """One group's gradients (this rank's part ``[p]`` of each signed, unweighted term) and its place in its bucket."""

    group_id: int
    share: float
    rows: int
    tokens: float
    grads: dict[str, torch.Tensor]


def group_gradients(model, batch: RolloutBatch, rows: torch.Tensor, inputs: ActorInputs, layout: Layout,
                     terms: Terms) -> tuple[dict[str, torch.Tensor], dict[str, float], list[GroupGradient]]:
    """The bucket ``rows``' gradients and losses as the share-weighted sum of its groups' own, and the groups'.

    ``g_b = Σ_j s_j g_j`` with ``s_j = sub_batch_share(bucket mask, rows of group j)``: exact in every
    ``loss_agg_mode``, as ``all`` is exact from the buckets.
    """
    names = terms.names
    grads = {n: zeros(layout) for n in names}  # name -> [p]
    losses = dict.fromkeys(names, 0.0)
    mask = batch.response_mask[rows]  # [n_b, L]
    bucket_gids = batch.group_ids[rows]  # [n_b]
    singles = []
    for gid in sorted(set(bucket_gids.tolist())):
        positions = (bucket_gids == gid).nonzero().squeeze(1)  # [n_j]
        share = sub_batch_share(mask, positions, terms.loss_settings.agg)
        g_j, l_j = bucket_gradients(model, batch, rows[positions], inputs, layout, terms)
        for n in names:
            grads[n].add_(g_j[n], alpha=share)  # [p]
            losses[n] += share * l_j[n]
        singles.append(GroupGradient(gid, share, int(positions.numel()), float(mask[positions].sum()),
                                      {n: g for n, g in g_j.items() if n in TERM_COMPONENT}))
    return grads, losses, singles


def term_signs() -> dict[str, float]:
    """Sign with which each unweighted term enters the training loss (+pg, −entropy, +kl), from `term_coefs`."""
    unit = term_coefs(1.0, 1.0)
    return {n: math.copysign(1.0, c) for n, c in unit.items()}


def zeros(layout: Layout) -> torch.Tensor:
    """A float32 zero vector with one slot per coordinate this rank holds. [p]"""
    device = layout.params[0].device if layout.params else torch.device("cpu")
    return torch.zeros(layout.size, dtype=torch.float32, device=device)  # [p]


def zeros_full(params: list[torch.Tensor]) -> torch.Tensor:
    """A flat float32 zero vector with one slot per trainable parameter entry. [P]"""
    device = params[0].device if params else torch.device("cpu")
    return torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=device)  # [P]


def param_views(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like each parameter (writing a view writes ``flat``)."""
    parts = flat.split([p.numel() for p in params])  # one [n_i] view per parameter
    return [part.view(p.shape) for part, p in zip(parts, params, strict=True)]
