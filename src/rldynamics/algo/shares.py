"""Aggregation shares: how a sub-batch's loss enters the loss of the whole batch.

Every aggregation mode weights tokens uniformly within the rows it sees, so a loss aggregated over a batch is the
share-weighted sum of the same loss aggregated over each part of a partition (``sub_batch_share``). The update
(micro-batches of a mini-batch, on one rank or split over several) and the gradient probe (micro-batches of a
bucket, buckets of the batch) weight every part by its share, so their results do not depend on how the batch
is cut, nor on the number of ranks (every rank holds the whole batch's masks, so shares need no communication).
"""

from __future__ import annotations

import torch

from rldynamics.algo.losses import aggregation_weights


def sub_batch_share(mask: torch.Tensor, rows: torch.Tensor, mode: str) -> float:
    """Weight of `rows` in `aggregate(., mask, mode)` relative to aggregating `rows` alone.

    Every aggregation mode weights tokens uniformly within the rows it sees, so
    `aggregate(v, mask, mode) == sum over chunks of share(chunk) * aggregate(v[chunk], mask[chunk], mode)`.
    Returns 0 for rows without response tokens.
    """
    whole = aggregation_weights(mask, mode)[rows].sum()  # []
    alone = aggregation_weights(mask[rows], mode).sum()  # []
    return float(whole / alone) if alone > 0 else 0.0
