"""Per-bucket, per-loss-component gradient probe (RAGEN's gradient analysis, exact and read-only).

Semantics (``docs/design.md`` §4.2–4.4, metric names from ``reference/ragen_behaviour.md`` §3.7):
- Groups are split into reward-variance buckets with ``assign_buckets`` (whole groups, lowest variance
  first: ``bucket_1..bucket_B``; fixed_rv buckets keep their interval's name, empty intervals are left
  out); with ``zero_bucket`` the zero-variance groups come first as ``bucket_0``; ``all`` is the whole batch.
- The gradient of a bucket and component is the gradient, w.r.t. all trainable parameters, of that
  component's loss aggregated over the bucket exactly as a training mini-batch made of that bucket alone
  (same ``loss_agg_mode``). Each micro-batch is forwarded ONCE through ``analysis.objective.actor_terms``
  and each term is differentiated with ``torch.autograd.grad``, scaled by the micro-batch's ``sub_batch_share``;
  the result does not depend on ``micro_batch_size``.
- Components are signed as they enter the training loss: task = ∇pg, entropy = −∇H (a bonus),
  kl = +∇KL. The reported ``task``/``entropy``/``kl`` norms are coefficient-weighted (RAGEN-compatible,
  i.e. ``entropy_coef·‖∇H‖``); ``raw/*`` are unweighted, so a zero coefficient still shows the direction.
- A cosine involving a gradient that is the zero vector is undefined and logged as NaN (never 0,
  which would read as "orthogonal"); ``zero_grad/<component>`` = 1 flags each such gradient. Typical
  cases: the k3 KL gradient at π = π_ref (the first step, a probe of the initial model) and the GRPO task
  gradient of zero-variance groups. A gradient counts as zero when its raw norm is 0 or below ``ZERO_REL_TOL``
  (1e-5) times the largest raw norm of the bucket's terms: the k3 gradient at π = π_ref is 0 in exact
  arithmetic but comes out ~1e-7 of the others from rounding, and its direction is noise. ``reg_share`` is NaN
  only when task and regulariser are both zero (0/0); with one of them zero it is a real 0 or 1 (a zero-variance
  bucket: the regulariser is the update).
- ``all`` is derived, not recomputed: buckets partition the batch, so
  ``g_all = Σ_b share_b · g_b`` with ``share_b = sub_batch_share(all_mask, rows_b, mode)``; losses of
  ``all`` are combined the same way. Memory stays at three ``all`` vectors plus the current bucket's.
- Per group (optional, ``per_group``): each group's gradient is computed alone (its rows aggregated as a batch of
  their own), and a bucket's gradient is their share-weighted sum ``g_b = Σ_j s_j g_j``, exactly as ``all`` is
  derived from the buckets. The per-group norms are returned (``groups.csv``), and the per-group vectors of
  task, entropy and KL give the Gram matrix from which bootstrap intervals over groups of every bucket norm and
  of ``reg_share`` are computed without further passes (``analysis/bootstrap.py``; ``.../ci_low``,
  ``.../ci_high``; ``all`` gets none). Cost: the same rows are forwarded, in one call per group (more, smaller
  micro-batches), and the vectors of one bucket's groups are held at a time: memory ``m_b × 3 × P`` floats for
  the largest bucket's ``m_b`` groups (``bench/analysis_overhead.py``, phase f), divided over the ranks.
- Reward components (optional): with ``component_advantages`` the task loss is also differentiated with each
  named reward component's own advantages on the same forward pass (``reward/<name>`` terms), and
  ``analysis.reward_grad`` turns them into ``reward_grad/<bucket>/*`` metrics and matrices.
- Every metric is a function of inner products (``analysis/gram.py``): norms, cosines and the regulariser's norm
  come from each bucket's Gram matrix, the reward-component cosines from one per layer group.
- Read-only: nothing is stepped, every RNG stream is restored, and ``.grad`` is left as found (one process and
  replicas never touch it).
- Several ranks (``torch.distributed`` initialised; every rank passes the whole batch): each rank forwards a
  contiguous block of a bucket's rows (``dist.rank_chunks``) and keeps only its shard of each gradient vector
  (``models.sharding.grad_spans``), so no rank ever holds a whole gradient: the analysis buffers are O(P / world)
  per rank plus O(buckets × terms²) scalars. Norms and cosines all-reduce Gram matrices, sketches their partial
  sums, losses their partial sums; the numbers are those of one process. An FSDP2-sharded model has no full
  gradient anywhere: each term gets its own forward and backward per micro-batch, whose gradient FSDP2
  reduce-scatters into the parameters' ``.grad`` shards (read, then cleared: saved before and restored after the
  probe); replicas differentiate as one process does and keep their slice of the summed vectors.
  ``keep_gradients`` needs one process.
- Bounded memory (``memory_chunks`` = C > 1, one process): the parameters are split into C runs of whole
  parameters of about equal size (``chunk_bounds``) and every pass above runs once per chunk, differentiating only
  that chunk's parameters (``torch.autograd.grad`` over them, so autograd skips the other weights' gradients and
  the graph below the chunk). Every result is a sum over coordinates (Gram matrices, per-group Gram matrices,
  sketches), so each chunk's part is added to the parts before it and its vectors are dropped; the losses come from
  the first chunk. Memory: the largest chunk's share of the gradient vectors and of the sketch tables instead of
  all of them; cost: C forward passes per micro-batch, and backward passes that stop at each chunk. The numbers
  are those of C = 1 up to the order of float64 sums (relative 1e-14 measured; ``bench/probe_memory.py``). Every
  chunk's passes start from the same RNG state, so dropout draws, if any, are the same in every chunk.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from rldynamics import dist
from rldynamics.algo.losses import term_coefs
from rldynamics.algo.shares import sub_batch_share
from rldynamics.analysis import bootstrap
from rldynamics.analysis.buckets import assign_buckets
from rldynamics.analysis.gram import cosine, gram, group_gram, local_slices, norm
from rldynamics.analysis.objective import ActorInputs, actor_terms, coefs
from rldynamics.analysis.reward_grad import layer_groups, reward_grad_metrics
from rldynamics.analysis.sketch import GradientSketcher
from rldynamics.config import AlgoConfig
from rldynamics.metric_names import GRAD_NORM, actor, actor_grad_norm, bucket_metric, bucket_name, reward_grad_prefix
from rldynamics.models.sharding import grad_spans, is_sharded, local_flat_grad, replica_shard
from rldynamics.rollout.batch import RolloutBatch

COMPONENT_OF_TERM = {"pg": "task", "entropy": "entropy", "kl": "kl"}
LOSS_NAME_OF_TERM = {"pg": "policy", "entropy": "entropy", "kl": "kl"}
ZERO_REL_TOL = 1e-5  # a raw gradient norm below this fraction of the bucket's largest is rounding noise (0)


@dataclass
class ProbeResult:
    """What one probe returns.

    Attributes:
        metrics: flat ``{prefix}/{bucket}/...`` metrics with RAGEN's names (plus ``actor/...`` copies).
        groups: ``(bucket name, group_id, group reward std)`` rows for ``groups.csv`` (``bucket_k`` only).
        sketches: ``"<bucket>/<component>"`` -> ``[sketch_dim]`` float32 count-sketch of the signed,
            unweighted component gradient.
        gradients: ``"<bucket>/<component>"`` -> ``[P]`` float32 signed unweighted gradient; filled only
            with ``keep_gradients=True`` (memory O(buckets × P)). Component gradients are ``<bucket>/reward/<name>``.
        reward_grad: bucket -> JSON-ready matrices of the reward-component gradients (see ``reward_grad``).
        group_norms: group_id -> per-group metrics (``per_group`` only): ``share`` in its bucket, ``rows``,
            ``tokens`` and the norms ``task``, ``entropy``, ``kl`` (coefficient-weighted), ``raw_entropy``,
            ``raw_kl``, ``regularizer``, named as the bucket metrics.
    """

    metrics: dict[str, float]
    groups: list[tuple[str, int, float]]
    sketches: dict[str, torch.Tensor]
    gradients: dict[str, torch.Tensor] = field(default_factory=dict)
    reward_grad: dict[str, dict] = field(default_factory=dict)
    group_norms: dict[int, dict[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class ProbeSettings:
    """How a probe differentiates and reports (one object for every pass of :func:`gradient_probe`).

    Attributes:
        algo: loss settings (clip, ``loss_agg_mode``, coefficients, KL type) as in training.
        micro_batch_size: rows per forward pass (≥ 1); results do not depend on it.
        temperature: logits temperature, as in training.
        num_buckets, bucket_mode: passed to ``assign_buckets``.
        prefix: metric namespace; ``"grad_norm"`` also mirrors ``all`` to ``actor/grad_norm/*``, ``actor/loss/*``.
        sketch_dim: count-sketch size (0 = no sketches); sketch_seed: its projection seed.
        keep_gradients: also return the full flat gradients (for tests and offline cosines).
        terms: which of the loss terms task / entropy / kl to differentiate (kl needs reference log-probs);
            without ``task`` there are no RAGEN norms of it and no ``reward_grad`` cosines with the total.
        zero_bucket: zero-variance groups form ``bucket_0`` and ties stay together (``assign_buckets``).
        per_group: compute every group's gradient alone (``group_norms``) and, with ``resamples`` > 0, bootstrap
            intervals over groups (``<bucket>/<metric>/ci_low|ci_high``; seeded with ``sketch_seed``).
        shared_prefix: forward a prompt shared by rows of a micro-batch once (``models.forward.token_logprobs``).
        memory_chunks: 1 holds every gradient whole; C > 1 streams the parameters in C chunks (``chunk_bounds``):
            every pass is repeated per chunk and holds only that chunk's coordinates (module docstring). One process.
    """

    algo: AlgoConfig
    micro_batch_size: int
    temperature: float
    num_buckets: int = 6
    bucket_mode: str = "quantile"
    prefix: str = GRAD_NORM
    sketch_dim: int = 1024
    sketch_seed: int = 0
    keep_gradients: bool = False
    terms: tuple[str, ...] = ("task", "entropy", "kl")
    zero_bucket: bool = False
    per_group: bool = False
    resamples: int = bootstrap.RESAMPLES
    shared_prefix: bool = True
    memory_chunks: int = 1


def gradient_probe(model, batch: RolloutBatch, inputs: ActorInputs, group_std: dict[int, float],
                   settings: ProbeSettings, component_advantages: dict[str, torch.Tensor] | None = None,
                   component_weights: dict[str, float] | None = None) -> ProbeResult:
    """Per-bucket gradient norms, cosines, losses and sketches of the loss components, without training.

    Args:
        model: the actor (a causal LM); its parameters, ``.grad`` and mode are left as found.
        batch: the analysed rollout (N rows; groups are whole).
        inputs: old log-probs, advantages and optional reference log-probs, ``[N, L]`` each.
        group_std: reward std of every group id present in ``batch`` (the bucketing score).
        settings: how to differentiate and report (:class:`ProbeSettings`).
        component_advantages: reward component name -> ``[N, L]`` advantages of that component alone; adds the
            ``reward_grad`` metrics (prefix ``grad_norm`` -> ``reward_grad``).
        component_weights: weight of each component in the trained reward (default 1).

    Returns:
        A :class:`ProbeResult`; empty when the batch has no rows.
    """
    if settings.micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {settings.micro_batch_size}")
    if settings.keep_gradients and dist.distributed():
        raise ValueError("keep_gradients needs whole gradients, which a probe over several ranks never gathers")
    chunks = settings.memory_chunks
    if chunks < 1 or (chunks > 1 and dist.distributed()):
        raise ValueError(f"memory_chunks={chunks}: must be >= 1, and 1 over several ranks (each already holds "
                         "1/world of every gradient)")
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    saved = [p.grad for p in model.parameters()]  # a sharded probe accumulates in .grad: put back on return
    try:
        with torch.random.fork_rng(devices=devices, device_type="cuda"):  # dropout draws are undone on return
            return _probe(model, batch, inputs, group_std, settings, component_advantages or {},
                          component_weights or {}, devices)
    finally:
        for p, grad in zip(model.parameters(), saved, strict=True):
            p.grad = grad


@dataclass
class _Terms:
    """What every pass of one probe differentiates: the term names (``pg``, ``entropy``, ``kl``, ``reward/<name>``),
    the reward components' advantages, and the settings."""

    names: list[str]
    components: dict[str, torch.Tensor]
    settings: ProbeSettings


@dataclass
class _Layout:
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


def _layouts(model, sketch_dim: int, sketch_seed: int, chunks: int) -> Iterator[_Layout]:
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
        yield _Layout(params, spans, local_slices(spans, groups), sketcher, total)
        return
    offsets = [0, *torch.tensor(numels).cumsum(0).tolist()]  # [n + 1] first coordinate of each parameter
    generator = torch.Generator().manual_seed(sketch_seed)  # the chunks' sketchers draw the projection in order
    for lo, hi in chunk_bounds(numels, chunks):
        spans = [(offsets[lo], offsets[hi])]
        yield _Layout(params[lo:hi], spans, local_slices(spans, groups),
                      GradientSketcher([p.shape for p in params[lo:hi]], sketch_dim, generator=generator)
                      if sketch_dim > 0 else None, total)


@dataclass
class _Group:
    """One group of a bucket (``per_group``): its place in the bucket."""

    group_id: int
    share: float
    rows: int
    tokens: float


@dataclass
class _Sums:
    """One bucket's (or ``all``'s) statistics summed over the layouts' coordinates: what its results come from.

    A Gram matrix, a sketch and a gradient are sums over coordinates, so a chunk's part is added to the parts of
    the chunks before it; with one layout each is the value of that pass itself.
    """

    names: list[str]
    grams: torch.Tensor | None = None  # [G, K, K] float64 inner products per layer group
    losses: dict[str, float] | None = None  # unweighted loss of each term (from the first pass)
    sketches: dict[str, torch.Tensor] = field(default_factory=dict)  # "<bucket>/<component>" -> [dim] float32
    gradients: dict[str, torch.Tensor] = field(default_factory=dict)  # "<bucket>/<component>" -> [P] (keep only)
    groups: list[_Group] = field(default_factory=list)  # per_group: the bucket's groups
    group_grams: torch.Tensor | None = None  # per_group: [K', K', m, m] over the actor terms of `names`

    def add(self, bucket: str, grads: dict[str, torch.Tensor], losses: dict[str, float], layout: _Layout,
            keep_gradients: bool) -> None:
        """Add one pass's gradients ``grads`` (name -> local [p]) over ``layout``'s coordinates."""
        grams = gram([grads[n] for n in self.names], layout.slices)  # [G, K, K]
        self.grams = grams if self.grams is None else self.grams + grams
        if self.losses is None:
            self.losses = losses
        for n, g in grads.items():
            key = f"{bucket}/{COMPONENT_OF_TERM.get(n, n)}"
            if layout.sketcher is not None:  # the sketch is linear: the whole vector's is the sum of the parts'
                self.sketches[key] = layout.sketcher.sketch(g, out=self.sketches.get(key))  # [dim]
            if keep_gradients:  # one process: the layout is one span of the whole vector
                if key not in self.gradients:
                    self.gradients[key] = torch.zeros(layout.total, dtype=torch.float32)  # [P]
                start, end = layout.spans[0]
                self.gradients[key][start:end] = g.detach().cpu()

    def add_groups(self, singles: list[_GroupGradient]) -> None:
        """Add the per-group gradients of one pass (``_group_gradients``) to the groups' Gram matrices."""
        terms = list(singles[0].grads) if singles else []
        if not self.groups:
            self.groups = [_Group(s.group_id, s.share, s.rows, s.tokens) for s in singles]
        if terms:
            grams = group_gram([torch.stack([s.grads[n] for s in singles]) for n in terms])  # [K', K', m, m]
            self.group_grams = grams if self.group_grams is None else self.group_grams + grams


def _probe(model, batch: RolloutBatch, inputs: ActorInputs, group_std: dict[int, float], settings: ProbeSettings,
           components: dict[str, torch.Tensor], weights: dict[str, float], devices: list[int]) -> ProbeResult:
    """Body of :func:`gradient_probe` (runs inside a forked RNG)."""
    stds = _present_groups(batch.group_ids, group_std)
    if not stds:
        return ProbeResult(metrics={}, groups=[], sketches={})
    gids = sorted(stds)
    scores = torch.tensor([stds[g] for g in gids], dtype=torch.float64)  # [G]
    split = assign_buckets(scores, mode=settings.bucket_mode, num_buckets=settings.num_buckets,
                           zero_bucket=settings.zero_bucket)
    named = [(bucket_name(k, settings.zero_bucket), [gids[i] for i in idx]) for k, idx in enumerate(split) if idx]
    names = [n for n, c in COMPONENT_OF_TERM.items()
             if c in settings.terms and (n != "kl" or inputs.ref_logprobs is not None)]
    names += [f"reward/{k}" for k in components]
    terms = _Terms(names, components, settings)
    bucket_rows = [torch.isin(batch.group_ids, torch.tensor(b)).nonzero().squeeze(1) for _, b in named]  # B x [n_b]
    shares = [sub_batch_share(batch.response_mask, rows, settings.algo.loss_agg_mode) for rows in bucket_rows]
    buckets = [(name, rows, share) for (name, _), rows, share in zip(named, bucket_rows, shares, strict=True)]
    sums = {name: _Sums(names) for name in (*(b for b, _ in named), "all")}
    layer_names: list[str] = []
    for layout in _layouts(model, settings.sketch_dim, settings.sketch_seed, settings.memory_chunks):
        with torch.random.fork_rng(devices=devices, device_type="cuda"):  # every chunk's passes draw alike
            _pass(model, batch, inputs, layout, buckets, sums, terms)
        layer_names = list(layout.slices)
        del layout  # free this chunk's sketch tables before the next chunk's are drawn
    return _results(sums, named, bucket_rows, batch, stds, terms, weights, layer_names)


def _pass(model, batch: RolloutBatch, inputs: ActorInputs, layout: _Layout,
          buckets: list[tuple[str, torch.Tensor, float]], sums: dict[str, _Sums], terms: _Terms) -> None:
    """Every bucket's gradients over ``layout``'s coordinates, and ``all``'s as their share-weighted sum, added to
    ``sums``. Memory: the terms' vectors for ``all`` and for the current bucket (2 K local [p] vectors)."""
    names, keep = terms.names, terms.settings.keep_gradients
    all_grads = {n: _zeros(layout) for n in names}  # name -> [p]
    all_losses = dict.fromkeys(names, 0.0)
    for name, rows, share in buckets:
        if terms.settings.per_group:
            grads, losses, singles = _group_gradients(model, batch, rows, inputs, layout, terms)
            sums[name].add_groups(singles)
            del singles
        else:
            grads, losses = _bucket_gradients(model, batch, rows, inputs, layout, terms)
        for n in names:
            all_grads[n].add_(grads[n], alpha=share)  # [p]
            all_losses[n] += share * losses[n]
        sums[name].add(name, grads, losses, layout, keep)
        del grads  # free this bucket's vectors before the next bucket allocates its own
    sums["all"].add("all", all_grads, all_losses, layout, keep)


def _results(sums: dict[str, _Sums], named: list[tuple[str, list[int]]], bucket_rows: list[torch.Tensor],
             batch: RolloutBatch, stds: dict[int, float], terms: _Terms, weights: dict[str, float],
             layer_names: list[str]) -> ProbeResult:
    """The probe's metrics, matrices, sketches and gradients from every bucket's summed statistics."""
    names, components, settings = terms.names, terms.components, terms.settings
    algo, prefix = settings.algo, settings.prefix
    result = ProbeResult(metrics={}, groups=[], sketches={})
    total_rows = float(len(batch))
    per_bucket: dict[str, dict[str, float]] = {}
    per_bucket_rg: dict[str, dict[str, float]] = {}
    for k, ((name, groups), rows) in enumerate(zip(named, bucket_rows, strict=True)):
        s = sums[name]
        per_bucket[name] = _bucket_metrics(s.grams.sum(0), names, s.losses, algo, count=float(rows.numel()),
                                           tokens=float(batch.response_mask[rows].sum()), total_rows=total_rows,
                                           stds=[stds[g] for g in groups])
        if settings.per_group:
            _group_results(result, per_bucket[name], s, algo, settings.resamples, settings.sketch_seed + k)
        _reward_grad(result, per_bucket_rg, name, s.grams, names, components, weights, layer_names)
        result.groups.extend((name, g, stds[g]) for g in groups)
    whole = sums["all"]
    all_metrics = _bucket_metrics(whole.grams.sum(0), names, whole.losses, algo, count=total_rows,
                                  tokens=float(batch.response_mask.sum()), total_rows=total_rows,
                                  stds=[stds[g] for g in sorted(stds)])
    _reward_grad(result, per_bucket_rg, "all", whole.grams, names, components, weights, layer_names)
    for s in sums.values():  # buckets, then all; summed over ranks (a sketch is linear)
        result.sketches.update({key: torch.tensor(dist.global_sum(v.tolist()), dtype=torch.float32)  # [dim]
                                for key, v in s.sketches.items()})
        result.gradients.update(s.gradients)
    for bucket, values in {"all": all_metrics, **per_bucket}.items():
        result.metrics.update({bucket_metric(prefix, bucket, key): v for key, v in values.items()})
    rg_prefix = reward_grad_prefix(prefix)
    for bucket in ("all", *per_bucket):
        result.metrics.update({bucket_metric(rg_prefix, bucket, key): v
                               for key, v in per_bucket_rg.get(bucket, {}).items()})
    if prefix == GRAD_NORM:
        result.metrics.update(_actor_mirror(all_metrics))
    return result


def _present_groups(group_ids: torch.Tensor, group_std: dict[int, float]) -> dict[int, float]:
    """``group id -> reward std`` for the groups among ``group_ids`` [N]."""
    present = sorted(set(group_ids.tolist()))
    missing = [g for g in present if g not in group_std]
    if missing:
        raise ValueError(f"group_std has no reward std for group ids {missing[:10]}")
    return {g: float(group_std[g]) for g in present}


def _bucket_gradients(model, batch: RolloutBatch, rows: torch.Tensor, inputs: ActorInputs, layout: _Layout,
                      terms: _Terms) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """This rank's part ``[p]`` of the signed, unweighted gradient of each term over the bucket ``rows``, and the
    term's unweighted loss value.

    Each micro-batch's terms are scaled by its share of the bucket's aggregation weight; each rank takes every
    contiguous block of rows (``dist.rank_chunks``), and the parts are summed over ranks (module docstring).
    """
    names, settings = terms.names, terms.settings
    algo = settings.algo
    mask = batch.response_mask[rows]  # [n_b, L]
    sharded = is_sharded(model)
    chunks = dist.rank_chunks(torch.arange(rows.numel()), settings.micro_batch_size, lockstep=sharded)
    shares = [0.0 if c is None else sub_batch_share(mask, c, algo.loss_agg_mode) for c in chunks]
    signs = _term_signs(algo)
    losses = torch.zeros(len(names), dtype=torch.float64)  # [K]

    def forward(positions: torch.Tensor | None, share: float) -> dict[str, torch.Tensor]:
        values, _ = actor_terms(model, batch, rows[positions if positions is not None else slice(0, 1)], inputs, algo,
                                temperature=settings.temperature, component_advantages=terms.components,
                                shared_prefix=settings.shared_prefix)
        if share:
            losses.add_(torch.tensor([share * values[n].item() for n in names], dtype=torch.float64))  # [K]
        return values

    if sharded:
        grads = _sharded_gradients(forward, chunks, shares, names, signs, layout)
    else:
        grads = _plain_gradients(forward, chunks, shares, names, signs, layout)
    return grads, dict(zip(names, dist.global_sum(losses.tolist()), strict=True))


def _plain_gradients(forward, chunks, shares, names, signs, layout: _Layout) -> dict[str, torch.Tensor]:
    """One process or replicas: one forward per micro-batch, ``torch.autograd.grad`` of each term; replicas then sum
    the whole vectors over ranks and keep their slice."""
    params = layout.params
    full = {n: _zeros_full(params) for n in names}  # name -> [P]
    views = {n: _param_views(full[n], params) for n in names}
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


def _sharded_gradients(forward, chunks, shares, names, signs, layout: _Layout) -> dict[str, torch.Tensor]:
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


def _bucket_metrics(whole: torch.Tensor, names: list[str], losses: dict[str, float], algo: AlgoConfig, *,
                    count: float, tokens: float, total_rows: float, stds: list[float]) -> dict[str, float]:
    """RAGEN-named metrics of one bucket from the Gram matrix ``whole`` [K, K] of its signed raw gradients (terms
    ``names``) and its unweighted losses."""
    terms = [n for n in names if n in COMPONENT_OF_TERM]  # the reward components are reported apart
    index = {n: names.index(n) for n in terms}
    weights = coefs(algo)
    out = _norm_metrics(whole, index, algo)
    for n in terms:
        comp = COMPONENT_OF_TERM[n]
        out[f"per_sample/{comp}"] = out[comp] / count if count > 0 else 0.0
        out[f"per_token/{comp}"] = out[comp] / tokens if tokens > 0 else 0.0
    for n in terms:
        out[f"loss/{LOSS_NAME_OF_TERM[n]}"] = weights[n] * losses[n]
    out["loss/total"] = sum(weights[n] * losses[n] for n in terms)
    out.update(sample_count=count, sample_pct=count / total_rows if total_rows > 0 else 0.0,
               reward_std_mean=sum(stds) / len(stds), reward_std_min=min(stds), reward_std_max=max(stds),
               group_rv_count=float(len(stds)))
    raw = {n: norm(whole, _unit(whole, index[n])) for n in terms}
    zero = {n: numerically_zero(raw[n], raw.values()) for n in terms}
    for n in terms:
        out[f"zero_grad/{COMPONENT_OF_TERM[n]}"] = float(zero[n])
    for i, a in enumerate(terms):
        for b in terms[i + 1:]:  # undefined (NaN) for a zero vector
            out[f"cos/{COMPONENT_OF_TERM[a]}_{COMPONENT_OF_TERM[b]}"] = (
                math.nan if zero[a] or zero[b] else cosine(whole, index[a], index[b]))
    return out


def numerically_zero(value: float, norms, rel_tol: float = ZERO_REL_TOL) -> bool:
    """True when a raw gradient norm is 0 or at float rounding level: at most `rel_tol` × the largest raw norm of
    the bucket's terms (`norms`). The k3 KL gradient at π = π_ref is 0 in exact arithmetic, but the probe's
    forward and the reference pass round differently, which leaves a gradient ~1e-7 of the others (a noise
    direction whose cosines mean nothing)."""
    return value == 0.0 or value <= rel_tol * max(norms)


def _norm_metrics(whole: torch.Tensor, index: dict[str, int], algo: AlgoConfig) -> dict[str, float]:
    """The norms of signed raw gradients (pg / entropy / kl at ``index`` of the Gram matrix ``whole`` [K, K]):
    ``task``, ``entropy``, ``kl`` (coefficient-weighted), ``raw/entropy``, ``raw/kl``, and with pg ``regularizer``
    and ``reg_share``."""
    scale = _term_scales(algo)
    out: dict[str, float] = {}
    for n, i in index.items():
        raw = norm(whole, _unit(whole, i))
        out[COMPONENT_OF_TERM[n]] = scale[n] * raw
        if n != "pg":
            out[f"raw/{COMPONENT_OF_TERM[n]}"] = raw
    if "pg" in index:
        reg = torch.zeros(whole.shape[0], dtype=torch.float64)  # [K]
        for n, i in index.items():
            if n != "pg":
                reg[i] = scale[n]
        out["regularizer"] = norm(whole, reg)
        denom = out["task"] + out["regularizer"]
        out["reg_share"] = out["regularizer"] / denom if denom > 0 else math.nan  # 0/0: both gradients are zero
    return out


def _unit(whole: torch.Tensor, i: int) -> torch.Tensor:
    """The i-th unit vector of the Gram matrix's dimension. [K]"""
    return torch.nn.functional.one_hot(torch.tensor(i), whole.shape[0]).double()  # [K]


def _term_scales(algo: AlgoConfig) -> dict[str, float]:
    """Magnitude of each signed term's coefficient in the loss: pg 1, entropy ``entropy_coef``, kl ``kl_coef``."""
    weights, signs = coefs(algo), _term_signs(algo)
    return {n: weights[n] * signs[n] for n in weights}


@dataclass
class _GroupGradient:
    """One group's gradients (this rank's part ``[p]`` of each signed, unweighted term) and its place in its bucket."""

    group_id: int
    share: float
    rows: int
    tokens: float
    grads: dict[str, torch.Tensor]


def _group_gradients(model, batch: RolloutBatch, rows: torch.Tensor, inputs: ActorInputs, layout: _Layout,
                     terms: _Terms) -> tuple[dict[str, torch.Tensor], dict[str, float], list[_GroupGradient]]:
    """The bucket ``rows``' gradients and losses as the share-weighted sum of its groups' own, and the groups'.

    ``g_b = Σ_j s_j g_j`` with ``s_j = sub_batch_share(bucket mask, rows of group j)``: exact in every
    ``loss_agg_mode``, as ``all`` is exact from the buckets.
    """
    names, algo = terms.names, terms.settings.algo
    grads = {n: _zeros(layout) for n in names}  # name -> [p]
    losses = dict.fromkeys(names, 0.0)
    mask = batch.response_mask[rows]  # [n_b, L]
    bucket_gids = batch.group_ids[rows]  # [n_b]
    singles = []
    for gid in sorted(set(bucket_gids.tolist())):
        positions = (bucket_gids == gid).nonzero().squeeze(1)  # [n_j]
        share = sub_batch_share(mask, positions, algo.loss_agg_mode)
        g_j, l_j = _bucket_gradients(model, batch, rows[positions], inputs, layout, terms)
        for n in names:
            grads[n].add_(g_j[n], alpha=share)  # [p]
            losses[n] += share * l_j[n]
        singles.append(_GroupGradient(gid, share, int(positions.numel()), float(mask[positions].sum()),
                                      {n: g for n, g in g_j.items() if n in COMPONENT_OF_TERM}))
    return grads, losses, singles


def _group_results(result: ProbeResult, metrics: dict[str, float], sums: _Sums, algo: AlgoConfig, resamples: int,
                   seed: int) -> None:
    """Per-group norms into ``result.group_norms`` and the bucket's bootstrap intervals into ``metrics``."""
    names = [n for n in sums.names if n in COMPONENT_OF_TERM]
    if not names or sums.group_grams is None:
        return
    grams = sums.group_grams  # [K, K, m, m]
    index = {n: i for i, n in enumerate(names)}
    for j, group in enumerate(sums.groups):
        result.group_norms[group.group_id] = {"share": group.share, "rows": float(group.rows), "tokens": group.tokens,
                                              **_norm_metrics(grams[:, :, j, j], index, algo)}
    if resamples < 2:
        return
    shares = torch.tensor([group.share for group in sums.groups], dtype=torch.float64)  # [m]
    metrics.update(bootstrap.bucket_intervals(shares, grams, names, _term_scales(algo), metrics,
                                              normalised=algo.loss_agg_mode != "seq-mean-token-sum-norm",
                                              resamples=resamples, seed=seed))


def _reward_grad(result: ProbeResult, metrics: dict[str, dict[str, float]], bucket: str, grams: torch.Tensor,
                 names: list[str], components: dict[str, torch.Tensor], weights: dict[str, float],
                 groups: list[str]) -> None:
    """The reward-component metrics and matrices of one bucket from its Gram matrices per layer group ``grams``
    [G, K, K] over ``names`` (nothing without components); ``groups``: the G layer groups' names."""
    if not components:
        return
    picked = [names.index(f"reward/{k}") for k in components] + ([names.index("pg")] if "pg" in names else [])
    metrics[bucket], result.reward_grad[bucket] = reward_grad_metrics(
        grams[:, picked][:, :, picked], list(components), "pg" in names, {k: weights.get(k, 1.0) for k in components},
        groups)


def _actor_mirror(all_metrics: dict[str, float]) -> dict[str, float]:
    """RAGEN's root copies of the ``all`` bucket: ``actor/grad_norm/*`` and ``actor/loss/*``."""
    keys = [k for k in ("task", "entropy", "kl") if k in all_metrics]
    out = {actor_grad_norm(k): all_metrics[k] for k in keys}
    out.update({actor(k): v for k, v in all_metrics.items() if k.startswith("loss/")})
    return out


def _term_signs(algo: AlgoConfig) -> dict[str, float]:
    """Sign with which each unweighted term enters the training loss (+pg, −entropy, +kl), from `term_coefs`."""
    unit = term_coefs(1.0, 1.0)
    return {n: math.copysign(1.0, c) for n, c in unit.items()}


def _zeros(layout: _Layout) -> torch.Tensor:
    """A float32 zero vector with one slot per coordinate this rank holds. [p]"""
    device = layout.params[0].device if layout.params else torch.device("cpu")
    return torch.zeros(layout.size, dtype=torch.float32, device=device)  # [p]


def _zeros_full(params: list[torch.Tensor]) -> torch.Tensor:
    """A flat float32 zero vector with one slot per trainable parameter entry. [P]"""
    device = params[0].device if params else torch.device("cpu")
    return torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=device)  # [P]


def _param_views(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like each parameter (writing a view writes ``flat``)."""
    parts = flat.split([p.numel() for p in params])  # one [n_i] view per parameter
    return [part.view(p.shape) for part, p in zip(parts, params, strict=True)]
