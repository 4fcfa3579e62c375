"""Actor loss terms and the actor update.

Design choices:
- `loss_terms` returns the unweighted terms `pg`, `entropy`, `kl` of one micro-batch; `weighted_total`
  forms the training loss in exactly one place. The gradient probe calls `loss_terms` too, so the loss
  it differentiates is the loss that is trained.
- Micro-batches take the mini-batch's rows from shortest to longest, and each forward is trimmed to its own
  longest row (`models.forward`), so short rows are not padded to the longest row of the batch; when rows share
  their prompt (a group's members), the rows of a prompt stay together if that forwards fewer tokens, and each
  distinct prompt of a micro-batch is forwarded once (`train.shared_prefix`, `models.forward.row_order`).
- Aggregation is exact over a mini-batch, whatever the micro-batch size: each micro-batch's terms are
  multiplied by `sub_batch_share`, the share of the mini-batch's aggregation weight its rows carry,
  so the sum over micro-batches equals the loss of the whole mini-batch aggregated at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rldynamics.algo.losses import aggregate, aggregation_weights, kl_penalty, policy_loss
from rldynamics.config import AlgoConfig, TrainConfig
from rldynamics.models.forward import micro_batches, row_order, token_logprobs
from rldynamics.rollout.batch import RolloutBatch


@dataclass
class ActorInputs:
    """Per-token tensors the actor loss needs besides the rollout itself (all [N, L], on CPU).

    `old_logprobs` None means the update is on-policy (`single_pass`): the loss uses its own log-probs,
    detached, as the old ones (ratio exactly 1), so no separate old-log-prob pass is needed.
    """

    old_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    ref_logprobs: torch.Tensor | None = None


def single_pass(train: TrainConfig, batch_size: int) -> bool:
    """Whether the update of a `batch_size` batch is one optimizer step on the rollout policy itself.

    One epoch over one mini-batch: every micro-batch's forward sees the parameters that sampled the batch,
    so the old log-probs are the update's own log-probs, detached.
    """
    return train.ppo_epochs == 1 and train.mini_batch_size >= batch_size


def sub_batch_share(mask: torch.Tensor, rows: torch.Tensor, mode: str) -> float:
    """Weight of `rows` in `aggregate(., mask, mode)` relative to aggregating `rows` alone.

    Every aggregation mode weights tokens uniformly within the rows it sees, so
    `aggregate(v, mask, mode) == sum over chunks of share(chunk) * aggregate(v[chunk], mask[chunk], mode)`.
    Returns 0 for rows without response tokens.
    """
    whole = aggregation_weights(mask, mode)[rows].sum()  # []
    alone = aggregation_weights(mask[rows], mode).sum()  # []
    return float(whole / alone) if alone > 0 else 0.0


def loss_terms(model, batch: RolloutBatch, rows: torch.Tensor, inputs: ActorInputs, cfg: AlgoConfig, *,
               temperature: float, component_advantages: dict[str, torch.Tensor] | None = None,
               shared_prefix: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Unweighted loss terms of the micro-batch `rows`, aggregated with `cfg.loss_agg_mode`.

    Returns ({"pg", "entropy", "kl"(if a reference is given), "reward/<name>" per entry of
    `component_advantages` (the pg loss with that component's advantages, [N, L] each)}, policy metrics).
    All terms come from one forward pass (`token_logprobs`, with a group's shared prompt forwarded once when
    `shared_prefix`).
    """
    device = next(model.parameters()).device
    mask = batch.response_mask[rows].to(device)  # [n, L]
    logprobs, entropy = token_logprobs(model, batch.input_ids[rows].to(device),
                                       batch.attention_mask[rows].to(device), temperature=temperature,
                                       with_entropy=True, positions=mask,
                                       shared_prefix=shared_prefix)  # [n, L], [n, L]
    old = logprobs.detach() if inputs.old_logprobs is None else inputs.old_logprobs[rows].to(device)  # [n, L]

    def pg_loss(advantages: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        return policy_loss(logprobs, old, advantages[rows].to(device), mask, kind=cfg.policy_loss,
                           clip_low=cfg.clip_low, clip_high=cfg.clip_high, clip_c=cfg.clip_c, agg=cfg.loss_agg_mode)

    pg, metrics = pg_loss(inputs.advantages)
    terms = {"pg": pg, "entropy": aggregate(entropy, mask, cfg.loss_agg_mode)}
    if inputs.ref_logprobs is not None:
        kl = kl_penalty(logprobs, inputs.ref_logprobs[rows].to(device), cfg.kl_type)  # [n, L]
        terms["kl"] = aggregate(kl, mask, cfg.loss_agg_mode)
    for name, advantages in (component_advantages or {}).items():
        terms[f"reward/{name}"] = pg_loss(advantages)[0]
    return terms, metrics


def term_coefs(cfg: AlgoConfig) -> dict[str, float]:
    """The coefficient of each term in the training loss (entropy is a bonus, hence negative)."""
    return {"pg": 1.0, "entropy": -cfg.entropy_coef, "kl": cfg.kl_coef}


def weighted_total(terms: dict[str, torch.Tensor], cfg: AlgoConfig) -> torch.Tensor:
    """The training loss: pg - entropy_coef * entropy + kl_coef * kl.

    Terms with a zero coefficient are left out, so backward does not run through their graphs.
    """
    coefs = term_coefs(cfg)
    return sum(coefs[name] * value for name, value in terms.items() if coefs[name] != 0.0)  # pg always has 1


def update_actor(model, optimizer, batch: RolloutBatch, inputs: ActorInputs, algo: AlgoConfig, train: TrainConfig,
                 generator: torch.Generator | None = None) -> dict[str, float]:
    """PPO epochs over mini-batches with gradient accumulation over micro-batches; returns actor metrics.

    verl's names: `actor/entropy_loss` is the mean over mini-batches of the aggregated entropy during the update
    (`actor/entropy`, the rollout policy's entropy, is logged by the old-log-prob pass), `actor/kl_coef` the
    KL coefficient in use.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    sums: dict[str, float] = {}
    count = 0
    for _ in range(train.ppo_epochs):
        order = torch.randperm(len(batch), generator=generator) if train.shuffle else torch.arange(len(batch))
        for mini in micro_batches(order, train.mini_batch_size):
            stats = _mini_batch_step(model, optimizer, params, batch, mini, inputs, algo, train)
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v
            count += 1
    out = {f"actor/{k}": v / max(count, 1) for k, v in sums.items() if k != "skipped_steps"}
    out["actor/skipped_steps"] = sums.get("skipped_steps", 0.0)
    out["actor/lr"] = optimizer.param_groups[0]["lr"]
    out["actor/kl_coef"] = algo.kl_coef
    out["actor/num_updates"] = float(count)
    return out


def _mini_batch_step(model, optimizer, params, batch, mini, inputs, algo, train) -> dict[str, float]:
    """Accumulate the mini-batch gradient, clip, and step (skipped when the norm is not finite)."""
    optimizer.zero_grad(set_to_none=True)
    stats = {"pg_loss": 0.0, "entropy_loss": 0.0, "kl_loss": 0.0, "pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0,
             "ppo_kl": 0.0}
    order = row_order(batch.input_ids[mini], batch.attention_mask[mini], batch.response_mask[mini],
                      train.micro_batch_size, train.shared_prefix)  # [m]
    for positions in micro_batches(order, train.micro_batch_size):
        rows = mini[positions]  # [n]
        share = sub_batch_share(batch.response_mask[mini], positions, algo.loss_agg_mode)
        if share == 0.0:
            continue
        terms, metrics = loss_terms(model, batch, rows, inputs, algo, temperature=train.temperature,
                                    shared_prefix=train.shared_prefix)
        (share * weighted_total(terms, algo)).backward()
        stats["pg_loss"] += share * terms["pg"].item()
        stats["entropy_loss"] += share * terms["entropy"].item()
        stats["kl_loss"] += share * terms["kl"].item() if "kl" in terms else 0.0
        for k in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
            stats[k] += share * metrics[k]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, train.max_grad_norm).item()
    stats["grad_norm"] = grad_norm
    if math.isfinite(grad_norm):
        optimizer.step()
        stats["skipped_steps"] = 0.0
    else:
        stats["skipped_steps"] = 1.0
    optimizer.zero_grad(set_to_none=True)
    return stats

