"""Optimizer steps over mini-batches with exact gradient accumulation over micro-batches (actor and critic).

- Each mini-batch is one optimizer step. Its rows are split into micro-batches (from shortest to longest when
  `sort_by_length`, so each forward is trimmed to its own longest row, or keeping the rows of a shared prompt
  together with `shared_prefix`: `models.forward.row_order`); each micro-batch's loss is multiplied by
  `sub_batch_share`, the share of the mini-batch's aggregation weight its rows carry, so the accumulated gradient
  is that of the whole mini-batch aggregated at once, whatever the micro-batch size.
- Statistics are exact too: a loss value is weighted like the loss (`sub_batch_share`), a token-level mean
  (clip fractions, `ppo_kl`, `vpred_mean`) by the micro-batch's share of the mini-batch's response tokens.
- The gradient is clipped to `max_grad_norm` (the pre-clip norm is the `grad_norm` statistic); a non-finite norm
  skips the optimizer step and counts it in `skipped_steps`.
- Every optimizer step is recorded as a `StepTrace` (pre-clip norm, clipping, skip, its own
  statistics, whether its mini-batch had a reward signal: `signal_rows`). A `guard` sees each step's
  trace before `optimizer.step()` and may refuse the step: the parameters and the optimizer state
  are then left exactly as they were, and the step counts in `skipped_steps` like a non-finite one.
- `trace_groups`: the trace also holds per-parameter-group (`parameter_group`) squared norms of the pre-clip
  gradient, of the weights before the step and of the change the optimizer applied (read from a copy of the
  weights taken before the step), for the update-to-weight ratio whatever the optimizer.
- Several ranks: every rank holds the whole batch and takes a contiguous block of each mini-batch's row order
  (`dist.rank_chunks`); shares are still taken against the whole mini-batch, so the gradients summed over ranks (FSDP2's
  reduce-scatter, or `sync_gradients` for replicas) and the statistics summed over ranks are those of one
  process. Sharded models run a forward/backward only in step with every rank: a rank with fewer micro-batches
  (or one without response tokens) runs its first row with weight 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rldynamics import dist
from rldynamics.algo.shares import sub_batch_share
from rldynamics.models.forward import row_order
from rldynamics.models.precision import weights_cast_once
from rldynamics.models.sharding import clip_gradients, is_sharded, local, sync_gradients
from rldynamics.rollout.batch import RolloutBatch

LossFn = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]]

_BLOCKS = ("layers", "h", "blocks")  # `<container>.<i>.`: a transformer block (Llama/Qwen, GPT-2, others)
_LM_HEADS = ("lm_head", "embed_out")  # GPT-NeoX calls its LM head `embed_out`
_VALUE_HEADS = ("head", "value_head", "v_head", "score")  # `models.loading.ValueModel.head`, TRL, verl
_EMBEDS = ("wte", "wpe")  # GPT-2's token and position embeddings (others name theirs `*embed*`)


@dataclass
class StepTrace:
    """One optimizer step of an update.

    A guard (`optimize`) sees the trace before the step: `skipped` False and `group_update_sq` empty; `optimize`
    then completes the same object.
    """

    grad_norm: float  # global L2 norm of the mini-batch gradient before clipping (nan/inf when non-finite)
    clipped: bool  # grad_norm > max_grad_norm: clipping scaled the gradient down
    skipped: bool  # no optimizer step: a non-finite norm, or the guard refused it
    group_grad_sq: dict[str, float]  # squared pre-clip gradient norm per parameter group (sums to grad_norm**2)
    group_update_sq: dict[str, float]  # squared norm of the change the optimizer applied, per group (0 when skipped)
    group_weight_sq: dict[str, float]  # squared norm of the group's weights before the step
    stats: dict[str, float]  # this step's own share-weighted statistics (the keys `optimize` averages)
    # some row of the mini-batch has a reward signal (False: its advantages are all 0, so its
    # gradient is the regularisers' alone; `optimize`'s `signal_rows`)
    signal: bool = True


Guard = Callable[[StepTrace], bool]  # True: refuse this optimizer step


def parameter_group(name: str) -> str:
    """The group of a parameter, from its name alone: `embed`, `layer.<i>`, `norm`, `lm_head`, `value_head`,
    `other`.

    Rules, in order: a `layers.<i>.`, `h.<i>.` or `blocks.<i>.` part is transformer block i; a module named
    `lm_head` (or GPT-NeoX's `embed_out`) is the LM head; a module named `head`, `value_head`, `v_head` or `score`
    a critic's value head; a name containing `embed` (or GPT-2's `wte`, `wpe`) the embedding; any other name
    containing `norm` (or GPT-2's `ln_f`) the final norm. A tied LM head is the embedding's parameter, listed once
    (`named_parameters`) under the embedding's name.

    >>> [parameter_group(n) for n in ("model.embed_tokens.weight", "model.layers.3.mlp.up_proj.weight",
    ...                               "transformer.h.0.ln_1.bias", "model.norm.weight", "lm_head.weight")]
    ['embed', 'layer.3', 'layer.0', 'norm', 'lm_head']
    >>> [parameter_group(n) for n in ("backbone.embed_tokens.weight", "head.bias", "transformer.ln_f.weight", "x")]
    ['embed', 'value_head', 'norm', 'other']
    """
    parts = name.split(".")
    modules = parts[:-1]  # without `weight` / `bias`
    for i in range(len(parts) - 2):
        if parts[i] in _BLOCKS and parts[i + 1].isdigit():
            return f"layer.{int(parts[i + 1])}"
    if any(m in _LM_HEADS for m in modules):
        return "lm_head"
    if any(m in _VALUE_HEADS for m in modules):
        return "value_head"
    if "embed" in name or any(m in _EMBEDS for m in modules):
        return "embed"
    if "norm" in name or "ln_f" in modules:
        return "norm"
    return "other"


@dataclass
class _Groups:
    """The parameter group of each trained parameter."""

    names: list[str]  # the groups, in order of first appearance
    index: list[int]  # per parameter: its group's position in `names`
    sharded: bool  # FSDP2: each rank holds shards, squares are summed over ranks

    @classmethod
    def of(cls, model: torch.nn.Module) -> _Groups:
        groups = [parameter_group(n) for n, p in model.named_parameters() if p.requires_grad]
        names = list(dict.fromkeys(groups))
        return cls(names, [names.index(g) for g in groups], is_sharded(model))

    def squares(self, norms: list[torch.Tensor]) -> dict[str, float]:
        """Squared L2 norm per group from each parameter's (local) norm (0-dim tensors, one device sync)."""
        sums = [0.0] * len(self.names)
        for i, norm in zip(self.index, torch.stack(norms).tolist() if norms else [], strict=True):
            sums[i] += norm * norm
        return dict(zip(self.names, dist.global_sum(sums) if self.sharded else sums, strict=True))


def optimize(model, optimizer, batch: RolloutBatch, minis: list[torch.Tensor], loss_of: LossFn, *,
             stats: tuple[str, ...], token_stats: tuple[str, ...] = (), micro_batch_size: int, max_grad_norm: float,
             agg_mode: str, sort_by_length: bool = True, shared_prefix: bool = False, guard: Guard | None = None,
             trace_groups: bool = False, signal_rows: torch.Tensor | None = None,
             ) -> tuple[dict[str, float], list[StepTrace]]:
    """One optimizer step per mini-batch of `minis` (row indices of `batch`); returns the step statistics and the
    trace of every step.

    Args:
        loss_of: rows [n] -> (loss aggregated over those rows alone, {statistic: value}); called once per
            micro-batch that has response tokens.
        stats: the statistics `loss_of` reports, each a loss value aggregated like the loss, or, those also in
            `token_stats`, a mean over the rows' response tokens.
        guard: called with each step's trace after the gradient is accumulated, synced, measured and clipped, before
            `optimizer.step()`; True refuses the step (parameters and optimizer state untouched). Not asked when
            the norm is not finite (skipped anyway). Several ranks: a step is refused when any rank's guard refuses.
        trace_groups: fill the traces' per-group dicts (`parameter_group`). Costs a norm per parameter of the
            gradient and of the weights, and, for each step taken, a copy of this rank's trainable parameters
            (one extra model's worth of memory in the parameters' dtype, held during `optimizer.step()`) and a
            norm of each parameter's change. False: the group dicts are empty and nothing is copied.
        signal_rows: [N] bool, the rows of `batch` whose advantages carry a reward signal; a
            mini-batch with none is traced with `signal` False (the guard sees it). None: every row
            has one.
    Returns:
        The mean over optimizer steps of each statistic (share-weighted over a step's micro-batches) and of
        `grad_norm`, `skipped_steps` (a count: non-finite norms and steps the guard refused) and `num_updates`;
        and one `StepTrace` per mini-batch, in order.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = _Groups.of(model) if trace_groups else None
    traces = []
    for mini in minis:
        order = (row_order(batch.input_ids[mini], batch.attention_mask[mini], batch.response_mask[mini],
                           micro_batch_size, shared_prefix) if sort_by_length else torch.arange(len(mini)))  # [m]
        values = _accumulate(model, optimizer, batch, mini, order, loss_of, stats, token_stats, micro_batch_size,
                             agg_mode)
        signal = signal_rows is None or bool(signal_rows[mini].any())
        traces.append(_step(model, optimizer, params, values, max_grad_norm, guard, groups, signal))
    return mean_stats(traces), traces


def mean_stats(traces: list[StepTrace]) -> dict[str, float]:
    """The mean over steps of each statistic, `skipped_steps` (a count) and `num_updates`."""
    sums: dict[str, float] = {}
    for trace in traces:
        for k, v in {**trace.stats, "skipped_steps": float(trace.skipped)}.items():
            sums[k] = sums.get(k, 0.0) + v
    count = len(traces)
    out = {k: v / max(count, 1) for k, v in sums.items() if k != "skipped_steps"}
    out["skipped_steps"] = sums.get("skipped_steps", 0.0)
    out["num_updates"] = float(count)
    return out


def _accumulate(model, optimizer, batch: RolloutBatch, mini: torch.Tensor, order: torch.Tensor, loss_of: LossFn,
                stats: tuple[str, ...], token_stats: tuple[str, ...], micro_batch_size: int,
                agg_mode: str) -> dict[str, float]:
    """Accumulate the mini-batch gradient over micro-batches of `order` [m] and sync it over ranks; returns the
    step's statistics (summed over ranks)."""
    optimizer.zero_grad(set_to_none=True)
    out = dict.fromkeys(stats, 0.0)
    with weights_cast_once(model):
        for positions in dist.rank_chunks(order, micro_batch_size, lockstep=is_sharded(model)):
            share = 0.0 if positions is None else sub_batch_share(batch.response_mask[mini], positions, agg_mode)
            if share == 0.0 and not is_sharded(model):
                continue
            loss, values = loss_of(mini[order[:1] if positions is None else positions])
            (share * loss).backward()
            if share == 0.0:
                continue
            tokens = sub_batch_share(batch.response_mask[mini], positions, "token-mean")
            for k, v in values.items():
                out[k] += (tokens if k in token_stats else share) * v
    sync_gradients(model)
    return dict(zip(out, dist.global_sum(list(out.values())), strict=True))


def _step(model, optimizer, params: list[torch.Tensor], values: dict[str, float], max_grad_norm: float,
          guard: Guard | None, groups: _Groups | None, signal: bool = True) -> StepTrace:
    """Measure and clip the accumulated gradient, ask the guard, and step (skipped when the norm is not finite or
    the guard refuses); the gradients are zeroed either way."""
    grad_norms = _gradient_norms(params) if groups else None
    grad_sq = groups.squares(grad_norms) if groups else {}
    weight_sq = groups.squares([_norm(p) for p in params]) if groups else {}
    taken = None if grad_norms is None or is_sharded(model) else [
        norm for norm, p in zip(grad_norms, params, strict=True) if p.grad is not None]  # clipping's own norms
    grad_norm = clip_gradients(params, max_grad_norm, taken)
    trace = StepTrace(grad_norm=grad_norm, clipped=grad_norm > max_grad_norm, skipped=False, group_grad_sq=grad_sq,
                      group_update_sq={}, group_weight_sq=weight_sq,
                      stats={**values, "grad_norm": grad_norm}, signal=signal)
    trace.skipped = not math.isfinite(grad_norm) or (guard is not None and not dist.all_true(not guard(trace)))
    if trace.skipped:
        trace.group_update_sq = dict.fromkeys(groups.names, 0.0) if groups else {}
    else:
        trace.group_update_sq = _traced_step(optimizer, params, groups)
    optimizer.zero_grad(set_to_none=True)
    return trace


def _traced_step(optimizer, params: list[torch.Tensor], groups: _Groups | None) -> dict[str, float]:
    """`optimizer.step()`; with `groups`, the squared norm per group of the change it applied.

    The change is written into the float32 copy taken before the step (before - after, whose norm is that of
    after - before: negation is exact), so it needs no tensor of its own."""
    before = [local(p).detach().to(torch.float32, copy=True) for p in params] if groups else None
    optimizer.step()
    if groups is None:
        return {}
    return groups.squares([_norm(b.sub_(local(p).detach())) for p, b in zip(params, before, strict=True)])


def _gradient_norms(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each parameter's gradient norm, this rank's part (0, float32, for a missing gradient), taken as
    `clip_grad_norm_` takes it (`torch._foreach_norm`), so that clipping can reuse them. [0-dim] per parameter"""
    present = [local(p.grad).detach() for p in params if p.grad is not None]
    norms = iter(torch._foreach_norm(present) if present else [])
    return [next(norms).float() if p.grad is not None else _norm(None, p) for p in params]


def _norm(tensor: torch.Tensor | None, like: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 L2 norm of this rank's part of `tensor`; 0 for a missing gradient (placed like `like`). 0-dim"""
    if tensor is None:
        return torch.zeros((), device=local(like).device)
    return torch.linalg.vector_norm(local(tensor).detach(), dtype=torch.float32)
