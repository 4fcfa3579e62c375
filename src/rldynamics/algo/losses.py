"""Token-level losses and the one reduction helper they all share.

Design choices:
- Every loss builds a per-token matrix ``[N, T]`` and reduces it with :func:`aggregate`; no loss
  reduces on its own. :func:`aggregate` is defined as ``(values * aggregation_weights(mask, mode)).sum()``,
  so the loss is exactly linear in the per-token values and gradients of disjoint token subsets
  (e.g. variance buckets) add up to the gradient of the whole batch.
- Positions outside the mask never reach the result, even when they hold inf/nan: values are
  selected with ``torch.where`` rather than multiplied by the mask.
- Losses return ``(loss, metrics)`` where metrics are python floats computed without gradient.
- Pure functions of tensors, scalars and :class:`PolicyLossSettings` (plain values, built once per update from
  the config by ``analysis.objective.policy_loss_settings``): no config objects, no models, no loggers.
- Each policy-loss kind is one function of one signature in :data:`POLICY_LOSSES` (``algo.policy_loss``'s
  choices): it returns the per-token loss matrix, and :func:`policy_loss` weights and reduces it.

Formulas follow the PPO/verl conventions summarised in ``docs/reference/ragen_behaviour.md`` §4 and
``docs/reference/peer_systems.md`` D.2-D.5.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
_EPS = 1e-8


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless all keyword tensors have the same shape.

    Args:
        **tensors: name -> tensor; the names appear in the error message.
    """
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listing = ", ".join(f"{name}={shape}" for name, shape in shapes.items())
        raise ValueError(f"shape mismatch: expected equal shapes, got {listing}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is set.

    Args:
        values: any shape.
        mask: same shape as ``values``, bool or {0, 1} float.
        dim: reduce only this dimension; ``None`` reduces everything.

    Returns:
        ``Σ(v·m) / (Σm + 1e-8)`` along ``dim`` (a scalar when ``dim`` is None); 0 where the mask is empty.
    """
    check_same_shape(values=values, mask=mask)
    keep = mask.bool()  # same shape as values
    picked = torch.where(keep, values, torch.zeros_like(values))  # same shape as values
    if dim is None:
        return picked.sum() / (keep.sum() + _EPS)  # []
    return picked.sum(dim) / (keep.sum(dim) + _EPS)  # values.shape without dim


def aggregation_weights(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Per-token weights ``w`` such that ``aggregate(v, mask, mode) == (v * w).sum()`` for every finite ``v``.

    Args:
        mask: ``[N, T]`` bool or {0, 1} float.
        mode: one of :data:`AGG_MODES`.

    Returns:
        ``[N, T]`` float32 weights, zero outside the mask:
        token-mean ``m / (Σm + 1e-8)``; seq-mean-token-mean ``m / (Σ_t m + 1e-8) / S``;
        seq-mean-token-sum ``m / S``; seq-mean-token-sum-norm ``m / T``; S = #sequences with ≥ 1 token
        (clamped to ≥ 1 so an all-empty batch gives a zero loss).
    """
    if mode not in AGG_MODES:
        raise ValueError(f"agg mode must be one of {AGG_MODES}, got {mode!r}")
    if mask.dim() != 2:
        raise ValueError(f"mask must be [N, T], got shape {tuple(mask.shape)}")
    m = mask.bool().float()  # [N, T]
    seq_tokens = m.sum(-1, keepdim=True)  # [N, 1]
    num_seqs = (seq_tokens > 0).sum().clamp_min(1)  # []
    if mode == "token-mean":
        return m / (m.sum() + _EPS)  # [N, T]
    if mode == "seq-mean-token-mean":
        return m / (seq_tokens + _EPS) / num_seqs  # [N, T]
    if mode == "seq-mean-token-sum":
        return m / num_seqs  # [N, T]
    return m / m.shape[-1]  # [N, T]  seq-mean-token-sum-norm (Dr. GRPO: fixed length normaliser)


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduce a per-token loss matrix to a scalar.

    Args:
        values: ``[N, T]`` per-token losses.
        mask: ``[N, T]`` bool or {0, 1} float.
        mode: token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm.

    Returns:
        Scalar tensor ``Σ v·w`` with ``w = aggregation_weights(mask, mode)``, in at least float32.
    """
    check_same_shape(values=values, mask=mask)
    # Reduce in at least float32: bf16 weights like 1/Σm would carry only ~3 significant digits.
    dtype = torch.promote_types(values.dtype, torch.float32)
    weights = aggregation_weights(mask, mode).to(dtype)  # [N, T]
    picked = torch.where(mask.bool(), values, torch.zeros_like(values)).to(dtype)  # [N, T]
    return (picked * weights).sum()  # []


def _metric(flags: torch.Tensor, mask: torch.Tensor) -> float:
    """Masked mean of a boolean/float matrix as a python float."""
    return float(masked_mean(flags.float(), mask))


@dataclass(frozen=True)
class PolicyLossSettings:
    """Every setting of the actor loss (:func:`loss_terms`, :func:`policy_loss`), as plain values.

    Built once per update or probe from ``algo.*`` (``analysis.objective.policy_loss_settings``); the defaults are
    the config's. The policy-loss fields are checked here, ``agg`` by :func:`aggregate`, ``kl_type`` by
    :func:`kl_penalty`, ``tis_cap`` / ``mis_band`` by :func:`rollout_correction_weights`.
    """

    kind: str = "ppo"  # a key of POLICY_LOSSES: ppo (dual clip when clip_c is set) | cispo | is (unclipped)
    old_from: str = "trainer"  # π_old of the ratio: trainer (its log-probs before the update) | sampler (the
    # rollout's sampling log-probs: the ratio then spans the sampler's lag, and TIS / MIS have nothing to correct)
    clip_low: float = 0.2  # ppo: ratio >= 1 - clip_low, in [0, 1) (cispo ignores it)
    clip_high: float = 0.28  # >= 0. ppo: ratio <= 1 + clip_high; cispo: the IS weight's cap 1 + clip_high
    clip_c: float | None = 3.0  # ppo dual clip: a token with A < 0 loses at most -A·clip_c; > 1, None = off
    cispo_clip_low: float | None = None  # cispo: IS weight >= 1 - cispo_clip_low, in [0, 1]; None = no lower bound
    agg: str = "token-mean"  # how every term reduces its [N, T] matrix: one of AGG_MODES (aggregate)
    kl_type: str = "low_var_kl"  # the kl term's per-token estimator: one of KL_KINDS (kl_penalty)
    entropy_coef: float = 0.001  # weight of the entropy bonus in the training loss (term_coefs)
    kl_coef: float = 0.0  # weight of the kl term in the training loss (term_coefs)
    tis_cap: float | None = None  # TIS: each token's pg loss times min(π_old / π_rollout, tis_cap); > 0, None = off
    mis_band: float | None = None  # MIS: a sequence whose geometric-mean π_old / π_rollout leaves
    # [1 / mis_band, mis_band] drops out of the pg loss; > 1, None = off

    def __post_init__(self) -> None:
        if self.kind not in POLICY_LOSSES:
            raise ValueError(f"kind must be one of {tuple(POLICY_LOSSES)}, got {self.kind!r}")
        if self.old_from not in ("trainer", "sampler"):
            raise ValueError(f"old_from must be trainer or sampler, got {self.old_from!r}")
        if not 0.0 <= self.clip_low < 1.0 or self.clip_high < 0.0:
            raise ValueError(f"clip_low must be in [0, 1) and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if self.clip_c is not None and self.clip_c <= 1.0:
            raise ValueError(f"clip_c must be > 1 or None, got {self.clip_c}")
        if self.cispo_clip_low is not None and not 0.0 <= self.cispo_clip_low <= 1.0:
            raise ValueError(f"cispo_clip_low must be in [0, 1] or None, got {self.cispo_clip_low}")

    @property
    def coefs(self) -> dict[str, float]:
        """The coefficient of each term of :func:`loss_terms` in the training loss (:func:`term_coefs`)."""
        return term_coefs(self.entropy_coef, self.kl_coef)


def ppo_token_loss(logprobs: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                   settings: PolicyLossSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """Dual-clip PPO (https://arxiv.org/abs/1912.09729) with asymmetric "clip-higher" bounds, per token.

    ``L = max(-A·r, -A·clip(r, 1-clip_low, 1+clip_high))`` and, for A < 0 when ``clip_c`` is set,
    ``min(L, -A·clip_c)``. The gradient flows through ``r`` (``logprobs`` itself is unused).

    Args:
        logprobs, ratio, advantages, response_mask: ``[N, T]`` each; ``ratio`` = π / π_old (carries the gradient).
        settings: reads ``clip_low``, ``clip_high``, ``clip_c``.

    Returns:
        ``(per-token loss [N, T], {"pg_clipfrac", "pg_clipfrac_lower"})``, the metrics masked token means.
    """
    clipped = ratio.clamp(1.0 - settings.clip_low, 1.0 + settings.clip_high)  # [N, T]
    unclipped_loss = -advantages * ratio  # [N, T]
    clipped_loss = -advantages * clipped  # [N, T]
    per_token = torch.maximum(unclipped_loss, clipped_loss)  # [N, T]
    lower = torch.zeros_like(per_token, dtype=torch.bool)  # [N, T]
    if settings.clip_c is not None:
        dual_bound = -advantages * settings.clip_c  # [N, T]
        lower = (per_token > dual_bound) & (advantages < 0)  # [N, T]
        per_token = torch.where(advantages < 0, torch.minimum(per_token, dual_bound), per_token)  # [N, T]
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": _metric(clipped_loss > unclipped_loss, response_mask),
            "pg_clipfrac_lower": _metric(lower, response_mask),
        }
    return per_token, metrics  # [N, T]


def cispo_token_loss(logprobs: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                     settings: PolicyLossSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (https://arxiv.org/abs/2506.13585, as published and as in TRL), per token.

    ``L = -sg(min(r, 1+clip_high))·A·logπ``: no gradient flows through the ratio and the IS weight is bounded only
    from above; ``cispo_clip_low`` adds the lower bound ``1-cispo_clip_low``.

    Args:
        logprobs: ``[N, T]`` current-policy log-probs (carries the gradient).
        ratio, advantages, response_mask: ``[N, T]`` each; ``ratio`` = π / π_old.
        settings: reads ``clip_high``, ``cispo_clip_low``.

    Returns:
        ``(per-token loss [N, T], {"pg_clipfrac", "pg_clipfrac_lower"})``: the share of tokens whose IS weight is
        clipped, and 0.
    """
    low = None if settings.cispo_clip_low is None else 1.0 - settings.cispo_clip_low
    weight = ratio.clamp(low, 1.0 + settings.clip_high)  # [N, T] the IS weight
    per_token = -weight.detach() * advantages * logprobs  # [N, T]
    with torch.no_grad():
        clipfrac = _metric(ratio != weight, response_mask)
    return per_token, {"pg_clipfrac": clipfrac, "pg_clipfrac_lower": 0.0}  # [N, T]


def is_token_loss(logprobs: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                  settings: PolicyLossSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """Unclipped importance sampling (tinker's ``importance_sampling`` loss), per token: ``L = -r·A``, so the
    gradient is ``-r·A·∇logπ`` with no bound on the ratio (``settings`` is not read).

    Args:
        logprobs, ratio, advantages, response_mask: ``[N, T]`` each; ``ratio`` = π / π_old (carries the gradient).

    Returns:
        ``(per-token loss [N, T], {"pg_clipfrac": 0, "pg_clipfrac_lower": 0})``.
    """
    return -advantages * ratio, {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0}  # [N, T]


PolicyTokenLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PolicyLossSettings],
                           tuple[torch.Tensor, dict[str, float]]]
POLICY_LOSSES: dict[str, PolicyTokenLoss] = {"ppo": ppo_token_loss, "cispo": cispo_token_loss,
                                              "is": is_token_loss}  # algo.policy_loss


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    settings: PolicyLossSettings,
    *,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss of kind ``settings.kind`` (:data:`POLICY_LOSSES`), reduced with ``settings.agg``.

    ``r = exp(clamp(logπ - logπ_old, -20, 20))``; the kind's per-token loss times ``token_weights`` is aggregated.

    Args:
        logprobs: ``[N, T]`` current-policy token log-probs (carries the gradient).
        old_logprobs: ``[N, T]`` behaviour-policy log-probs.
        advantages: ``[N, T]``.
        response_mask: ``[N, T]`` tokens that are trained on.
        settings: the kind, its clip settings and ``agg`` (:class:`PolicyLossSettings`).
        token_weights: ``[N, T]`` constant factor on each token's loss (the rollout correction,
            :func:`rollout_correction_weights`), or ``None``.

    Returns:
        ``(loss [], metrics)`` with python floats ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``
        (token-level masked means, independent of ``agg``).
    """
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, response_mask=response_mask)
    log_ratio = logprobs - old_logprobs  # [N, T]
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))  # [N, T]
    ppo_kl = _metric(-log_ratio.detach(), response_mask)
    per_token, metrics = POLICY_LOSSES[settings.kind](logprobs, ratio, advantages, response_mask, settings)  # [N, T]
    loss = aggregate(_weighted(per_token, token_weights), response_mask, settings.agg)  # []
    return loss, {**metrics, "ppo_kl": ppo_kl}


def _weighted(per_token: torch.Tensor, token_weights: torch.Tensor | None) -> torch.Tensor:
    if token_weights is None:
        return per_token  # [N, T]
    check_same_shape(per_token=per_token, token_weights=token_weights)
    return per_token * token_weights.detach()  # [N, T]


def rollout_log_ratio(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor) -> torch.Tensor:
    """``log π_old - log π_rollout`` per token, clamped to ±20: the log of the importance ratio that turns the
    sampler's distribution into the trainer's. ``[N, T]``"""
    check_same_shape(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs)
    return (old_logprobs - rollout_logprobs).clamp(-20.0, 20.0)  # [N, T]


def sequence_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean of the token log-ratios over the mask: the log of the geometric-mean ratio. ``[N]``"""
    return masked_mean(log_ratio, response_mask, dim=-1)  # [N]


