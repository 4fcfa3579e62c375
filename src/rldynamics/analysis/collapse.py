"""Template-collapse diagnostics (RAGEN-2's mutual-information proxies) from a cross-scoring matrix.

Pure functions of the log-likelihood matrix ``L[i, j] = log p(z_i | x_j)``: every sampled reply ``z_i`` (a row)
scored under every prompt column ``x_j`` of the batch (``analysis/cross_scoring.py`` computes it). Each row has
its true column ``column[i]`` (the prompt it was sampled from) and each column an equivalence class
``classes[j]``: columns whose prompts are the same token sequence share a class.

Estimators (docs/collapse.md has the reading of each):
- ``matched_i = L[i, column_i]``; RAGEN's marginal ``marginal_i = logsumexp_j L[i, j] − log C``, the log-probability
  of ``z_i`` under the uniform mixture of the batch's C prompt columns (the empirical prompt distribution: every
  column holds the same number of rows in first-turn mode, one row each in trajectory mode).
- With the per-sequence sums (``_seq``) this is a Monte-Carlo estimate of I(X; Z) = H(Z) − H(Z|X) in nats per
  reply; with per-token means (``L / |z_i|``, RAGEN's ``mi_estimate``) the "marginal" is the logsumexp of
  per-token averages, which is not the log-probability of any mixture. ``mi_mixture_estimate`` is the per-token
  reading of the real mixture: ``(matched_seq_i − marginal_seq_i) / |z_i|`` averaged over rows.
- Retrieval: the predicted column of a row is its argmax over per-token scores; a hit is a predicted column of the
  true class (top-k: any of the k best columns). Chance is the accuracy of k columns drawn uniformly without
  replacement: the mean over rows of ``1 − binom(C − s, k) / binom(C, k)``, s the true class's size (top-1: s / C,
  RAGEN's; for top-k RAGEN uses ``min(1, k · chance)``, which equals this only when no two prompts are identical).
- ``marginal_std`` is the population std over rows of the marginal; ``mi_zscore = mean((matched − marginal) /
  (marginal_std + eps))``; the EMA variants replace the std by its exponential moving average over the diagnosed
  steps (``ema``: initialised to the first value).
- Bootstrap intervals resample the prompt columns' rows with replacement (whole clusters: the replies of one prompt
  are not independent), the columns themselves fixed (the mixture is the batch's), and give the normal interval
  of ``analysis/bootstrap.py``.
"""

from __future__ import annotations

import math

import torch

from rldynamics.analysis.bootstrap import normal_interval

TOP_K = (2, 4, 8)


