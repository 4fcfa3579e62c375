"""The probe's metrics from Gram matrices of signed raw gradients: norms, cosines, losses, shares (RAGEN's names).

Pure functions of inner products (``analysis/gram.py``); the engines that compute the gradients are in
``analysis/engines.py``. The code's term names (``pg``, ``entropy``, ``kl``) become RAGEN's component names
(``task``, ``entropy``, ``kl``) and loss names (``policy``, ...) here, where the keys are built
(``metric_names.TERM_COMPONENT`` / ``TERM_LOSS``).
"""

from __future__ import annotations

import math

import torch

from rldynamics.analysis.engines import term_signs
from rldynamics.analysis.gram import cosine, norm
from rldynamics.analysis.objective import policy_loss_settings
from rldynamics.config import AlgoConfig
from rldynamics.metric_names import LOSS_TOTAL, TERM_COMPONENT, TERM_LOSS, actor, actor_grad_norm, loss

ZERO_REL_TOL = 1e-5  # a raw gradient norm below this fraction of the bucket's largest is rounding noise (0)


def bucket_metrics(whole: torch.Tensor, names: list[str], losses: dict[str, float], algo: AlgoConfig, *,
                    count: float, tokens: float, total_rows: float, stds: list[float]) -> dict[str, float]:
    """RAGEN-named metrics of one bucket from the Gram matrix ``whole`` [K, K] of its signed raw gradients (terms
    ``names``) and its unweighted losses."""
    terms = [n for n in names if n in TERM_COMPONENT]  # the reward components are reported apart
    index = {n: names.index(n) for n in terms}
    weights = policy_loss_settings(algo).coefs
    out = norm_metrics(whole, index, algo)
    for n in terms:
        comp = TERM_COMPONENT[n]
        out[f"per_sample/{comp}"] = out[comp] / count if count > 0 else 0.0
        out[f"per_token/{comp}"] = out[comp] / tokens if tokens > 0 else 0.0
    for n in terms:
        out[loss(TERM_LOSS[n])] = weights[n] * losses[n]
    out[LOSS_TOTAL] = sum(weights[n] * losses[n] for n in terms)
    out.update(sample_count=count, sample_pct=count / total_rows if total_rows > 0 else 0.0,
               reward_std_mean=sum(stds) / len(stds), reward_std_min=min(stds), reward_std_max=max(stds),
               group_rv_count=float(len(stds)))
    raw = {n: norm(whole, unit(whole, index[n])) for n in terms}
    zero = {n: numerically_zero(raw[n], raw.values()) for n in terms}
    for n in terms:
        out[f"zero_grad/{TERM_COMPONENT[n]}"] = float(zero[n])
    for i, a in enumerate(terms):
        for b in terms[i + 1:]:  # undefined (NaN) for a zero vector
            out[f"cos/{TERM_COMPONENT[a]}_{TERM_COMPONENT[b]}"] = (
                math.nan if zero[a] or zero[b] else cosine(whole, index[a], index[b]))
    return out


def numerically_zero(value: float, norms, rel_tol: float = ZERO_REL_TOL) -> bool:
    """True when a raw gradient norm is 0 or at float rounding level: at most `rel_tol` × the largest raw norm of
    the bucket's terms (`norms`). The k3 KL gradient at π = π_ref is 0 in exact arithmetic, but the probe's
    forward and the reference pass round differently, which leaves a gradient ~1e-7 of the others (a noise
    direction whose cosines mean nothing)."""
    return value == 0.0 or value <= rel_tol * max(norms)


def norm_metrics(whole: torch.Tensor, index: dict[str, int], algo: AlgoConfig) -> dict[str, float]:
    """The norms of signed raw gradients (pg / entropy / kl at ``index`` of the Gram matrix ``whole`` [K, K]):
    ``task``, ``entropy``, ``kl`` (coefficient-weighted), ``raw/entropy``, ``raw/kl``, and with pg ``regularizer``
    and ``reg_share``."""
    scale = term_scales(algo)
    out: dict[str, float] = {}
    for n, i in index.items():
        raw = norm(whole, unit(whole, i))
        out[TERM_COMPONENT[n]] = scale[n] * raw
        if n != "pg":
            out[f"raw/{TERM_COMPONENT[n]}"] = raw
    if "pg" in index:
        reg = torch.zeros(whole.shape[0], dtype=torch.float64)  # [K]
        for n, i in index.items():
            if n != "pg":
                reg[i] = scale[n]
        out["regularizer"] = norm(whole, reg)
        denom = out["task"] + out["regularizer"]
        out["reg_share"] = out["regularizer"] / denom if denom > 0 else math.nan  # 0/0: both gradients are zero
    return out


def unit(whole: torch.Tensor, i: int) -> torch.Tensor:
    """The i-th unit vector of the Gram matrix's dimension. [K]"""
    return torch.nn.functional.one_hot(torch.tensor(i), whole.shape[0]).double()  # [K]


def term_scales(algo: AlgoConfig) -> dict[str, float]:
    """Magnitude of each signed term's coefficient in the loss: pg 1, entropy ``entropy_coef``, kl ``kl_coef``."""
    weights, signs = policy_loss_settings(algo).coefs, term_signs()
    return {n: weights[n] * signs[n] for n in weights}


def actor_mirror(all_metrics: dict[str, float]) -> dict[str, float]:
    """RAGEN's root copies of the ``all`` bucket: ``actor/grad_norm/*`` and ``actor/loss/*``."""
    keys = [k for k in ("task", "entropy", "kl") if k in all_metrics]
    out = {actor_grad_norm(k): all_metrics[k] for k in keys}
    out.update({actor(k): v for k, v in all_metrics.items() if k.startswith(loss(""))})
    return out
