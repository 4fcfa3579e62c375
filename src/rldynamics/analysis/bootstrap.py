"""Bootstrap confidence intervals over groups for bucket gradient norms, from per-group Gram matrices.

A bucket's gradient is the share-weighted sum of its groups' gradients, ``g = Σ_j s_j g_j`` (``s_j``: the group's
share of the bucket's aggregation weight, ``sub_batch_share``). Resampling the bucket's m groups with replacement
(counts ``c_j``) gives the gradient of a batch made of the resampled groups, aggregated the same way:

    g* = Σ_j v_j g_j,   v_j = c_j s_j / Σ_k c_k s_k      (every mode that normalises by the batch: token-mean,
                                                          seq-mean-token-mean, seq-mean-token-sum)
    v_j = c_j s_j                                        (seq-mean-token-sum-norm: a fixed normaliser)

so ``‖g*‖² = vᵀ G v`` with the Gram matrix ``G_jk = ⟨g_j, g_k⟩``. With several components (task, entropy, KL)
and the coefficients ``a`` of a combination (the regulariser ``−β·∇H + α·∇KL``), ``‖Σ_c a_c g*_c‖² =
Σ_{c,d} a_c a_d vᵀ G_cd v``. A resample therefore costs a few small matrix products: no backward pass, no
gradient vector, exact (not a sketch estimate).

The interval is the normal bootstrap interval ``θ̂ ± z·SE``, SE the standard deviation of the resampled statistic,
z = 1.96 (95 %), clamped to the statistic's range. Not the percentile interval: a norm of a sum of noisy vectors
is biased upward under resampling (``E‖g*‖² = ‖g‖² + noise/m``), so resampled norms sit above the estimate and a
percentile interval can exclude the very value it qualifies when the groups' gradients point in different
directions (as they do for the groups of one bucket). The SE says how much a bucket's norm moves when other
groups of the same kind are drawn, which is what tells a real difference between buckets from noise.
Resampling is seeded (``torch.Generator``), so the same inputs give the same interval on every run.
"""

from __future__ import annotations

import math

import torch

RESAMPLES = 1000
Z_95 = 1.959963984540054  # two-sided 95 % normal quantile


def resample_counts(num_groups: int, resamples: int, generator: torch.Generator) -> torch.Tensor:
    """How often each of ``num_groups`` groups is drawn in each resample (m draws with replacement). [R, m]"""
    draws = torch.randint(0, num_groups, (resamples, num_groups), generator=generator)  # [R, m]
    counts = torch.zeros(resamples, num_groups, dtype=torch.float64)  # [R, m]
    return counts.scatter_add_(1, draws, torch.ones_like(counts))  # [R, m]


def resample_weights(shares: torch.Tensor, counts: torch.Tensor, normalised: bool) -> torch.Tensor:
    """Weight of each group's gradient in each resampled bucket gradient (module docstring). [R, m]

    Args:
        shares: ``[m]`` each group's share of the bucket (``g = Σ_j shares_j g_j``); 0 for a group without tokens.
        counts: ``[R, m]`` draws per group (``resample_counts``).
        normalised: whether the aggregation divides by the batch's own size (every mode but
            seq-mean-token-sum-norm). A resample that drew only groups without tokens gets zero weights.
    """
    raw = counts * shares.to(torch.float64)[None, :]  # [R, m]
    if not normalised:
        return raw
    total = raw.sum(dim=1, keepdim=True)  # [R, 1]
    return torch.where(total > 0, raw / total.clamp_min(1e-300), torch.zeros_like(raw))  # [R, m]


