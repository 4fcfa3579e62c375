"""A step's heavy work split over the ranks of a torchrun job; every rank ends with the same whole batch.

- `rollout_groups`: each rank rolls out a contiguous block of whole groups (`dist.rank_block` of the seeds, in
  order) and the parts are gathered in rank order, so every rank holds the global batch (rows in the order one process
  would make them) and filtering, group statistics, advantages (GAE whitening too) and aggregation weights see
  the whole batch. With `train.row_seeded_sampling` each trajectory samples from its own keyed stream and the
  gathered batch is the one-process batch, whatever the number of ranks; otherwise rank r seeds the global torch
  RNG with `dist.rank_seed(seed)` (rank 0: `seed`, as one process does).
- `row_pass`: a no-grad per-token pass (old / reference log-probs, values) over a contiguous block of rows
  per rank (`dist.rank_block`), gathered.
- Both run on gathered weights (`models.sharding.gathered`): no collective happens while ranks work on their own
  rows, so they may generate different numbers of tokens. In one process they are the plain calls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rldynamics import dist
from rldynamics.config import Config
from rldynamics.models.sharding import gathered
from rldynamics.rollout.agent import rollout
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.rollout.engines import RolloutEngine
from rldynamics.rollout.sampling import NonFiniteLogits


def rollout_groups(cfg: Config, model, tokenizer, seeds: list[int], group_size: int, temperature: float,
                   seed: int, engine: RolloutEngine | None = None) -> RolloutBatch:
    """The rollout of one env group per seed, sampled from the stream `seed`, split over the ranks by whole groups.
    `engine`: the run's rollout engine (None: HF generate on `model`, whose weights are gathered for it), released
    after the rollout (`RolloutEngine.release`: vLLM's GPU memory is the trainer's until it samples again).

    Raises NonFiniteLogits on every rank when any rank's policy scores were not finite.
    """
    groups = dist.rank_block(len(seeds))
    row_seed = seed if cfg.train.row_seeded_sampling else None
    if row_seed is None:
        torch.manual_seed(dist.rank_seed(seed))
    try:
        with gathered(model if engine is None else None):
            part: RolloutBatch | NonFiniteLogits = rollout(
                model, tokenizer, seeds[groups.start:groups.stop], group_size, cfg.env, temperature=temperature,
                row_seed=row_seed, first_group=groups.start, engine=engine)
    except NonFiniteLogits as e:
        if not dist.distributed():
            raise
        part = e
    finally:
        if engine is not None:
            engine.release()
    parts = dist.gather(part)
    failed = [p for p in parts if isinstance(p, NonFiniteLogits)]
    if failed:
        raise failed[0]
    return parts[0] if len(parts) == 1 else RolloutBatch.concat(parts, tokenizer.pad_token_id)


def row_pass(models: tuple, batch: RolloutBatch,
             compute: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """`compute(rows)` -> per-token tensors [len(rows), L] over the rows of `batch`, split over the ranks, on
    gathered weights of `models`; each whole [N, L] on every rank."""
    n, width = batch.input_ids.shape
    rows = torch.arange(n)[dist.rank_block(n)]  # [n_r]
    with gathered(*models):
        mine = compute(rows) if len(rows) else None  # [n_r, L] each
    if not dist.distributed():
        return mine
    parts = dist.gather(mine)
    count = len(next(p for p in parts if p is not None))
    out = tuple(torch.zeros(n, width) for _ in range(count))  # [N, L] each
    for r, part in enumerate(parts):
        for whole, values in zip(out, part or (), strict=False):
            whole[dist.rank_block(n, r)] = values
    return out
