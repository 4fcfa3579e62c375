"""Advantage estimators: GAE, GRPO / Dr. GRPO, RLOO and REINFORCE++.

Design choices:
- Multi-turn convention for every token-level reverse scan: positions outside the response mask
  (environment observation tokens between assistant turns) carry the running value / advantage /
  return through unchanged, so a reward at the end of the episode reaches every assistant turn.
  Rewards placed on non-response positions are ignored.
- Outputs are exactly zero outside the response mask.
- Whitening uses the masked mean and the unbiased masked variance over all response tokens of the
  batch, with ``1e-8`` inside the square root (verl convention).
- Group estimators take arbitrary group ids (not necessarily contiguous) and are vectorised with
  ``index_add``; a singleton group uses mean 0 / std 1 (GRPO) or advantage 0 (RLOO).
- Pure tensor functions; the caller picks the estimator.
"""

from __future__ import annotations

import torch

from rldynamics.algo.losses import check_same_shape, masked_mean

_WHITEN_EPS = 1e-8


def whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise ``values`` to unit variance over the masked positions of the whole batch.

    Args:
        values: ``[N, T]``.
        mask: ``[N, T]`` bool or {0, 1} float.
        shift_mean: if True the result has masked mean 0: ``(x - μ) / sqrt(σ² + 1e-8)``; if False the
            original mean is kept: ``(x - μ) / sqrt(σ² + 1e-8) + μ``.

    Returns:
        ``[N, T]``, zero outside the mask. σ² is the unbiased masked variance (0 when fewer than two
        positions are masked).
    """
    check_same_shape(values=values, mask=mask)
    keep = mask.bool()  # [N, T]
    mean = masked_mean(values, keep)  # []
    centred = torch.where(keep, values - mean, torch.zeros_like(values))  # [N, T]
    count = keep.sum()  # []
    var = centred.square().sum() / (count - 1).clamp_min(1)  # []  unbiased
    out = centred * torch.rsqrt(var + _WHITEN_EPS)  # [N, T]
    if not shift_mean:
        out = out + mean  # [N, T]
    return torch.where(keep, out, torch.zeros_like(out))  # [N, T]


_masked_whiten = whiten  # gae_advantages' `whiten` flag shadows the function name inside it


def _check_discount(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (https://arxiv.org/abs/1506.02438) over response tokens.

    Reverse scan over response positions t: ``δ_t = r_t + γ·V_next - V_t``, ``A_t = δ_t + γλ·A_next``;
    non-response positions leave ``V_next`` and ``A_next`` unchanged. With γ = λ = 1, ``A_t = R - V_t``.

    Args:
        token_rewards: ``[N, T]`` per-token rewards (usually the episode reward on the last response token).
        values: ``[N, T]`` critic predictions.
        response_mask: ``[N, T]`` assistant tokens.
        gamma, lam: discount and GAE λ, each in [0, 1].
        whiten: whiten the advantages over all response tokens of the batch.

    Returns:
        ``(advantages [N, T], returns [N, T])`` with ``returns = A + V`` taken before whitening; both zero
        outside the mask.
    """
    check_same_shape(token_rewards=token_rewards, values=values, response_mask=response_mask)
    _check_discount("gamma", gamma)
    _check_discount("lam", lam)
    keep = response_mask.bool()  # [N, T]
    adv = torch.zeros_like(values)  # [N, T]
    next_value = torch.zeros_like(values[:, 0])  # [N]
    next_adv = torch.zeros_like(values[:, 0])  # [N]
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]  # [N]
        step_adv = delta + gamma * lam * next_adv  # [N]
        next_value = torch.where(keep[:, t], values[:, t], next_value)  # [N]
        next_adv = torch.where(keep[:, t], step_adv, next_adv)  # [N]
        adv[:, t] = next_adv  # [N]
    adv = torch.where(keep, adv, torch.zeros_like(adv))  # [N, T]
    returns = torch.where(keep, adv + values, torch.zeros_like(adv))  # [N, T]
    if whiten:
        adv = _masked_whiten(adv, keep)  # [N, T]
    return adv, returns


def reinforce_pp_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """REINFORCE++ (https://arxiv.org/abs/2501.03262): discounted return-to-go, then batch whitening.

    ``G_t = r_t + γ·G_next`` on response positions; non-response positions carry ``G_next`` unchanged.

    Args:
        token_rewards: ``[N, T]``.
        response_mask: ``[N, T]``.
        gamma: discount in [0, 1].

    Returns:
        ``[N, T]`` whitened returns, zero outside the mask.
    """
    check_same_shape(token_rewards=token_rewards, response_mask=response_mask)
    _check_discount("gamma", gamma)
    keep = response_mask.bool()  # [N, T]
    returns = torch.zeros_like(token_rewards)  # [N, T]
    running = torch.zeros_like(token_rewards[:, 0])  # [N]
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(keep[:, t], token_rewards[:, t] + gamma * running, running)  # [N]
        returns[:, t] = running  # [N]
    return whiten(returns, keep)  # [N, T]