def rollout_correction_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    tis_cap: float | None = None,
    mis_band: float | None = None,
) -> torch.Tensor:
    """Per-token weights that correct for sampling from the rollout engine instead of the trainer's policy.

    TIS (truncated importance sampling; verl's token-level ``rollout_is``, TRL's ``token_truncate`` mode): each
    token's loss times ``min(π_old / π_rollout, tis_cap)``. MIS (sequence masking; verl's ``rollout_rs``,
    geometric, not TRL's ``sequence_mask``, which tests the product of the ratios): a sequence whose geometric-mean
    ratio ``exp(mean_t log(π_old / π_rollout))``
    lies outside ``[1 / mis_band, mis_band]`` gets weight 0 on every token (its aggregation weights stay, so a
    masked sequence lowers the loss rather than re-normalising it). Both off: all ones.

    Args:
        old_logprobs: ``[N, T]`` the trainer's log-probs of the sampled tokens (no gradient).
        rollout_logprobs: ``[N, T]`` the sampler's log-probs of the same tokens.
        response_mask: ``[N, T]``.
        tis_cap: C > 0, or None (no TIS).
        mis_band: B > 1, or None (no MIS).

    Returns:
        ``[N, T]`` float32 weights, no gradient.
    """
    check_same_shape(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, response_mask=response_mask)
    if tis_cap is not None and tis_cap <= 0:
        raise ValueError(f"tis_cap must be > 0 or None, got {tis_cap}")
    if mis_band is not None and mis_band <= 1:
        raise ValueError(f"mis_band must be > 1 or None, got {mis_band}")
    log_ratio = rollout_log_ratio(old_logprobs.detach().float(), rollout_logprobs.float())  # [N, T]
    weights = torch.ones_like(log_ratio)  # [N, T]
    if tis_cap is not None:
        weights = torch.exp(log_ratio).clamp(max=tis_cap)  # [N, T]
    if mis_band is not None:
        seq = sequence_log_ratio(log_ratio, response_mask)  # [N]
        keep = seq.abs() <= torch.log(torch.tensor(mis_band))  # [N]
        weights = weights * keep[:, None].float()  # [N, T]
    return weights  # [N, T]