def combined_norms(weights: torch.Tensor, gram: torch.Tensor, coefs: torch.Tensor) -> torch.Tensor:
    """``‖Σ_c coefs_c Σ_j weights_j g_cj‖`` for every row of ``weights``. [R]

    Args:
        weights: ``[R, m]`` group weights of each resample (or ``[1, m]``: the bucket's own shares).
        gram: ``[K, K, m, m]`` inner products ``⟨g_cj, g_dk⟩`` of the components' per-group gradients.
        coefs: ``[K]`` coefficient of each component in the combination (one-hot: a single component).
    """
    mixed = torch.einsum("c,d,cdjk->jk", coefs.to(torch.float64), coefs.to(torch.float64),
                         gram.to(torch.float64))  # [m, m]
    squared = torch.einsum("rj,jk,rk->r", weights, mixed, weights)  # [R]
    return squared.clamp_min(0.0).sqrt()  # [R] (rounding can push a zero norm's square below 0)


def normal_interval(point: float, samples: torch.Tensor, low: float = 0.0,
                    high: float = math.inf) -> tuple[float, float]:
    """``point ± Z_95 · std(samples)`` clamped to ``[low, high]``; nan when ``point`` or every sample is nan.

    Args:
        point: the statistic on the groups as drawn.
        samples: ``[R]`` the statistic on each resample (nan resamples, e.g. 0/0 ratios, are left out).
    """
    finite = samples[torch.isfinite(samples)]  # [R']
    if not math.isfinite(point) or finite.numel() < 2:
        return (math.nan, math.nan) if not math.isfinite(point) else (point, point)
    half = Z_95 * float(finite.std(unbiased=True))
    return max(low, point - half), min(high, point + half)


def bucket_intervals(shares: torch.Tensor, gram: torch.Tensor, names: list[str], scales: dict[str, float],
                     point: dict[str, float], *, normalised: bool, resamples: int = RESAMPLES,
                     seed: int = 0) -> dict[str, float]:
    """95 % bootstrap intervals over a bucket's groups of its norms and of ``reg_share`` (module docstring).

    Args:
        shares: ``[m]`` each group's share of the bucket gradient.
        gram: ``[K, K, m, m]`` inner products of the terms' signed, unweighted per-group gradients
            (``analysis.gram.group_gram``).
        names: the K terms (``pg``, ``entropy``, ``kl``; any subset), in the order of ``gram``.
        scales: term -> the coefficient magnitude it enters the loss with (pg 1, entropy ``entropy_coef``, ...).
        point: the bucket's own metrics (``task``, ``entropy``, ``raw/entropy``, ``regularizer``, ``reg_share``, ...).
        normalised: ``resample_weights``'s flag. resamples: R ≥ 2. seed: the resampling seed.

    Returns:
        ``<metric>/ci_low`` and ``<metric>/ci_high`` for each of ``task``, ``entropy``, ``kl``, ``raw/entropy``,
        ``raw/kl``, ``regularizer``, ``reg_share`` present in ``point``; nan for a bucket of fewer than 2 groups
        (one group gives no spread to resample).
    """
    m = int(shares.numel())
    counts = resample_counts(m, resamples, torch.Generator().manual_seed(seed))  # [R, m]
    weights = resample_weights(shares, counts, normalised)  # [R, m]

    def norms(coefs: dict[str, float]) -> torch.Tensor:  # [R]
        return combined_norms(weights, gram, torch.tensor([coefs.get(n, 0.0) for n in names]))

    component = {"pg": "task", "entropy": "entropy", "kl": "kl"}
    samples = {component[n]: norms({n: scales[n]}) for n in names}
    samples.update({f"raw/{component[n]}": norms({n: 1.0}) for n in names if n != "pg"})
    if "pg" in names:
        samples["regularizer"] = norms({n: scales[n] for n in names if n != "pg"})
        samples["reg_share"] = samples["regularizer"] / (samples["task"] + samples["regularizer"])  # [R]; 0/0: nan
    out = {}
    for key, values in samples.items():
        if key not in point:
            continue
        high = 1.0 if key == "reg_share" else math.inf
        low_high = normal_interval(point[key], values, 0.0, high) if m >= 2 else (math.nan, math.nan)
        out[f"{key}/ci_low"], out[f"{key}/ci_high"] = low_high
    return out
