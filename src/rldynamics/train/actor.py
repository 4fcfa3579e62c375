"""The actor update: PPO epochs over mini-batches of the batch (`train.update.optimize`).

The loss of a micro-batch is `analysis.objective.actor_terms` (one forward, the unweighted terms `pg`, `entropy`,
`kl`) weighted by `algo.losses.weighted_total`: the loss the gradient probe differentiates is the loss trained. The
loss settings (`algo.losses.PolicyLossSettings`) are read from the config once per update.

The update returns its statistics typed (`ActorUpdate`, each equal to its `actor/*` metric) with the trace of every
optimizer step (`train.update.StepTrace`); `trace_groups` adds per-parameter-group gradient norms (before and
after clipping) and update-to-weight ratios to the metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from rldynamics import dist
from rldynamics import metric_names as names
from rldynamics.algo.advantages import equal_reward_rows
from rldynamics.algo.losses import aggregate, weighted_total
from rldynamics.analysis.objective import ActorInputs, actor_terms, policy_loss_settings
from rldynamics.config import AlgoConfig, TrainConfig
from rldynamics.models.forward import micro_batches
from rldynamics.models.lora import adapter_dropout
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.train.update import Guard, LossFn, StepTrace, mean_stats, optimize

STATS = ("pg_loss", "entropy_loss", "kl_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")
TOKEN_STATS = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")  # token-level means


def update_mini_batches(train: TrainConfig, batch_size: int, generator: torch.Generator | None) -> list[torch.Tensor]:
    """The mini-batches of the update (row indices [m] each, one optimizer step each), epoch after epoch; each
    epoch's rows are shuffled by `generator` when `train.shuffle`."""
    minis = []
    for _ in range(train.ppo_epochs):
        order = torch.randperm(batch_size, generator=generator) if train.shuffle else torch.arange(batch_size)
        minis += micro_batches(order, train.mini_batch_size)
    return minis


def rows_after_first_step(minis: list[torch.Tensor], batch_size: int) -> torch.Tensor:
    """The rows no micro-batch of the first optimizer step forwards, in order ([K], maybe empty).

    The first step's forwards see the parameters that sampled the batch, so its rows' old log-probs are its own
    log-probs, detached (`update_actor` with `later_old`): only these rows need an old-log-prob pass. One epoch
    over one mini-batch leaves none (the update is one pass on the rollout policy); the default's two mini-batches
    leave half."""
    later = torch.ones(batch_size, dtype=torch.bool)  # [N]
    later[minis[0]] = False
    return later.nonzero().squeeze(1)  # [K]


@dataclass
class ActorUpdate:
    """What one actor update returns. The statistics are means over the update's optimizer steps, each equal to its
    `actor/*` metric."""

    entropy: float  # mean over mini-batches of the aggregated entropy during the update (`actor/entropy_loss`)
    metrics: dict[str, float]  # `actor/*`
    ppo_kl: float  # `actor/ppo_kl`: token mean of log(π_old / π)
    clipfrac_high: float  # `actor/pg_clipfrac` (verl's): share of tokens whose ratio clip is active (cispo: IS weight)
    clipfrac_low: float  # `actor/pg_clipfrac_lower` (verl's): share of tokens held by the dual-clip bound
    kl_loss: float | None  # `actor/kl_loss`: the KL term to the reference; None when off (no reference log-probs)
    logprobs: torch.Tensor | None = None  # [N, L] the rollout policy's log-probs of the sampled tokens as the update
    # took them (`record`, or always with `later_old`): read by the mismatch metrics in place of an old-log-prob pass
    token_entropy: torch.Tensor | None = None  # [N, L] the rollout policy's entropy at each sampled token, likewise
    steps: list[StepTrace] = field(default_factory=list)  # one per optimizer step, in order
    rollout_entropy: float | None = None  # the rollout policy's aggregated entropy, when the update took the old
    # log-probs of its first step's rows (`later_old`): the `actor/entropy` an old-log-prob pass would have given