def matched_and_marginal(scores: torch.Tensor, column: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's score under its own column and under the uniform mixture of all columns (log-mean-exp).

    Args:
        scores: [N, C] log-likelihoods (sums or per-token means).
        column: [N] long, each row's true column.
    Returns:
        matched [N], marginal [N] (float64).
    """
    scores = scores.double()  # [N, C]
    matched = scores.gather(1, column[:, None]).squeeze(1)  # [N]
    marginal = torch.logsumexp(scores, dim=1) - math.log(scores.shape[1])  # [N]
    return matched, marginal


def retrieval_hits(token_scores: torch.Tensor, column: torch.Tensor, classes: torch.Tensor, k: int = 1) -> torch.Tensor:
    """Whether each row's true prompt class is among the classes of its `k` best-scoring columns. [N] bool

    Args:
        token_scores: [N, C] per-token log-likelihoods. column: [N] true columns. classes: [C] class of each column.
    Ties go to the lower column index (torch.topk on CPU is stable for equal values only up to that).
    """
    k = min(k, token_scores.shape[1])
    order = torch.sort(token_scores.double(), dim=1, descending=True, stable=True).indices[:, :k]  # [N, k]
    return (classes[order] == classes[column][:, None]).any(dim=1)  # [N]


def chance_level(column: torch.Tensor, classes: torch.Tensor, k: int = 1) -> float:
    """Expected top-k retrieval accuracy of k distinct columns drawn uniformly: the mean over rows of
    1 − binom(C − s, k) / binom(C, k), s the size of the row's true class (top-1: s / C; k ≥ C: 1)."""
    c = classes.numel()
    k = min(k, c)
    sizes = (classes[:, None] == classes[None, :]).sum(1)[column].tolist()  # [N] size of each row's class
    return sum(1.0 - math.comb(c - s, k) / math.comb(c, k) for s in sizes) / len(sizes)


def ema(previous: float | None, current: float, decay: float) -> float:
    """``decay · previous + (1 − decay) · current``; the first value (previous None) is taken as it is."""
    return current if previous is None else decay * previous + (1.0 - decay) * current


def collapse_metrics(loglik: torch.Tensor, lengths: torch.Tensor, column: torch.Tensor, classes: torch.Tensor, *,
                     std_eps: float = 1e-3, ema_std: dict[str, float] | None = None,
                     ema_decay: float = 0.9) -> dict[str, float]:
    """Every MI proxy of one cross-scoring matrix (RAGEN's suffix names, module docstring).

    Args:
        loglik: [N, C] per-sequence log-likelihoods ``Σ_t log p(z_i,t | x_j, z_i,<t)``.
        lengths: [N] reply lengths |z_i| (> 0).
        column: [N] long true column of each row. classes: [C] long class of each column.
        std_eps: added to the std of the z-scores.
        ema_std: the running EMA of ``marginal_std`` / ``marginal_std_seq`` (keys as those names); updated in place.
            None: no EMA metrics.
    Returns:
        name -> value; needs C ≥ 2 (one column has nothing to tell apart: the caller skips it).
    """
    seq = loglik.double()  # [N, C]
    tok = seq / lengths.double()[:, None]  # [N, C]
    out: dict[str, float] = {}
    matched, marginal = matched_and_marginal(tok, column)  # [N], [N]
    matched_seq, marginal_seq = matched_and_marginal(seq, column)  # [N], [N]
    mixture = marginal_seq / lengths.double()  # [N] per-token log of the real mixture probability
    out["mi_estimate"] = float((matched - marginal).mean())
    out["mi_seq_estimate"] = float((matched_seq - marginal_seq).mean())
    out["mi_mixture_estimate"] = float((matched - mixture).mean())
    out["mi_upper_bound"] = math.log(seq.shape[1])
    out["matched_log_prob_mean"] = float(matched.mean())
    out["marginal_log_prob_mean"] = float(marginal.mean())
    out["marginal_mixture_log_prob_mean"] = float(mixture.mean())
    out["conditional_entropy_est"] = -float(matched.mean())
    out["conditional_entropy_seq_est"] = -float(matched_seq.mean())
    out["reasoning_entropy_est"] = -float(marginal.mean())
    out["reasoning_entropy_seq_est"] = -float(marginal_seq.mean())
    out["reasoning_entropy_mixture_est"] = -float(mixture.mean())
    out.update(retrieval_metrics(tok, column, classes))
    std, std_seq = float(marginal.std(unbiased=False)), float(marginal_seq.std(unbiased=False))
    out["marginal_std"], out["marginal_std_seq"] = std, std_seq
    out["mi_zscore"] = float(((matched - marginal) / (std + std_eps)).mean())
    out["mi_zscore_seq"] = float(((matched_seq - marginal_seq) / (std_seq + std_eps)).mean())
    if ema_std is not None:
        ema_std["marginal_std"] = ema(ema_std.get("marginal_std"), std, ema_decay)
        ema_std["marginal_std_seq"] = ema(ema_std.get("marginal_std_seq"), std_seq, ema_decay)
        out["marginal_std_ema"], out["marginal_std_ema_seq"] = ema_std["marginal_std"], ema_std["marginal_std_seq"]
        out["mi_zscore_ema"] = float(((matched - marginal) / (ema_std["marginal_std"] + std_eps)).mean())
        gap_seq = matched_seq - marginal_seq  # [N]
        out["mi_zscore_ema_seq"] = float((gap_seq / (ema_std["marginal_std_seq"] + std_eps)).mean())
    return out


def retrieval_metrics(token_scores: torch.Tensor, column: torch.Tensor, classes: torch.Tensor) -> dict[str, float]:
    """``retrieval_accuracy``, ``retrieval_chance_level``, ``retrieval_above_chance`` and their ``@k`` versions
    for k in TOP_K (k capped at the number of columns C)."""
    chance = chance_level(column, classes)
    acc = float(retrieval_hits(token_scores, column, classes).double().mean())
    out = {"retrieval_accuracy": acc, "retrieval_chance_level": chance, "retrieval_above_chance": acc - chance}
    for k in TOP_K:
        hit = float(retrieval_hits(token_scores, column, classes, k).double().mean())
        chance_k = chance_level(column, classes, k)
        out[f"retrieval_accuracy@{k}"] = hit
        out[f"retrieval_chance_level@{k}"] = chance_k
        out[f"retrieval_above_chance@{k}"] = hit - chance_k
    return out


def bootstrap_intervals(loglik: torch.Tensor, lengths: torch.Tensor, column: torch.Tensor, classes: torch.Tensor, *,
                        resamples: int, seed: int) -> dict[str, float]:
    """95 % cluster-bootstrap intervals of ``mi_estimate``, ``mi_seq_estimate``, ``mi_mixture_estimate`` and
    ``retrieval_accuracy`` (``<name>/ci_low``, ``<name>/ci_high``).

    Each resample draws the batch's true columns with replacement and takes all the rows of each drawn column (the
    columns scored against stay all C: the mixture is the batch's); nan with fewer than 2 distinct true columns.
    Args: as `collapse_metrics`; resamples R ≥ 2; seed of the resampling `torch.Generator`.
    """
    seq = loglik.double()  # [N, C]
    tok = seq / lengths.double()[:, None]  # [N, C]
    matched, marginal = matched_and_marginal(tok, column)  # [N]
    matched_seq, marginal_seq = matched_and_marginal(seq, column)  # [N]
    per_row = {"mi_estimate": matched - marginal, "mi_seq_estimate": matched_seq - marginal_seq,
               "mi_mixture_estimate": (matched_seq - marginal_seq) / lengths.double(),
               "retrieval_accuracy": retrieval_hits(tok, column, classes).double()}  # name -> [N]
    clusters = torch.unique(column)  # [G] the true columns present
    member = (column[None, :] == clusters[:, None]).double()  # [G, N] rows of each cluster
    draws = torch.randint(0, clusters.numel(), (resamples, clusters.numel()),
                          generator=torch.Generator().manual_seed(seed))  # [R, G]
    counts = torch.zeros(resamples, clusters.numel(), dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(draws.shape, dtype=torch.float64))  # [R, G]
    weights = counts @ member  # [R, N] how often each row is drawn
    out = {}
    for name, values in per_row.items():
        samples = (weights @ values) / weights.sum(1)  # [R]
        point = float(values.mean())
        bounds = (0.0, 1.0) if name == "retrieval_accuracy" else (-math.inf, math.inf)
        low, high = normal_interval(point, samples, *bounds) if clusters.numel() >= 2 else (math.nan, math.nan)
        out[f"{name}/ci_low"], out[f"{name}/ci_high"] = low, high
    return out
