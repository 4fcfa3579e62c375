"""Per-bucket, per-loss-component gradient probe (RAGEN's gradient analysis, exact and read-only).

This module assembles the probe: buckets, passes over them, sums, results. The gradients come from the engines of
``analysis/engines.py``, the metrics from ``analysis/probe_metrics.py``.

Semantics (``docs/design.md`` §4.2–4.4, metric names from ``docs/reference/ragen_behaviour.md`` §3.7):
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
  gradient of zero-variance groups. A gradient counts as zero when its raw norm is 0 or below
  ``probe_metrics.ZERO_REL_TOL`` (1e-5) times the largest raw norm of the bucket's terms: the k3 gradient at
  π = π_ref is 0 in exact arithmetic but comes out ~1e-7 of the others from rounding, and its direction is noise.
  ``reg_share`` is NaN only when task and regulariser are both zero (0/0); with one of them zero it is a real 0 or
  1 (a zero-variance bucket: the regulariser is the update).
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
  parameters of about equal size (``engines.chunk_bounds``) and every pass above runs once per chunk, differentiating
  only that chunk's parameters (``torch.autograd.grad`` over them, so autograd skips the other weights' gradients and
  the graph below the chunk). Every result is a sum over coordinates (Gram matrices, per-group Gram matrices,
  sketches), so each chunk's part is added to the parts before it and its vectors are dropped; the losses come from
  the first chunk. Memory: the largest chunk's share of the gradient vectors and of the sketch tables instead of
  all of them; cost: C forward passes per micro-batch, and backward passes that stop at each chunk. The numbers
  are those of C = 1 up to the order of float64 sums (relative 1e-14 measured; ``bench/probe_memory.py``). Every
  chunk's passes start from the same RNG state, so dropout draws, if any, are the same in every chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rldynamics import dist
from rldynamics.algo.shares import sub_batch_share
from rldynamics.analysis import bootstrap
from rldynamics.analysis.buckets import assign_buckets
from rldynamics.analysis.engines import (
    GroupGradient,
    Layout,
    Terms,
    bucket_gradients,
    group_gradients,
    layouts,
    zeros,
)
from rldynamics.analysis.gram import gram, group_gram
from rldynamics.analysis.objective import ActorInputs, policy_loss_settings
from rldynamics.analysis.probe_metrics import actor_mirror, bucket_metrics, norm_metrics, term_scales
from rldynamics.analysis.reward_grad import reward_grad_metrics
from rldynamics.config import AlgoConfig
from rldynamics.metric_names import GRAD_NORM, TERM_COMPONENT, bucket_metric, bucket_name, reward_grad_prefix
from rldynamics.rollout.batch import RolloutBatch


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
        algo: loss settings (clip, ``loss_agg_mode``, coefficients, KL type) as in training; read once per probe
            into ``algo.losses.PolicyLossSettings`` (``analysis.objective.policy_loss_settings``).
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

    def add(self, bucket: str, grads: dict[str, torch.Tensor], losses: dict[str, float], layout: Layout,
            keep_gradients: bool) -> None:
        """Add one pass's gradients ``grads`` (name -> local [p]) over ``layout``'s coordinates."""
        grams = gram([grads[n] for n in self.names], layout.slices)  # [G, K, K]
        self.grams = grams if self.grams is None else self.grams + grams
        if self.losses is None:
            self.losses = losses
        for n, g in grads.items():
            key = f"{bucket}/{TERM_COMPONENT.get(n, n)}"
            if layout.sketcher is not None:  # the sketch is linear: the whole vector's is the sum of the parts'
                self.sketches[key] = layout.sketcher.sketch(g, out=self.sketches.get(key))  # [dim]
            if keep_gradients:  # one process: the layout is one span of the whole vector
                if key not in self.gradients:
                    self.gradients[key] = torch.zeros(layout.total, dtype=torch.float32)  # [P]
                start, end = layout.spans[0]
                self.gradients[key][start:end] = g.detach().cpu()

    def add_groups(self, singles: list[GroupGradient]) -> None:
        """Add the per-group gradients of one pass (``group_gradients``) to the groups' Gram matrices."""
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
    names = [n for n, c in TERM_COMPONENT.items()
             if c in settings.terms and (n != "kl" or inputs.ref_logprobs is not None)]
    names += [f"reward/{k}" for k in components]
    terms = Terms(names, components, policy_loss_settings(settings.algo), settings.micro_batch_size,
                  settings.temperature, settings.shared_prefix)
    bucket_rows = [torch.isin(batch.group_ids, torch.tensor(b)).nonzero().squeeze(1) for _, b in named]  # B x [n_b]
    shares = [sub_batch_share(batch.response_mask, rows, terms.loss_settings.agg) for rows in bucket_rows]
    buckets = [(name, rows, share) for (name, _), rows, share in zip(named, bucket_rows, shares, strict=True)]
    sums = {name: _Sums(names) for name in (*(b for b, _ in named), "all")}
    layer_names: list[str] = []
    for layout in layouts(model, settings.sketch_dim, settings.sketch_seed, settings.memory_chunks):
        with torch.random.fork_rng(devices=devices, device_type="cuda"):  # every chunk's passes draw alike
            _pass(model, batch, inputs, layout, buckets, sums, terms, settings)
        layer_names = list(layout.slices)
        del layout  # free this chunk's sketch tables before the next chunk's are drawn
    return _results(sums, named, bucket_rows, batch, stds, terms, settings, weights, layer_names)


