"""The actor's objective on some rows of a rollout: one forward pass, then the unweighted loss terms.

The actor update (`train/actor.py`) and the gradient probe (`analysis/probe.py`) both call `actor_terms`, so the
loss the probe differentiates is the loss that is trained. The forward pass is `models.forward.token_logprobs`,
the terms are the pure `algo.losses.loss_terms`, weighted in one place by `algo.losses.weighted_total`. Both read
the loss settings from one `algo.losses.PolicyLossSettings`, built once per update or probe from the config by
`policy_loss_settings`. The rollout corrections (`algo.tis_cap`, `algo.mis`) weight the policy-gradient terms
there too, so the probe sees the corrected objective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rldynamics.algo.losses import PolicyLossSettings, loss_terms
from rldynamics.config import AlgoConfig
from rldynamics.models.forward import token_logprobs
from rldynamics.models.sharding import is_sharded
from rldynamics.rollout.batch import RolloutBatch


@dataclass
class ActorInputs:
    """Per-token tensors the actor loss needs besides the rollout itself (all [N, L], on CPU).

    `old_logprobs` None means the loss is on the rollout policy itself (the first optimizer step of an update,
    `train.actor.update_actor`): it uses its own log-probs, detached, as the old ones (ratio exactly 1), so no
    separate old-log-prob pass is needed for its rows.
    """

    old_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    ref_logprobs: torch.Tensor | None = None


def policy_loss_settings(cfg: AlgoConfig) -> PolicyLossSettings:
    """The actor loss's settings from the algorithm config (MIS on: `mis_band` = `mismatch_band`, else None)."""
    return PolicyLossSettings(kind=cfg.policy_loss, clip_low=cfg.clip_low, clip_high=cfg.clip_high, clip_c=cfg.clip_c,
                              cispo_clip_low=cfg.cispo_clip_low, agg=cfg.loss_agg_mode, kl_type=cfg.kl_type,
                              entropy_coef=cfg.entropy_coef, kl_coef=cfg.kl_coef, tis_cap=cfg.tis_cap,
                              mis_band=cfg.mismatch_band if cfg.mis else None, old_from=cfg.old_logprobs)


def actor_terms(model, batch: RolloutBatch, rows: torch.Tensor, inputs: ActorInputs, settings: PolicyLossSettings, *,
                temperature: float, component_advantages: dict[str, torch.Tensor] | None = None,
                shared_prefix: bool = True, record: torch.Tensor | None = None,
                record_entropy: torch.Tensor | None = None,
                ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Unweighted loss terms of the rows `rows` [n] of `batch` under `settings`, aggregated with `settings.agg`.

    Returns ({"pg", "entropy", "kl" (if a reference is given), "reward/<name>" per entry of
    `component_advantages` ([N, L] each)}, policy metrics), all from one forward pass (with a prompt shared by
    several rows forwarded once when `shared_prefix`, except on an FSDP2-sharded model: there every forward is a
    collective of all ranks, which must call the model equally often, and whether rows share a prompt is up to
    each rank's rows). `record` / `record_entropy`: [N, L] CPU tensors the rows' log-probs / entropies are written
    into (detached).
    """
    device = next(model.parameters()).device

    def at(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else values[rows].to(device)  # [n, L]

    mask = at(batch.response_mask)  # [n, L]
    logprobs, entropy = token_logprobs(model, at(batch.input_ids), at(batch.attention_mask), temperature=temperature,
                                       with_entropy=True, positions=mask,
                                       shared_prefix=shared_prefix and not is_sharded(model))  # [n, L], [n, L]
    if record is not None:
        record[rows] = logprobs.detach().to(record.device, record.dtype)
    if record_entropy is not None:
        record_entropy[rows] = entropy.detach().to(record_entropy.device, record_entropy.dtype)
    return loss_terms(logprobs, entropy, at(inputs.old_logprobs), at(inputs.advantages), mask, settings,
                      ref_logprobs=at(inputs.ref_logprobs),
                      component_advantages={k: at(a) for k, a in (component_advantages or {}).items()},
                      rollout_logprobs=at(batch.rollout_logprobs))