def _group_moments(
    scores: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group size, group mean and unbiased group std (std 0 for singletons).

    Returns ``(count [N], mean [N], std [N], scores [N] as float)``.
    """
    if scores.dim() != 1 or group_ids.shape != scores.shape or response_mask.dim() != 2:
        raise ValueError(
            "expected scores [N], group_ids [N], response_mask [N, T]; got "
            f"{tuple(scores.shape)}, {tuple(group_ids.shape)}, {tuple(response_mask.shape)}"
        )
    if response_mask.shape[0] != scores.shape[0]:
        raise ValueError(f"response_mask has {response_mask.shape[0]} rows but scores has {scores.shape[0]}")
    s = scores if scores.is_floating_point() else scores.float()  # [N]
    _, inverse = torch.unique(group_ids, return_inverse=True)  # [N]
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    zeros = s.new_zeros(num_groups)  # [G]
    count = zeros.index_add(0, inverse, torch.ones_like(s))  # [G]
    mean = zeros.index_add(0, inverse, s) / count  # [G]
    # a group of equal scores has exactly that mean (the sum's rounding, divided by GRPO's std + eps, gave all its
    # rows one advantage of a few hundredths: 8 x -0.7 gave -0.056 each)
    high = zeros.scatter_reduce(0, inverse, s, "amax", include_self=False)  # [G]
    low = zeros.scatter_reduce(0, inverse, s, "amin", include_self=False)  # [G]
    mean = torch.where(high == low, high, mean)  # [G]
    sq_dev = (s - mean[inverse]).square()  # [N]
    sum_sq = zeros.index_add(0, inverse, sq_dev)  # [G]
    std = (sum_sq / (count - 1).clamp_min(1)).sqrt()  # [G]
    return count[inverse], mean[inverse], std[inverse], s


def _broadcast(per_seq: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Tile a per-sequence value over its response tokens; zero elsewhere."""
    tiled = per_seq[:, None].expand(response_mask.shape)  # [N, T]
    return torch.where(response_mask.bool(), tiled, torch.zeros_like(tiled))  # [N, T]


def grpo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO (https://arxiv.org/abs/2402.03300) / Dr. GRPO (https://arxiv.org/abs/2503.20783) group advantages.

    ``A_i = (s_i - mean_g) / (std_g + eps)`` with the unbiased group std, or ``s_i - mean_g`` when
    ``norm_by_std`` is False (Dr. GRPO). A singleton group uses mean 0 and std 1.

    Args:
        scores: ``[N]`` sequence (trajectory) scores.
        group_ids: ``[N]`` integer group label per sequence (e.g. the env group / prompt id).
        response_mask: ``[N, T]``.
        norm_by_std: divide by the group std.
        eps: added to the std.

    Returns:
        ``[N, T]`` the sequence advantage broadcast over its response tokens, zero elsewhere.
    """
    count, mean, std, s = _group_moments(scores, group_ids, response_mask)  # [N] each
    single = count == 1  # [N]
    mean = torch.where(single, torch.zeros_like(mean), mean)  # [N]
    std = torch.where(single, torch.ones_like(std), std)  # [N]
    adv = (s - mean) / (std + eps) if norm_by_std else s - mean  # [N]
    return _broadcast(adv, response_mask)  # [N, T]


def equal_reward_rows(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: the rows of a group of two or more whose scores are all exactly equal. GRPO and
    RLOO give them advantage exactly 0: no reward signal.

    >>> scores, groups = torch.tensor([0.1, 0.1, 1.0, 0.0, 0.5]), torch.tensor([3, 3, 5, 5, 9])
    >>> equal_reward_rows(scores, groups).tolist()
    [True, True, False, False, False]
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)  # [N]
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    s = scores.float()  # [N]
    high = s.new_full((num_groups,), -torch.inf).scatter_reduce(0, inverse, s, "amax")  # [G]
    low = s.new_full((num_groups,), torch.inf).scatter_reduce(0, inverse, s, "amin")  # [G]
    count = s.new_zeros(num_groups).index_add(0, inverse, torch.ones_like(s))  # [G]
    return ((high == low) & (count >= 2))[inverse]  # [N]


def rloo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out (https://arxiv.org/abs/2402.14740): ``A_i = s_i - mean_{j≠i} s_j``.

    Computed as ``(n·s_i - Σ_g s) / (n - 1)``; a singleton group gets advantage 0.

    Args:
        scores: ``[N]`` sequence scores.
        group_ids: ``[N]`` integer group label per sequence.
        response_mask: ``[N, T]``.

    Returns:
        ``[N, T]`` broadcast over response tokens, zero elsewhere.
    """
    count, mean, _, s = _group_moments(scores, group_ids, response_mask)  # [N] each
    # n·s - Σ = n·(s - mean): avoids recomputing the group sum.
    adv = count * (s - mean) / (count - 1).clamp_min(1)  # [N]
    adv = torch.where(count == 1, torch.zeros_like(adv), adv)  # [N]
    return _broadcast(adv, response_mask)  # [N, T]
