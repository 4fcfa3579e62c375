"""Reward-component gradients (the rldynamic study, exact): do correctness, format and length pull together?

For each named reward component k the probe differentiates the task (policy-gradient) loss with that
component's own advantages A_k — the training estimator applied to the component alone, with its own group
statistics — on the same forward pass as the other loss terms. This module turns those gradients into
metrics and matrices:

- ``norm/<k>``: ‖g_k‖ (raw component, unweighted); ``weighted_norm/<k>`` = w_k · ‖g_k‖; ``norm/total``: the
  gradient of the trained (combined) reward, i.e. the probe's task gradient.
- ``cos/<a>__<b>``: cos(g_a, g_b) for every pair; ``cos_total/<k>``: cos(g_k, g_total).
- ``neg_layer_frac/<a>__<b>``: the fraction of layer groups (embeddings, each block, final norm, head) where
  the pair's cosine restricted to that group is negative — a conflict statistic the global cosine hides.
- A component whose gradient is exactly zero (constant within every group, so A_k = 0) gets
  ``zero_grad/<k>`` = 1 and NaN cosines (never 0, which would read as "orthogonal").

With Dr.GRPO advantages (no std), a ratio of 1 and unclipped losses the policy loss is linear in the
advantages, so g_total = Σ_k w_k g_k exactly (tested). Pure tensor functions; no model, no config.
"""

from __future__ import annotations

import math
import re

import torch

from rldynamics.analysis.gram import cosine

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_groups(param_names: list[str], numels: list[int]) -> dict[str, list[tuple[int, int]]]:
    """Group the flat gradient's coordinates by model part: ``[start, end)`` spans of each group, in order.

    Groups: ``embedding`` (names containing ``embed``), ``layer_<i>`` (``layers.<i>.``), ``head``
    (``lm_head``), ``final_norm`` (other names containing ``norm``) and ``other``.
    """
    groups: dict[str, list[tuple[int, int]]] = {}
    start = 0
    for name, numel in zip(param_names, numels, strict=True):
        match = _LAYER.search(name)
        if match:
            group = f"layer_{int(match.group(1))}"
        elif "embed" in name:
            group = "embedding"
        elif "lm_head" in name:
            group = "head"
        elif "norm" in name:
            group = "final_norm"
        else:
            group = "other"
        groups.setdefault(group, []).append((start, start + numel))
        start += numel
    order = ["embedding", *sorted((g for g in groups if g.startswith("layer_")), key=lambda g: int(g[6:])),
             "final_norm", "head", "other"]
    return {g: groups[g] for g in order if g in groups}


def reward_grad_metrics(grams: torch.Tensor, names: list[str], with_total: bool, weights: dict[str, float],
                        groups: list[str]) -> tuple[dict[str, float], dict]:
    """Metrics and matrices of one bucket's component gradients, from their inner products per layer group.

    Args:
        grams: ``[G, K, K]`` inner products within each layer group (``analysis.gram.gram``) of the gradients of the
            task loss with each component's advantages (``names``, in order), then, when ``with_total``, of the task
            loss with the trained (combined) advantages (index K-1). Without the total (the task term was not
            analysed) everything that compares with it is left out.
        weights: component name -> weight in the trained reward.
        groups: the G layer-group names (``layer_groups``).

    Returns:
        ``(metrics, matrices)``: flat metrics without a prefix (see the module docstring) and a JSON-ready
        dict with the cosine matrix, cosines with the total and per-layer-group cosine profiles (None where
        undefined).
    """
    whole = grams.sum(0)  # [K, K]
    total = len(names) if with_total else None
    norms = {k: float(whole[i, i].clamp_min(0.0).sqrt()) for i, k in enumerate(names)}
    out: dict[str, float] = {} if total is None else {"norm/total": float(whole[total, total].clamp_min(0.0).sqrt())}
    for i, k in enumerate(names):
        out[f"norm/{k}"] = norms[k]
        out[f"weighted_norm/{k}"] = abs(weights[k]) * norms[k]
        out[f"zero_grad/{k}"] = float(norms[k] == 0.0)
        if total is not None:
            out[f"cos_total/{k}"] = cosine(whole, i, total)
    cos = [[cosine(whole, i, j) for j in range(len(names))] for i in range(len(names))]
    layer_cos: dict[str, list[float]] = {}
    for i, a in enumerate(names):
        for j in range(i + 1, len(names)):
            b = names[j]
            out[f"cos/{a}__{b}"] = cos[i][j]
            profile = [cosine(g, i, j) for g in grams]
            layer_cos[f"{a}__{b}"] = profile
            defined = [c for c in profile if not math.isnan(c)]
            out[f"neg_layer_frac/{a}__{b}"] = sum(c < 0 for c in defined) / len(defined) if defined else math.nan
    layer_cos_total = {} if total is None else {k: [cosine(g, i, total) for g in grams] for i, k in enumerate(names)}
    matrices = {
        "components": list(names),
        "weights": [weights[k] for k in names],
        "norm": [norms[k] for k in names],
        "norm_total": out.get("norm/total"),
        "cos": [[_json(c) for c in row] for row in cos],
        "cos_total": [_json(out[f"cos_total/{k}"]) for k in names] if total is not None else None,
        "layer_groups": list(groups),
        "layer_cos": {pair: [_json(c) for c in v] for pair, v in layer_cos.items()},
        "layer_cos_total": {k: [_json(c) for c in v] for k, v in layer_cos_total.items()},
    }
    return out, matrices


def _json(value: float) -> float | None:
    """NaN as JSON null."""
    return None if math.isnan(value) else value