def update_actor(model, optimizer, batch: RolloutBatch, inputs: ActorInputs, algo: AlgoConfig, train: TrainConfig,
                 generator: torch.Generator | None = None, record: bool = False, *, guard: Guard | None = None,
                 trace_groups: bool = False, later_old: tuple[torch.Tensor, torch.Tensor] | None = None,
                 minis: list[torch.Tensor] | None = None) -> ActorUpdate:
    """PPO epochs over mini-batches with gradient accumulation over micro-batches; returns the update's statistics,
    metrics and step traces (and with `record`, the log-probs and entropies its forwards computed, in one pass:
    each rank computes its own rows, summed over the ranks into the whole batch's).

    `minis`: the mini-batches (`update_mini_batches`; None: drawn here from `generator`, as a plan that chose
    `later_old`'s rows from them would have). `later_old` (with `inputs.old_logprobs` None): the old log-probs and
    entropies [N, L] of the rows after the first optimizer step of `minis` (`rows_after_first_step`; other rows
    0). The first step is then on the rollout policy itself (its own detached log-probs as the old ones), and
    every later step takes as old log-probs the first step's own for its rows and `later_old` for the rest: an
    old-log-prob pass over the first step's rows is not needed. The update then returns the merged log-probs and
    entropies (`logprobs`, `token_entropy`) and the rollout policy's aggregated entropy (`rollout_entropy`).

    verl's names: `actor/entropy_loss` is the mean over mini-batches of the aggregated entropy during the update
    (`actor/entropy`, the rollout policy's entropy, is logged by the old-log-prob pass), `actor/kl_coef` the
    KL coefficient in use. `actor/clip_hit_rate`: the share of optimizer steps whose gradient was clipped.

    `guard` and `trace_groups` go to `train.update.optimize` (a refused step counts in `actor/skipped_steps`);
    `trace_groups` adds the per-group metrics of `group_metrics`. Each step's trace says whether its
    mini-batch had a reward signal (`reward_signal_rows`).
    """
    settings = policy_loss_settings(algo)
    weights = settings.coefs
    merge = later_old is not None and inputs.old_logprobs is None
    own = torch.zeros(batch.response_mask.shape) if record or merge else None  # [N, L]
    own_entropy = torch.zeros(batch.response_mask.shape) if record or merge else None  # [N, L]

    def loss_with(step_inputs: ActorInputs, keep: bool) -> LossFn:
        def loss_of(rows: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            terms, metrics = actor_terms(model, batch, rows, step_inputs, settings, temperature=train.temperature,
                                         shared_prefix=train.shared_prefix, record=own if keep else None,
                                         record_entropy=own_entropy if keep else None)
            values = {"pg_loss": terms["pg"].item(), "entropy_loss": terms["entropy"].item(),
                      **({"kl_loss": terms["kl"].item()} if "kl" in terms else {}),
                      **{k: metrics[k] for k in TOKEN_STATS}}
            return weighted_total(terms, weights), values
        return loss_of

    def run(minis: list[torch.Tensor], step_inputs: ActorInputs, keep: bool) -> list[StepTrace]:
        _, steps = optimize(model, optimizer, batch, minis, loss_with(step_inputs, keep), stats=STATS,
                            token_stats=TOKEN_STATS, micro_batch_size=train.micro_batch_size,
                            max_grad_norm=train.max_grad_norm, agg_mode=settings.agg,
                            shared_prefix=train.shared_prefix, guard=guard, trace_groups=trace_groups,
                            signal_rows=reward_signal_rows(batch, algo))
        if keep:
            dist.sum_tensors(own, own_entropy)  # [N, L] each: every row was computed on one rank, zeros elsewhere
        return steps

    minis = update_mini_batches(train, len(batch), generator) if minis is None else minis
    seed = generator.initial_seed() if generator is not None else None
    rollout_entropy = None
    with adapter_dropout(model, seed):  # `model.lora.dropout` acts in the update's forwards alone, seeded by the step
        if not merge:
            steps = run(minis, inputs, record)
        else:  # the first step on the rollout policy, the later ones against its log-probs and `later_old`'s
            steps = run(minis[:1], inputs, True)
            first = torch.zeros(len(batch), dtype=torch.bool)  # [N]
            first[minis[0]] = True
            own = torch.where(first[:, None], own, later_old[0])  # [N, L]
            own_entropy = torch.where(first[:, None], own_entropy, later_old[1])  # [N, L]
            rollout_entropy = aggregate(own_entropy, batch.response_mask, settings.agg).item()
            steps += run(minis[1:], replace(inputs, old_logprobs=own), False) if len(minis) > 1 else []
    stats = mean_stats(steps)
    out = {names.actor(k): v for k, v in stats.items()}
    out[names.ACTOR_LR] = optimizer.param_groups[0]["lr"]
    out[names.KL_COEF] = settings.kl_coef
    out[names.CLIP_HIT_RATE] = sum(s.clipped for s in steps) / max(len(steps), 1)
    if trace_groups:
        out.update(group_metrics(steps, train.max_grad_norm))
    return ActorUpdate(entropy=stats["entropy_loss"], metrics=out, ppo_kl=stats["ppo_kl"],
                       clipfrac_high=stats["pg_clipfrac"], clipfrac_low=stats["pg_clipfrac_lower"],
                       kl_loss=stats["kl_loss"] if inputs.ref_logprobs is not None else None, logprobs=own,
                       token_entropy=own_entropy, steps=steps, rollout_entropy=rollout_entropy)


def reward_signal_rows(batch: RolloutBatch, algo: AlgoConfig) -> torch.Tensor | None:
    """[N] bool: the rows whose advantages carry a reward signal, under GRPO and RLOO those of
    groups whose rewards differ (`equal_reward_rows`); None for the other estimators (every row
    has one)."""
    return ~equal_reward_rows(batch.scores, batch.group_ids) if algo.group_relative else None


def group_metrics(steps: list[StepTrace], max_grad_norm: float) -> dict[str, float]:
    """Per parameter group, means over `steps` (traced with `trace_groups`): `actor/grad_norm/<group>` (pre-clip),
    `actor/grad_norm_clipped/<group>` (pre-clip × min(1, max_grad_norm / grad_norm)) and
    `actor/update_ratio/<group>` (sqrt(update_sq / weight_sq); 0 on a skipped step)."""
    sums: dict[str, float] = {}
    for step in steps:
        for key, value in _step_group_metrics(step, max_grad_norm).items():
            sums[key] = sums.get(key, 0.0) + value
    return {k: v / len(steps) for k, v in sums.items()}


def _step_group_metrics(step: StepTrace, max_grad_norm: float) -> dict[str, float]:
    """One step's per-group gradient norms (before and after clipping) and update-to-weight ratios."""
    scale = min(1.0, max_grad_norm / step.grad_norm) if step.grad_norm > 0 else 1.0  # clipping's factor
    out = {}
    for group, grad_sq in step.group_grad_sq.items():
        norm = math.sqrt(grad_sq)
        out[names.actor_group(names.GROUP_GRAD_NORM, group)] = norm
        out[names.actor_group(names.GROUP_GRAD_NORM_CLIPPED, group)] = norm * scale
        out[names.actor_group(names.GROUP_UPDATE_RATIO, group)] = _ratio(step.group_update_sq[group],
                                                                         step.group_weight_sq[group])
    return out


def _ratio(update_sq: float, weight_sq: float) -> float:
    """||update|| / ||weights||; 0 for no update, inf for an update of zero weights."""
    if update_sq == 0.0:
        return 0.0
    return math.sqrt(update_sq / weight_sq) if weight_sq > 0.0 else math.inf