def _pass(model, batch: RolloutBatch, inputs: ActorInputs, layout: Layout,
          buckets: list[tuple[str, torch.Tensor, float]], sums: dict[str, _Sums], terms: Terms,
          settings: ProbeSettings) -> None:
    """Every bucket's gradients over ``layout``'s coordinates, and ``all``'s as their share-weighted sum, added to
    ``sums``. Memory: the terms' vectors for ``all`` and for the current bucket (2 K local [p] vectors)."""
    names, keep = terms.names, settings.keep_gradients
    all_grads = {n: zeros(layout) for n in names}  # name -> [p]
    all_losses = dict.fromkeys(names, 0.0)
    for name, rows, share in buckets:
        if settings.per_group:
            grads, losses, singles = group_gradients(model, batch, rows, inputs, layout, terms)
            sums[name].add_groups(singles)
            del singles
        else:
            grads, losses = bucket_gradients(model, batch, rows, inputs, layout, terms)
        for n in names:
            all_grads[n].add_(grads[n], alpha=share)  # [p]
            all_losses[n] += share * losses[n]
        sums[name].add(name, grads, losses, layout, keep)
        del grads  # free this bucket's vectors before the next bucket allocates its own
    sums["all"].add("all", all_grads, all_losses, layout, keep)


def _results(sums: dict[str, _Sums], named: list[tuple[str, list[int]]], bucket_rows: list[torch.Tensor],
             batch: RolloutBatch, stds: dict[int, float], terms: Terms, settings: ProbeSettings,
             weights: dict[str, float], layer_names: list[str]) -> ProbeResult:
    """The probe's metrics, matrices, sketches and gradients from every bucket's summed statistics."""
    names, components = terms.names, terms.components
    algo, prefix = settings.algo, settings.prefix
    result = ProbeResult(metrics={}, groups=[], sketches={})
    total_rows = float(len(batch))
    per_bucket: dict[str, dict[str, float]] = {}
    per_bucket_rg: dict[str, dict[str, float]] = {}
    for k, ((name, groups), rows) in enumerate(zip(named, bucket_rows, strict=True)):
        s = sums[name]
        per_bucket[name] = bucket_metrics(s.grams.sum(0), names, s.losses, algo, count=float(rows.numel()),
                                           tokens=float(batch.response_mask[rows].sum()), total_rows=total_rows,
                                           stds=[stds[g] for g in groups])
        if settings.per_group:
            _group_results(result, per_bucket[name], s, algo, settings.resamples, settings.sketch_seed + k)
        _reward_grad(result, per_bucket_rg, name, s.grams, names, components, weights, layer_names)
        result.groups.extend((name, g, stds[g]) for g in groups)
    whole = sums["all"]
    all_metrics = bucket_metrics(whole.grams.sum(0), names, whole.losses, algo, count=total_rows,
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
        result.metrics.update(actor_mirror(all_metrics))
    return result


def _present_groups(group_ids: torch.Tensor, group_std: dict[int, float]) -> dict[int, float]:
    """``group id -> reward std`` for the groups among ``group_ids`` [N]."""
    present = sorted(set(group_ids.tolist()))
    missing = [g for g in present if g not in group_std]
    if missing:
        raise ValueError(f"group_std has no reward std for group ids {missing[:10]}")
    return {g: float(group_std[g]) for g in present}


def _group_results(result: ProbeResult, metrics: dict[str, float], sums: _Sums, algo: AlgoConfig, resamples: int,
                   seed: int) -> None:
    """Per-group norms into ``result.group_norms`` and the bucket's bootstrap intervals into ``metrics``."""
    names = [n for n in sums.names if n in TERM_COMPONENT]
    if not names or sums.group_grams is None:
        return
    grams = sums.group_grams  # [K, K, m, m]
    index = {n: i for i, n in enumerate(names)}
    for j, group in enumerate(sums.groups):
        result.group_norms[group.group_id] = {"share": group.share, "rows": float(group.rows), "tokens": group.tokens,
                                              **norm_metrics(grams[:, :, j, j], index, algo)}
    if resamples < 2:
        return
    shares = torch.tensor([group.share for group in sums.groups], dtype=torch.float64)  # [m]
    metrics.update(bootstrap.bucket_intervals(shares, grams, names, term_scales(algo), metrics,
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
