"""The health monitor's per-step signals that need tensors (`train/diagnostics/health.py` reads them; the rules in
`analysis/health_rules.py` see only the numbers). Pure functions with shape comments.

- `token_covariance`: Cui et al. 2025 ("The Entropy Mechanism of Reinforcement Learning for Reasoning Language
  Models"): under a softmax policy trained by policy gradient, the entropy change of a step is about
  −η · Cov(log π(y_t), A_t) over the sampled tokens. A positive covariance (confident tokens with positive
  advantage) lowers the entropy; a negative one raises it.
- `repetition_rate`: the share of replies that repeat themselves (degenerate "!!!!" or looping text).
- `component_shares`: how much of the trained reward's variance each weighted component carries
  (Cov(w_k r_k, R) / Var(R); the shares sum to 1): one near 1 has taken over the total, a negative one moves
  against it.
"""

from __future__ import annotations

import torch

from rldynamics.analysis.cross_scoring import turn_spans


def token_covariance(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> float:
    """Covariance over the masked tokens of the sampled token's log-prob and its advantage.

    logprobs, advantages, mask: [N, L] (mask 1 on response tokens; whatever the other positions
    hold, NaN or -inf padding included, is left out). 0.0 without tokens."""
    weights = mask.float()  # [N, L]
    count = weights.sum()
    if count == 0:
        return 0.0
    keep = mask.bool()  # [N, L]
    logprobs = torch.where(keep, logprobs, torch.zeros_like(logprobs))  # [N, L] (0 x NaN is NaN)
    advantages = torch.where(keep, advantages, torch.zeros_like(advantages))  # [N, L]
    lp_mean = (logprobs * weights).sum() / count  # []
    adv_mean = (advantages * weights).sum() / count  # []
    return float(((logprobs - lp_mean) * (advantages - adv_mean) * weights).sum() / count)


def reply_lengths(response_mask: torch.Tensor) -> list[int]:
    """Sampled tokens of each reply (each run of response tokens of each row: a turn is one reply). mask: [N, L]"""
    return [end - start for row in response_mask for start, end in turn_spans(row)]


def repetition_rate(input_ids: torch.Tensor, response_mask: torch.Tensor, n: int = 4, share: float = 0.5) -> float:
    """Share of replies (with at least 2n tokens) in which at least `share` of the n-grams repeat an earlier n-gram
    of the same reply. input_ids, response_mask: [N, L]. 0.0 when no reply is that long."""
    judged = repeating = 0
    for ids, mask in zip(input_ids, response_mask, strict=True):
        for start, end in turn_spans(mask):
            tokens = ids[start:end].tolist()
            if len(tokens) < 2 * n:
                continue
            grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
            judged += 1
            repeating += (1 - len(set(grams)) / len(grams)) >= share
    return repeating / judged if judged else 0.0


def component_shares(components: torch.Tensor, weights: tuple[float, ...], names: tuple[str, ...]) -> dict[str, float]:
    """Each weighted component's share of the variance of the trained reward R = Σ w_k r_k: Cov(w_k r_k, R) / Var(R).

    components: [N, K] raw rewards; {} with fewer than two components or a constant R."""
    if components is None or components.shape[1] < 2:
        return {}
    weighted = components.double() * torch.tensor(weights, dtype=torch.float64)  # [N, K]
    total = weighted.sum(dim=1)  # [N]
    centred = total - total.mean()  # [N]
    var = float((centred * centred).mean())
    if var <= 1e-12:
        return {}
    cov = ((weighted - weighted.mean(dim=0)) * centred[:, None]).mean(dim=0)  # [K]
    return {name: float(c) / var for name, c in zip(names, cov, strict=True)}