def _kl_k1(diff: torch.Tensor) -> torch.Tensor:
    return diff  # [N, T]


def _kl_abs(diff: torch.Tensor) -> torch.Tensor:
    return diff.abs()  # [N, T]


def _kl_k2(diff: torch.Tensor) -> torch.Tensor:
    return 0.5 * diff.square()  # [N, T]


def _kl_k3(diff: torch.Tensor) -> torch.Tensor:
    d = (-diff).clamp(-20.0, 20.0)  # [N, T]  log(π_ref/π)
    return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)  # [N, T]


_KL_ESTIMATORS = {
    "k1": _kl_k1,
    "kl": _kl_k1,
    "abs": _kl_abs,
    "k2": _kl_k2,
    "mse": _kl_k2,
    "k3": _kl_k3,
    "low_var_kl": _kl_k3,
}
KL_KINDS: tuple[str, ...] = tuple(_KL_ESTIMATORS) + tuple(f"{name}+" for name in _KL_ESTIMATORS)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate between the current and the reference policy (http://joschu.net/blog/kl-approx.html).

    Args:
        logprobs: ``[N, T]`` current-policy log-probs.
        ref_logprobs: ``[N, T]`` reference-policy log-probs.
        kind: k1|kl (``logπ - logπ_ref``), abs, k2|mse (``½(logπ - logπ_ref)²``), k3|low_var_kl
            (``clamp(e^d - d - 1, ±10)`` with ``d = clamp(logπ_ref - logπ, ±20)``); a trailing ``+``
            keeps that forward value but takes the gradient of k2 (straight-through).

    Returns:
        ``[N, T]`` per-token penalty (not masked; aggregate it with the response mask).
    """
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    if kind not in KL_KINDS:
        raise ValueError(f"kl kind must be one of {KL_KINDS}, got {kind!r}")
    diff = logprobs - ref_logprobs  # [N, T]
    value = _KL_ESTIMATORS[kind.rstrip("+")](diff)  # [N, T]
    if not kind.endswith("+"):
        return value  # [N, T]
    k2 = _kl_k2(diff)  # [N, T]
    return k2 + (value - k2).detach()  # [N, T]  forward = value, backward = ∇k2


def loss_terms(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    settings: PolicyLossSettings,
    *,
    ref_logprobs: torch.Tensor | None = None,
    component_advantages: dict[str, torch.Tensor] | None = None,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The unweighted terms of the actor loss, each aggregated with ``settings.agg`` (``docs/design.md`` §4.1).

    Args:
        logprobs: ``[N, T]`` current-policy token log-probs (carries the gradient).
        entropy: ``[N, T]`` entropy of each predictive distribution (carries the gradient).
        old_logprobs: ``[N, T]`` the trainer's log-probs before the update; ``None`` = the update is on that
            policy itself, so ``logprobs`` detached stand in for them (ratio exactly 1). With
            ``settings.old_from == "sampler"`` the ratio's π_old is ``rollout_logprobs`` instead.
        advantages: ``[N, T]``.
        response_mask: ``[N, T]`` tokens that are trained on.
        settings: the policy loss (see :func:`policy_loss`), ``agg``, ``kl_type`` (see :func:`kl_penalty`) and the
            rollout corrections ``tis_cap`` / ``mis_band``.
        ref_logprobs: ``[N, T]`` reference-policy log-probs; gives the ``kl`` term.
        component_advantages: name -> ``[N, T]``: the pg loss with each named reward component's own advantages.
        rollout_logprobs: ``[N, T]`` the rollout engine's sampling log-probs; with ``tis_cap`` / ``mis_band``
            every policy-gradient term is weighted by :func:`rollout_correction_weights` (old vs rollout).

    Returns:
        ``({"pg", "entropy", "kl" (with a reference), "reward/<name>" per component}, pg metrics)``.
    """
    old = logprobs.detach() if old_logprobs is None else old_logprobs  # [N, T] the trainer's
    weights = _correction_weights(old, rollout_logprobs, response_mask, settings)  # [N, T] or None
    if settings.old_from == "sampler":
        if rollout_logprobs is None:
            raise ValueError("old_from='sampler' needs the rollout's sampling log-probs (rollout_logprobs)")
        old = rollout_logprobs  # [N, T]

    def pg_loss(adv: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        return policy_loss(logprobs, old, adv, response_mask, settings, token_weights=weights)

    pg, metrics = pg_loss(advantages)
    terms = {"pg": pg, "entropy": aggregate(entropy, response_mask, settings.agg)}
    if ref_logprobs is not None:
        terms["kl"] = aggregate(kl_penalty(logprobs, ref_logprobs, settings.kl_type), response_mask, settings.agg)
    for name, adv in (component_advantages or {}).items():
        terms[f"reward/{name}"] = pg_loss(adv)[0]
    return terms, metrics


def _correction_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor | None,
                        response_mask: torch.Tensor, settings: PolicyLossSettings) -> torch.Tensor | None:
    """:func:`rollout_correction_weights` ``[N, T]`` when TIS or MIS is on, else ``None``."""
    if settings.tis_cap is None and settings.mis_band is None:
        return None
    if rollout_logprobs is None:
        raise ValueError("tis_cap / mis_band need the rollout's sampling log-probs (rollout_logprobs)")
    return rollout_correction_weights(old_logprobs, rollout_logprobs, response_mask, tis_cap=settings.tis_cap,
                                      mis_band=settings.mis_band)  # [N, T]


def term_coefs(entropy_coef: float, kl_coef: float) -> dict[str, float]:
    """The coefficient of each term of :func:`loss_terms` in the training loss (entropy is a bonus, hence negative)."""
    return {"pg": 1.0, "entropy": -entropy_coef, "kl": kl_coef}


def weighted_total(terms: dict[str, torch.Tensor], coefs: dict[str, float]) -> torch.Tensor:
    """The training loss ``Σ coefs[name] · terms[name]`` (pg - entropy_coef·entropy + kl_coef·kl): formed here only.

    Terms with a zero coefficient are left out, so backward does not run through their graphs.
    """
    return sum(coefs[name] * value for name, value in terms.items() if coefs[name] != 0.0)  # pg always has 1


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` ``[..., V]``; at temperature 1 the logits themselves (dividing by 1 is exact), so the
    usual case spends no pass over the vocabulary on it, nor one in backward."""
    return logits if temperature == 1.0 else logits / temperature  # [..., V]


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """Entropy ``H = -Σ p·log p`` from log-probabilities ``[..., V]`` (a log-softmax), in their dtype: ``[...]``.

    Every term is non-negative, so a peaked distribution's small entropy carries no cancellation (``logsumexp(z) -
    Σ softmax(z)·z`` subtracts two numbers near ``max z``), and a caller that has the log-softmax already (the
    log-probs of the sampled tokens) pays one exp and one product over the vocabulary, not a second softmax.
    """
    return -(logp.exp() * logp).sum(-1)  # [...]


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_range: float = 0.5,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped critic loss ``½·agg(max((v - R)², (v_clip - R)²))``, ``v_clip = v_old + clamp(v - v_old, ±clip_range)``.

    Args:
        values: ``[N, T]`` current value predictions (carries the gradient).
        old_values: ``[N, T]`` predictions at rollout time.
        returns: ``[N, T]`` regression targets.
        response_mask: ``[N, T]``.
        clip_range: > 0.
        agg: aggregation mode, see :func:`aggregate`.

    Returns:
        ``(loss [], metrics)`` with python floats ``vf_clipfrac`` (share of tokens where the clipped
        term is larger) and ``vpred_mean`` (masked mean prediction).
    """
    check_same_shape(values=values, old_values=old_values, returns=returns, response_mask=response_mask)
    if clip_range <= 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
    clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)  # [N, T]
    unclipped_sq = (values - returns).square()  # [N, T]
    clipped_sq = (clipped_values - returns).square()  # [N, T]
    per_token = torch.maximum(unclipped_sq, clipped_sq)  # [N, T]
    with torch.no_grad():
        metrics = {
            "vf_clipfrac": _metric(clipped_sq > unclipped_sq, response_mask),
            "vpred_mean": _metric(values, response_mask),
        }
    return 0.5 * aggregate(per_token, response_mask, agg), metrics
