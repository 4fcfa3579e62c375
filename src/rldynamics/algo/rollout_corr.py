"""The sampler/trainer mismatch: how far the rollout engine's probabilities are from the trainer's.

The rollout engine samples with its own kernels and precision (vLLM in bfloat16, say), so the policy that sampled
a token is not exactly the policy the trainer computes the old log-probs with, and the update is off-policy by
that much. `mismatch_metrics` compares, token by token, the sampler's log-prob of every sampled token
(`RolloutBatch.rollout_logprobs`, temperature applied) with the trainer's old log-prob of the same token, like with
like, and reports, under `rollout/corr/`, with ``r = π_old / π_rollout`` per token (its log clamped to ±20, as verl
clamps its weights) and the band B (`algo.mismatch_band`, in the role of verl's threshold, 1 / B its lower one):

verl's quantities under verl's `rollout_corr` names (its token-level `rollout_is` and geometric `rollout_rs`):
- `rollout_is_mean` / `_min` / `_max`: ``r`` over the sampled tokens;
- `kl`: the k1 estimate ``E[log π_rollout - log π_old]`` of KL(π_rollout || π_old) over the sampled tokens, and
  `k3_kl`: the k3 estimate ``E[r - 1 - log r]`` (non-negative per token);
- `rollout_is_ratio_fraction_high` / `_low`: the fraction of tokens with ``r > B`` / ``r < 1 / B``;
- `rollout_is_seq_fraction_high` / `_low`: the fraction of all rows whose arithmetic-mean ratio ``mean_t r`` is
  above B / below 1 / B; a row without sampled tokens counts, with mean 0 (so as low);
- with MIS on, `rollout_rs_masked_fraction`: the fraction of sampled tokens in masked sequences (token-weighted),
  and `rollout_rs_seq_masked_fraction`: masked sequences over all rows (a row without tokens is never masked).

Ours, under names verl does not use:
- `token_fraction_outside`: the two token fractions' sum;
- `seq_geo_fraction_high` / `_low` / `_outside`: the fraction of sequences with sampled tokens whose
  geometric-mean ratio ``exp(mean_t log r)`` (the quantity MIS tests) is above B / below 1 / B / either;
- with TIS on, `rollout_is_truncated_fraction`: tokens whose ratio TIS caps (``r > algo.tis_cap``; verl's
  `rollout_is_ratio_fraction_high` when its threshold is the cap).

With the HF engine the sampler is the trainer's own model, so every value is ~0 (ratios ~1): the metrics mean the
same on every engine. The corrections themselves are `algo.losses.rollout_correction_weights`.
"""

from __future__ import annotations

import math

import torch

from rldynamics import metric_names as names
from rldynamics.algo.losses import masked_mean, rollout_log_ratio, sequence_log_ratio


def k3_kl(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor) -> float:
    """The k3 estimate of the sampler/trainer KL, E[r - 1 - log r] over the sampled tokens (r = pi_old / pi_rollout);
    [N, T] each. 0.0 without tokens."""
    mask = response_mask.bool()  # [N, T]
    if not mask.any():
        return 0.0
    log_ratio = rollout_log_ratio(old_logprobs.float(), rollout_logprobs.float())  # [N, T]
    return masked_mean(torch.exp(log_ratio) - 1.0 - log_ratio, mask).item()


