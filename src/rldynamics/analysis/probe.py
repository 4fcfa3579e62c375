"""Per-bucket, per-loss-component gradient probe (RAGEN's gradient analysis, exact and read-only).

Semantics (``DESIGN.md`` §4.2–4.4, metric names from ``reference/ragen_behaviour.md`` §3.7):
- Groups are split into reward-variance buckets with ``assign_buckets`` (whole groups, lowest variance
  first: ``bucket_1..bucket_B``; fixed_rv buckets keep their interval's name, empty intervals are left
  out); with ``zero_bucket`` the zero-variance groups come first as ``bucket_0``; ``all`` is the whole batch.
- The gradient of a bucket and component is the gradient, w.r.t. all trainable parameters, of that
  component's loss aggregated over the bucket exactly as a training mini-batch made of that bucket alone
  (same ``loss_agg_mode``). Each micro-batch is forwarded ONCE through ``train.actor.loss_terms`` and each
  term is differentiated with ``torch.autograd.grad``, scaled by the micro-batch's ``sub_batch_share``;
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
  the largest bucket's ``m_b`` groups (``bench/analysis_overhead.py``, phase f). One process only.
- Reward components (optional): with ``component_advantages`` the task loss is also differentiated with each
  named reward component's own advantages on the same forward pass (``reward/<name>`` terms), and
  ``analysis.reward_grad`` turns them into ``reward_grad/<bucket>/*`` metrics and matrices.
- Read-only: ``.grad`` is never touched, nothing is stepped, and every RNG stream is restored.
- Distributed (``torch.distributed`` initialised): each rank holds a shard of the batch; buckets are
  assigned over the union of all ranks' groups, shares use globally summed aggregation weights and the
  share-weighted gradient vectors and losses are all-reduced (SUM), so every rank gets the global
  numbers. The model must be replicated (one full copy per rank).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rldynamics.analysis import bootstrap
from rldynamics.analysis.bucket_names import bucket_name
from rldynamics.analysis.buckets import assign_buckets
from rldynamics.analysis.reward_grad import layer_groups, reward_grad_metrics
from rldynamics.analysis.shares import bucket_shares, chunk_shares, distributed, global_sum, present_groups
from rldynamics.analysis.sketch import GradientSketcher
from rldynamics.config import AlgoConfig
from rldynamics.models.forward import micro_batches
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.train.actor import ActorInputs, loss_terms, sub_batch_share, term_coefs

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


def gradient_probe(model, batch: RolloutBatch, inputs: ActorInputs, group_std: dict[int, float], *,
                   algo: AlgoConfig, micro_batch_size: int, temperature: float, num_buckets: int = 6,
                   bucket_mode: str = "quantile", prefix: str = "grad_norm", sketch_dim: int = 1024,
                   sketch_seed: int = 0, keep_gradients: bool = False,
                   component_advantages: dict[str, torch.Tensor] | None = None,
                   component_weights: dict[str, float] | None = None,
                   terms: tuple[str, ...] = ("task", "entropy", "kl"), zero_bucket: bool = False,
                   per_group: bool = False, resamples: int = bootstrap.RESAMPLES) -> ProbeResult:
    """Per-bucket gradient norms, cosines, losses and sketches of the loss components, without training.

    Args:
        model: the actor (a causal LM); its parameters, ``.grad`` and mode are left as found.
        batch: the analysed rollout (N rows; groups are whole).
        inputs: old log-probs, advantages and optional reference log-probs, ``[N, L]`` each.
        group_std: reward std of every group id present in ``batch`` (the bucketing score).
        algo: loss settings (clip, ``loss_agg_mode``, coefficients, KL type) as in training.
        micro_batch_size: rows per forward pass (≥ 1); results do not depend on it.
        temperature: logits temperature, as in training.
        num_buckets, bucket_mode: passed to ``assign_buckets``.
        prefix: metric namespace; ``"grad_norm"`` also mirrors ``all`` to ``actor/grad_norm/*``, ``actor/loss/*``.
        sketch_dim: count-sketch size (0 = no sketches); sketch_seed: its projection seed.
        keep_gradients: also return the full flat gradients (for tests and offline cosines).
        component_advantages: reward component name -> ``[N, L]`` advantages of that component alone; adds the
            ``reward_grad`` metrics (prefix ``grad_norm`` -> ``reward_grad``).
        component_weights: weight of each component in the trained reward (default 1).
        terms: which of the loss terms task / entropy / kl to differentiate (kl needs reference log-probs);
            without ``task`` there are no RAGEN norms of it and no ``reward_grad`` cosines with the total.
        zero_bucket: zero-variance groups form ``bucket_0`` and ties stay together (``assign_buckets``).
        per_group: compute every group's gradient alone (``group_norms``) and, with ``resamples`` > 0, bootstrap
            intervals over groups (``<bucket>/<metric>/ci_low|ci_high``; seeded with ``sketch_seed``).

    Returns:
        A :class:`ProbeResult`; empty when the batch has no rows.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices, device_type="cuda"):  # dropout draws are undone on return
        return _probe(model, batch, inputs, group_std, algo=algo, micro_batch_size=micro_batch_size,
                      temperature=temperature, num_buckets=num_buckets, bucket_mode=bucket_mode, prefix=prefix,
                      sketch_dim=sketch_dim, sketch_seed=sketch_seed, keep_gradients=keep_gradients,
                      components=component_advantages or {}, weights=component_weights or {}, terms=terms,
                      zero_bucket=zero_bucket, per_group=per_group, resamples=resamples)


def _probe(model, batch, inputs, group_std, *, algo, micro_batch_size, temperature, num_buckets, bucket_mode,
           prefix, sketch_dim, sketch_seed, keep_gradients, components, weights, terms, zero_bucket, per_group,
           resamples) -> ProbeResult:
    """Body of :func:`gradient_probe` (runs inside a forked RNG)."""
    stds = present_groups(batch, group_std)
    if not stds:
        return ProbeResult(metrics={}, groups=[], sketches={})
    gids = sorted(stds)
    scores = torch.tensor([stds[g] for g in gids], dtype=torch.float64)  # [G]
    split = assign_buckets(scores, mode=bucket_mode, num_buckets=num_buckets, zero_bucket=zero_bucket)
    named = [(bucket_name(k, zero_bucket), [gids[i] for i in idx]) for k, idx in enumerate(split) if idx]
    buckets = [groups for _, groups in named]
    params = [p for p in model.parameters() if p.requires_grad]
    sketcher = GradientSketcher([p.shape for p in params], sketch_dim, sketch_seed) if sketch_dim > 0 else None
    names = [n for n, c in COMPONENT_OF_TERM.items() if c in terms and (n != "kl" or inputs.ref_logprobs is not None)]
    names += [f"reward/{k}" for k in components]
    groups_of_params = layer_groups([n for n, p in model.named_parameters() if p.requires_grad],
                                    [p.numel() for p in params])
    bucket_rows = [torch.isin(batch.group_ids, torch.tensor(b)).nonzero().squeeze(1) for b in buckets]  # B x [n_b]
    shares = bucket_shares(batch.response_mask, bucket_rows, algo.loss_agg_mode)
    total_rows = global_sum([float(len(batch))])[0]
    all_grads = {n: _zeros(params) for n in names}  # name -> [P]
    all_losses = dict.fromkeys(names, 0.0)
    result = ProbeResult(metrics={}, groups=[], sketches={})
    per_bucket: dict[str, dict[str, float]] = {}
    per_bucket_rg: dict[str, dict[str, float]] = {}
    kwargs = dict(names=names, components=components, micro_batch_size=micro_batch_size, temperature=temperature)
    if per_group and distributed():
        raise ValueError("the per-group analysis (analysis.per_group) runs in one process only")
    for k, ((name, groups), rows, share) in enumerate(zip(named, bucket_rows, shares, strict=True)):
        if per_group:
            grads, losses, singles = _group_gradients(model, batch, rows, inputs, algo, params, **kwargs)
        else:
            grads, losses = _bucket_gradients(model, batch, rows, inputs, algo, params, **kwargs)
        for n in names:
            all_grads[n].add_(grads[n], alpha=share)  # [P]
            all_losses[n] += share * losses[n]
        count, tokens = global_sum([float(rows.numel()), float(batch.response_mask[rows].sum())])
        per_bucket[name] = _bucket_metrics(grads, losses, algo, count=count, tokens=tokens, total_rows=total_rows,
                                           stds=[stds[g] for g in groups])
        if per_group:
            _group_results(result, name, per_bucket[name], singles, stds, algo, resamples, sketch_seed + k)
            del singles
        _reward_grad(result, per_bucket_rg, name, grads, components, weights, groups_of_params)
        _record(result, name, grads, sketcher, keep_gradients)
        result.groups.extend((name, g, stds[g]) for g in groups)
        del grads  # free this bucket's vectors before the next bucket allocates its own
    tokens = global_sum([float(batch.response_mask.sum())])[0]
    all_metrics = _bucket_metrics(all_grads, all_losses, algo, count=total_rows, tokens=tokens,
                                  total_rows=total_rows, stds=[stds[g] for g in gids])
    _record(result, "all", all_grads, sketcher, keep_gradients)
    _reward_grad(result, per_bucket_rg, "all", all_grads, components, weights, groups_of_params)
    for bucket, values in {"all": all_metrics, **per_bucket}.items():
        result.metrics.update({f"{prefix}/{bucket}/{key}": v for key, v in values.items()})
    rg_prefix = prefix.replace("grad_norm", "reward_grad")
    for bucket in ("all", *per_bucket):
        result.metrics.update({f"{rg_prefix}/{bucket}/{key}": v for key, v in per_bucket_rg.get(bucket, {}).items()})
    if prefix == "grad_norm":
        result.metrics.update(_actor_mirror(all_metrics))
    return result


def _bucket_gradients(model, batch: RolloutBatch, rows: torch.Tensor, inputs: ActorInputs, algo: AlgoConfig,
                      params: list[torch.Tensor], *, names: list[str], components: dict[str, torch.Tensor],
                      micro_batch_size: int, temperature: float) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Signed, unweighted gradient ``[P]`` and unweighted loss value of each term over the bucket ``rows``.

    One forward per micro-batch; every term is differentiated from the same graph and scaled by the
    micro-batch's share of the bucket's aggregation weight (all-reduced over ranks when distributed).
    """
    signs = _term_signs(algo)
    grads = {n: _zeros(params) for n in names}  # name -> [P]
    views = {n: _param_views(grads[n], params) for n in names}
    losses = torch.zeros(len(names), dtype=torch.float64)  # [K]
    mask = batch.response_mask[rows]  # [n_b, L]
    chunks = micro_batches(torch.arange(rows.numel()), micro_batch_size)
    for positions, share in zip(chunks, chunk_shares(mask, chunks, algo.loss_agg_mode), strict=True):
        if share == 0.0:  # no response tokens: contributes nothing to the aggregated loss
            continue
        terms, _ = loss_terms(model, batch, rows[positions], inputs, algo, temperature=temperature,
                              component_advantages=components)
        for i, n in enumerate(names):
            losses[i] += share * terms[n].item()
            if not terms[n].requires_grad:
                continue
            parts = torch.autograd.grad(terms[n], params, retain_graph=i < len(names) - 1, allow_unused=True)
            for view, part in zip(views[n], parts, strict=True):
                if part is not None:
                    view.add_(part.float(), alpha=share * signs.get(n, 1.0))  # param shape (reward/*: +1)
    if distributed():
        for n in names:
            dist.all_reduce(grads[n], op=dist.ReduceOp.SUM)  # [P]
        losses = torch.tensor(global_sum(losses.tolist()), dtype=torch.float64)  # [K]
    return grads, dict(zip(names, losses.tolist(), strict=True))


def _bucket_metrics(grads: dict[str, torch.Tensor], losses: dict[str, float], algo: AlgoConfig, *, count: float,
                    tokens: float, total_rows: float, stds: list[float]) -> dict[str, float]:
    """RAGEN-named metrics of one bucket from its signed raw gradients ``[P]`` and unweighted losses."""
    grads = {n: g for n, g in grads.items() if n in COMPONENT_OF_TERM}  # the reward components are reported apart
    coefs = term_coefs(algo)
    raw = {n: float(torch.linalg.vector_norm(g)) for n, g in grads.items()}
    out = _norm_metrics(grads, algo)
    for n in grads:
        comp = COMPONENT_OF_TERM[n]
        out[f"per_sample/{comp}"] = out[comp] / count if count > 0 else 0.0
        out[f"per_token/{comp}"] = out[comp] / tokens if tokens > 0 else 0.0
    for n in grads:
        out[f"loss/{LOSS_NAME_OF_TERM[n]}"] = coefs[n] * losses[n]
    out["loss/total"] = sum(coefs[n] * losses[n] for n in grads)
    out.update(sample_count=count, sample_pct=count / total_rows if total_rows > 0 else 0.0,
               reward_std_mean=sum(stds) / len(stds), reward_std_min=min(stds), reward_std_max=max(stds),
               group_rv_count=float(len(stds)))
    names = list(grads)
    zero = {n: numerically_zero(raw[n], raw.values()) for n in names}
    for n in names:
        out[f"zero_grad/{COMPONENT_OF_TERM[n]}"] = float(zero[n])
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            dot = float(torch.dot(grads[a], grads[b]))
            out[f"cos/{COMPONENT_OF_TERM[a]}_{COMPONENT_OF_TERM[b]}"] = (
                math.nan if zero[a] or zero[b] else dot / (raw[a] * raw[b]))  # undefined for a zero vector
    return out


def numerically_zero(norm: float, norms, rel_tol: float = ZERO_REL_TOL) -> bool:
    """True when a raw gradient norm is 0 or at float rounding level: at most `rel_tol` × the largest raw norm of
    the bucket's terms (`norms`). The k3 KL gradient at π = π_ref is 0 in exact arithmetic, but the probe's
    forward and the reference pass round differently, which leaves a gradient ~1e-7 of the others (a noise
    direction whose cosines mean nothing)."""
    return norm == 0.0 or norm <= rel_tol * max(norms)


def _norm_metrics(grads: dict[str, torch.Tensor], algo: AlgoConfig) -> dict[str, float]:
    """The norms of signed raw gradients ``[P]`` (pg / entropy / kl): ``task``, ``entropy``, ``kl``
    (coefficient-weighted), ``raw/entropy``, ``raw/kl``, and with pg ``regularizer`` and ``reg_share``."""
    scale = _term_scales(algo)
    out: dict[str, float] = {}
    for n, g in grads.items():
        raw = float(torch.linalg.vector_norm(g))
        out[COMPONENT_OF_TERM[n]] = scale[n] * raw
        if n != "pg":
            out[f"raw/{COMPONENT_OF_TERM[n]}"] = raw
    if "pg" in grads:
        reg = sum(scale[n] * g for n, g in grads.items() if n != "pg")  # [P]
        out["regularizer"] = float(torch.linalg.vector_norm(reg)) if isinstance(reg, torch.Tensor) else 0.0
        denom = out["task"] + out["regularizer"]
        out["reg_share"] = out["regularizer"] / denom if denom > 0 else math.nan  # 0/0: both gradients are zero
    return out


def _term_scales(algo: AlgoConfig) -> dict[str, float]:
    """Magnitude of each signed term's coefficient in the loss: pg 1, entropy ``entropy_coef``, kl ``kl_coef``."""
    coefs, signs = term_coefs(algo), _term_signs(algo)
    return {n: coefs[n] * signs[n] for n in coefs}


@dataclass
class _GroupGradient:
    """One group's gradients (signed, unweighted ``[P]`` per term) and its place in its bucket."""

    group_id: int
    share: float
    rows: int
    tokens: float
    grads: dict[str, torch.Tensor]


def _group_gradients(model, batch: RolloutBatch, rows: torch.Tensor, inputs: ActorInputs, algo: AlgoConfig,
                     params: list[torch.Tensor], **kwargs) -> tuple[dict[str, torch.Tensor], dict[str, float],
                                                                    list[_GroupGradient]]:
    """The bucket ``rows``' gradients and losses as the share-weighted sum of its groups' own, and the groups'.

    ``g_b = Σ_j s_j g_j`` with ``s_j = sub_batch_share(bucket mask, rows of group j)``: exact in every
    ``loss_agg_mode``, as ``all`` is exact from the buckets. kwargs: those of ``_bucket_gradients``.
    """
    names = kwargs["names"]
    grads = {n: _zeros(params) for n in names}  # name -> [P]
    losses = dict.fromkeys(names, 0.0)
    mask = batch.response_mask[rows]  # [n_b, L]
    bucket_gids = batch.group_ids[rows]  # [n_b]
    singles = []
    for gid in sorted(set(bucket_gids.tolist())):
        positions = (bucket_gids == gid).nonzero().squeeze(1)  # [n_j]
        share = sub_batch_share(mask, positions, algo.loss_agg_mode)
        g_j, l_j = _bucket_gradients(model, batch, rows[positions], inputs, algo, params, **kwargs)
        for n in names:
            grads[n].add_(g_j[n], alpha=share)  # [P]
            losses[n] += share * l_j[n]
        singles.append(_GroupGradient(gid, share, int(positions.numel()), float(mask[positions].sum()),
                                      {n: g for n, g in g_j.items() if n in COMPONENT_OF_TERM}))
    return grads, losses, singles


def _group_results(result: ProbeResult, bucket: str, metrics: dict[str, float], singles: list[_GroupGradient],
                   stds: dict[int, float], algo: AlgoConfig, resamples: int, seed: int) -> None:
    """Per-group norms into ``result.group_norms`` and the bucket's bootstrap intervals into ``metrics``."""
    for single in singles:
        result.group_norms[single.group_id] = {"share": single.share, "rows": float(single.rows),
                                               "tokens": single.tokens, **_norm_metrics(single.grads, algo)}
    if resamples < 2 or not singles or not singles[0].grads:
        return
    names = list(singles[0].grads)
    stacked = {n: torch.stack([single.grads[n] for single in singles]) for n in names}  # name -> [m, P]
    shares = torch.tensor([single.share for single in singles], dtype=torch.float64)  # [m]
    metrics.update(bootstrap.bucket_intervals(shares, stacked, _term_scales(algo), metrics,
                                              normalised=algo.loss_agg_mode != "seq-mean-token-sum-norm",
                                              resamples=resamples, seed=seed))


def _reward_grad(result: ProbeResult, metrics: dict[str, dict[str, float]], bucket: str,
                 grads: dict[str, torch.Tensor], components: dict[str, torch.Tensor], weights: dict[str, float],
                 groups: dict[str, list[tuple[int, int]]]) -> None:
    """The reward-component metrics and matrices of one bucket (nothing without components)."""
    if not components:
        return
    comp = {k: grads[f"reward/{k}"] for k in components}
    metrics[bucket], result.reward_grad[bucket] = reward_grad_metrics(
        comp, grads.get("pg"), {k: weights.get(k, 1.0) for k in components}, groups)


def _actor_mirror(all_metrics: dict[str, float]) -> dict[str, float]:
    """RAGEN's root copies of the ``all`` bucket: ``actor/grad_norm/*`` and ``actor/loss/*``."""
    keys = [k for k in ("task", "entropy", "kl") if k in all_metrics]
    out = {f"actor/grad_norm/{k}": all_metrics[k] for k in keys}
    out.update({f"actor/{k}": v for k, v in all_metrics.items() if k.startswith("loss/")})
    return out


def _record(result: ProbeResult, bucket: str, grads: dict[str, torch.Tensor], sketcher: GradientSketcher | None,
            keep_gradients: bool) -> None:
    """Store the sketches (and, if asked, copies) of one bucket's component gradients."""
    for n, g in grads.items():
        key = f"{bucket}/{COMPONENT_OF_TERM.get(n, n)}"
        if sketcher is not None:
            result.sketches[key] = sketcher.sketch(g).cpu()  # [dim]
        if keep_gradients:
            result.gradients[key] = g.detach().cpu().clone()  # [P]


def _term_signs(algo: AlgoConfig) -> dict[str, float]:
    """Sign with which each unweighted term enters the training loss (+pg, −entropy, +kl), from `term_coefs`."""
    unit = term_coefs(dataclasses.replace(algo, entropy_coef=1.0, kl_coef=1.0))
    return {n: math.copysign(1.0, c) for n, c in unit.items()}


def _zeros(params: list[torch.Tensor]) -> torch.Tensor:
    """A flat float32 zero vector with one slot per trainable parameter entry. [P]"""
    device = params[0].device if params else torch.device("cpu")
    return torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=device)  # [P]


def _param_views(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like each parameter (writing a view writes ``flat``)."""
    parts = flat.split([p.numel() for p in params])  # one [n_i] view per parameter
    return [part.view(p.shape) for part, p in zip(parts, params, strict=True)]