def mismatch_metrics(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor, *,
                     band: float = 2.0, tis_cap: float | None = None,
                     mis: bool = False) -> dict[str, float]:
    """The mismatch metrics of a batch (see the module docstring), as python floats keyed `rollout/corr/<name>`.

    Args:
        old_logprobs: [N, T] the trainer's log-probs of the sampled tokens.
        rollout_logprobs: [N, T] the sampler's log-probs of the same tokens.
        response_mask: [N, T] sampled tokens.
        band: B > 1: ratios outside [1/B, B] count as outside (and MIS masks such sequences).
        tis_cap: the TIS cap, if TIS is on (adds `rollout_is_truncated_fraction`).
        mis: whether MIS is on (adds `rollout_rs_masked_fraction` and `rollout_rs_seq_masked_fraction`).
    """
    if band <= 1:
        raise ValueError(f"band must be > 1, got {band}")
    mask = response_mask.bool()  # [N, T]
    if not mask.any():
        return {}
    log_ratio = rollout_log_ratio(old_logprobs.float(), rollout_logprobs.float())  # [N, T]
    ratio = torch.exp(log_ratio)  # [N, T]
    picked = ratio[mask]  # [M]
    log_band = math.log(band)
    high, low = log_ratio > log_band, log_ratio < -log_band  # [N, T] each
    out = {
        "rollout_is_mean": masked_mean(ratio, mask).item(),
        "rollout_is_min": picked.min().item(),
        "rollout_is_max": picked.max().item(),
        "kl": masked_mean(-log_ratio, mask).item(),
        "k3_kl": masked_mean(ratio - 1.0 - log_ratio, mask).item(),
        "rollout_is_ratio_fraction_high": masked_mean(high.float(), mask).item(),
        "rollout_is_ratio_fraction_low": masked_mean(low.float(), mask).item(),
        "token_fraction_outside": masked_mean((high | low).float(), mask).item(),
        **_sequence_fractions(ratio, log_ratio, mask, band),
    }
    if tis_cap is not None:
        out["rollout_is_truncated_fraction"] = masked_mean((ratio > tis_cap).float(), mask).item()
    if mis:
        masked = sequence_log_ratio(log_ratio, mask).abs() > log_band  # [N] what MIS masks; an empty row: kept
        out["rollout_rs_masked_fraction"] = masked_mean(masked[:, None].expand_as(mask).float(), mask).item()
        out["rollout_rs_seq_masked_fraction"] = masked.float().mean().item()
    return {names.rollout_corr(k): v for k, v in out.items()}


def _sequence_fractions(ratio: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor,
                        band: float) -> dict[str, float]:
    """verl's arithmetic-mean sequence fractions over all rows, and ours by geometric mean over rows with tokens.

    Args:
        ratio, log_ratio: [N, T] per-token ratio and its log; mask: [N, T] bool sampled tokens.
    """
    arith = masked_mean(ratio, mask, dim=-1)  # [N] mean_t r, 0 for a row without tokens
    geo = sequence_log_ratio(log_ratio, mask)[mask.any(dim=-1)]  # [S] log of each geometric-mean ratio
    geo_high, geo_low = (geo > math.log(band)).float().mean().item(), (geo < -math.log(band)).float().mean().item()
    return {"rollout_is_seq_fraction_high": (arith > band).float().mean().item(),
            "rollout_is_seq_fraction_low": (arith < 1 / band).float().mean().item(),
            "seq_geo_fraction_high": geo_high, "seq_geo_fraction_low": geo_low,
            "seq_geo_fraction_outside": geo_high + geo_low}


def measures_mismatch(cfg) -> bool:
    """Whether a step logs the mismatch metrics: a rollout engine other than the trainer's own model, lagged
    weights (`rollout.staleness`), or corrections on. Their old log-probs come from the old-log-prob pass or from the
    update's own (`train.actor.ActorUpdate.logprobs`: its first optimizer step's forwards and a pass over the other
    rows, no extra pass; on several ranks summed over them)."""
    return (cfg.rollout.engine != "hf" or cfg.rollout.staleness > 0 or cfg.algo.tis_cap is not None
            or cfg.algo.mis)


def batch_mismatch(cfg, batch, old_logprobs: torch.Tensor | None) -> dict[str, float]:
    """`mismatch_metrics` of a batch against the trainer's old log-probs [N, L] of its sampled tokens; {} when the
    step does not measure the mismatch (`measures_mismatch`) or the batch has no sampler log-probs."""
    if not measures_mismatch(cfg) or old_logprobs is None or batch.rollout_logprobs is None:
        return {}
    return mismatch_metrics(old_logprobs, batch.rollout_logprobs, batch.response_mask,
                            band=cfg.algo.mismatch_band, tis_cap=cfg.algo.tis_cap, mis=cfg.algo.mis)
