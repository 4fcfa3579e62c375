"""Exact attribution of one training step's policy gradient to its trajectories, its groups and its tokens.

Definitions (one process; the kept batch as one mini-batch holding every row):
- The step's loss is ``L(θ) = weighted_total(actor_terms(model, batch, all rows, inputs, settings), settings.coefs)``,
  aggregated with ``settings.agg`` as the optimizer does, and ``g = ∇_θ L`` over the trainable parameters
  (``p.requires_grad``): the pre-clip gradient of the update (``train.update``), micro-batches weighted by
  ``sub_batch_share``.
- Rows: ``L = Σ_i s_i L_i`` with ``s_i = sub_batch_share(batch.response_mask, [i], settings.agg)`` and ``L_i`` the
  same loss over row i alone, so ``g_i = s_i ∇L_i`` satisfy ``Σ_i g_i = g`` exactly in every aggregation mode.
  ``share_i = <g_i, g> / ||g||²`` (the shares sum to 1; a negative share pulls against the update),
  ``cosine_i = <g_i, g> / (||g_i|| ||g||)``, ``norm_i = ||g_i||``. A row without response tokens has ``g_i = 0``:
  share 0, norm 0, cosine NaN (undefined, never 0).
- Groups (``batch.group_ids``): ``g_G = Σ_{i∈G} g_i``, with share, cosine and norm defined likewise.
- Tokens: L depends on θ only through the log-probs ``logp_t`` and entropies ``H_t`` of the sampled tokens, so
  ``<∇L, g> = Σ_t (∂L/∂logp_t · <∇logp_t, g> + ∂L/∂H_t · <∇H_t, g>)`` and
  ``score_t = (∂L/∂logp_t · <∇logp_t, g> + ∂L/∂H_t · <∇H_t, g>) / ||g||²``. The scores of row i sum to
  ``share_i`` (row i's tokens carry exactly ``s_i ∇L_i``) and all scores sum to 1; a score is 0 outside the
  response mask. ``∂L/∂logp`` and ``∂L/∂H`` come from autograd through ``algo.losses.loss_terms`` with the
  log-probs and entropies as leaf tensors (no model); ``<∇logp_t, g>`` and ``<∇H_t, g>`` for every token at once
  from one forward-mode product (``torch.func.jvp``, tangent g) over ``models.forward.token_logprobs``.

How it is computed: one pass of backwards for g (micro-batches of ``micro_batch_size``); one backward per row
(micro-batch size 1), each row's gradient folded into its group's vector and into ``Σ_i g_i`` (``residual``
measures how closely that sum rebuilds g: float rounding only); one forward-mode pass in micro-batches for the
tokens. Every dot product and norm accumulates in float64 from float32 gradients. In bfloat16 compute
(``models.precision.compute_in``) the identities hold to bfloat16 rounding (a tiny Llama: Σ_i g_i within 4e-3 of g,
relative, the rows' token scores within 6e-4 of their shares; SmolLM2-135M on a recorded step of 4 rows: the shares
summed to 1.021).

Forward-mode AD has no rule for the fused attention kernels (CPU SDPA raises NotImplementedError), so the
forward-mode pass runs with the model switched to eager attention and back (``eager_attention``), and under
``torch.no_grad`` (no graph is kept, and ``models.precision`` checkpointing, which acts only with gradients on,
stays out of the way; transformers' own ``gradient_checkpointing_enable``, which the project does not use, is
refused). It must differentiate the function backward differentiates: an embedding's padding row
gets no gradient through its lookups (``padding_idx``), while forward-mode AD's embedding rule would carry the
tangent through them, so those lookups are held constant (``padding_rows_constant``; it matters when the pad
token is also an attended token, such as Qwen's end-of-text). Prompts are never shared across rows
(``shared_prefix=False``): L is the loss of unshared forwards, equal to the shared one up to float rounding.

Memory: three flat float32 vectors of the trainable parameters (g, the current group's vector, ``Σ_i g_i``), one
row's per-parameter gradient at a time, and a forward-mode micro-batch (primal and tangent activations, no graph).
Read-only: the parameters are untouched (bit-identical), ``.grad`` is never written (``torch.autograd.grad``), the
RNG streams are restored and the attention implementation is put back. The passes must see the same function, so
the forward must be deterministic (no active dropout). One process only: the rows' gradients are
whole vectors, which a sharded or replicated update never gathers.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.func import functional_call, jvp

from rldynamics import dist
from rldynamics.algo.losses import PolicyLossSettings, loss_terms, weighted_total
from rldynamics.algo.shares import sub_batch_share
from rldynamics.analysis.engines import param_views, zeros_full
from rldynamics.analysis.gram import dot64
from rldynamics.analysis.objective import ActorInputs, actor_terms
from rldynamics.models.forward import micro_batches, token_logprobs
from rldynamics.rollout.batch import RolloutBatch


@dataclass
class Attribution:
    """One step's gradient g split over rows, groups and tokens (module docstring). Read by the caller's report."""

    grad_norm: float  # ||g||: the pre-clip norm of the update's gradient
    residual: float  # ||Σ_i g_i - g|| / ||g||: how closely the rows rebuild g (float rounding; NaN when g = 0)
    row_share: torch.Tensor  # [N] float64 <g_i, g> / ||g||², sums to 1
    row_cosine: torch.Tensor  # [N] float64 cos(g_i, g); NaN for a row without gradient
    row_norm: torch.Tensor  # [N] float64 ||g_i||
    row_group: torch.Tensor  # [N] long: each row's group id (batch.group_ids)
    group_ids: torch.Tensor  # [G] long: the groups, in order of first appearance
    group_share: torch.Tensor  # [G] float64 <g_G, g> / ||g||², sums to 1
    group_cosine: torch.Tensor  # [G] float64 cos(g_G, g); NaN for a group without gradient
    group_norm: torch.Tensor  # [G] float64 ||g_G||
    token_scores: torch.Tensor  # [N, L] float32: each sampled token's part of the shares, 0 outside the mask
    response_mask: torch.Tensor  # [N, L] bool: the scored tokens

    def top_rows(self, k: int, *, absolute: bool = False) -> torch.Tensor:
        """The `k` rows of largest share (of largest |share| when `absolute`), largest first. [min(k, N)]"""
        key = self.row_share.abs() if absolute else self.row_share  # [N]
        return _top(key, k)

    def top_groups(self, k: int, *, absolute: bool = False) -> torch.Tensor:
        """The ids of the `k` groups of largest share (|share| when `absolute`), largest first. [min(k, G)]"""
        key = self.group_share.abs() if absolute else self.group_share  # [G]
        return self.group_ids[_top(key, k)]

    def top_tokens(self, row: int, k: int) -> torch.Tensor:
        """Positions of row `row`'s `k` sampled tokens of largest |score|, largest first. [min(k, tokens)]"""
        positions = self.response_mask[row].nonzero().squeeze(1)  # [T_i]
        return positions[_top(self.token_scores[row, positions].abs(), k)]


def _top(key: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the `k` largest entries of `key` [n], largest first (NaN last, stable among ties). [min(k, n)]"""
    filled = torch.where(key.isnan(), torch.full_like(key, -math.inf), key)  # [n]
    return torch.argsort(filled, descending=True, stable=True)[:k]


def attribute(model, batch: RolloutBatch, inputs: ActorInputs, settings: PolicyLossSettings, *, temperature: float,
              micro_batch_size: int) -> Attribution:
    """Attribute the gradient of the step's loss over `batch` to its rows, groups and tokens (module docstring).

    Args:
        model: the actor (a causal LM; one process).
        batch, inputs, settings, temperature: the step's rollout, loss inputs and loss settings, as the update has
            them (`analysis.objective.actor_terms`).
        micro_batch_size: rows per forward in the passes over the whole batch (the rows' own passes take one each).
    """
    if dist.distributed():
        raise RuntimeError("attribute runs in one process: the rows' gradients are whole vectors, which a sharded "
                           "or replicated update never gathers")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if transformers_checkpointing(model):
        raise ValueError("transformers' gradient_checkpointing_enable makes the embeddings' outputs require grad, "
                         "which forward-mode AD refuses; checkpoint with models.precision.enable_checkpointing "
                         "(model.gradient_checkpointing=true) instead")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    devices = sorted({p.device.index or 0 for _, p in named if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices, device_type="cuda"):  # dropout draws, if any, are undone
        grad = batch_gradient(model, batch, inputs, settings, [p for _, p in named], temperature=temperature,
                              micro_batch_size=micro_batch_size)  # [P]
        rows = row_gradients(model, batch, inputs, settings, [p for _, p in named], grad, temperature=temperature)
        logp, ent, dlogp, dent = directional_derivatives(model, batch, named, grad, temperature=temperature,
                                                         micro_batch_size=micro_batch_size)  # [N, L] each
    dl_dlogp, dl_dent = token_derivatives(logp, ent, batch, inputs, settings)  # [N, L] each
    sq = float(dot64(grad, grad))
    scores = (dl_dlogp.double() * dlogp.double() + dl_dent.double() * dent.double()) / sq  # [N, L]
    mask = batch.response_mask.bool()  # [N, L]
    return Attribution(
        grad_norm=math.sqrt(sq), residual=rows.residual_sq ** 0.5 / math.sqrt(sq) if sq > 0 else math.nan,
        row_share=rows.row_dot / sq, row_cosine=_cosine(rows.row_dot, rows.row_sq, sq), row_norm=rows.row_sq.sqrt(),
        row_group=batch.group_ids.clone(), group_ids=rows.group_ids, group_share=rows.group_dot / sq,
        group_cosine=_cosine(rows.group_dot, rows.group_sq, sq), group_norm=rows.group_sq.sqrt(),
        token_scores=torch.where(mask, scores, 0.0).float(), response_mask=mask)


def transformers_checkpointing(model: torch.nn.Module) -> bool:
    """Whether transformers' `gradient_checkpointing_enable` is on in `model`: the flag it sets on
    its modules, read from the modules themselves, not through a model property that a wrapper or
    another transformers version may lack or deprecate."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _cosine(dots: torch.Tensor, squares: torch.Tensor, grad_sq: float) -> torch.Tensor:
    """<v, g> / (||v|| ||g||) per entry; NaN where v or g is the zero vector. [n] float64"""
    norms = (squares * grad_sq).sqrt()  # [n]
    return torch.where(norms > 0, dots / norms, math.nan)  # [n]


def step_loss(model, batch: RolloutBatch, rows: torch.Tensor, inputs: ActorInputs, settings: PolicyLossSettings,
              temperature: float) -> torch.Tensor:
    """The training loss over `rows` [n] alone (unshared forward), as the update weights its terms. []"""
    terms, _ = actor_terms(model, batch, rows, inputs, settings, temperature=temperature, shared_prefix=False)
    return weighted_total(terms, settings.coefs)  # []


def batch_gradient(model, batch: RolloutBatch, inputs: ActorInputs, settings: PolicyLossSettings,
                   params: list[torch.Tensor], *, temperature: float, micro_batch_size: int) -> torch.Tensor:
    """g = ∇L over the whole batch, micro-batch by micro-batch, each weighted by its `sub_batch_share`. [P] float32"""
    grad = zeros_full(params)  # [P]
    views = param_views(grad, params)
    for rows in micro_batches(torch.arange(len(batch)), micro_batch_size):
        share = sub_batch_share(batch.response_mask, rows, settings.agg)
        if share == 0.0:
            continue
        parts = torch.autograd.grad(step_loss(model, batch, rows, inputs, settings, temperature), params,
                                    allow_unused=True)
        for view, part in zip(views, parts, strict=True):
            if part is not None:
                view.add_(part.float(), alpha=share)  # param shape
    return grad  # [P]


@dataclass
class RowGradients:
    """Inner products of every row's and group's gradient with g (float64, on CPU)."""

    row_dot: torch.Tensor  # [N] <g_i, g>
    row_sq: torch.Tensor  # [N] ||g_i||²
    group_ids: torch.Tensor  # [G] long, in order of first appearance
    group_dot: torch.Tensor  # [G] <g_G, g>
    group_sq: torch.Tensor  # [G] ||g_G||²
    residual_sq: float  # ||Σ_i g_i - g||²


def row_gradients(model, batch: RolloutBatch, inputs: ActorInputs, settings: PolicyLossSettings,
                  params: list[torch.Tensor], grad: torch.Tensor, *, temperature: float) -> RowGradients:
    """One backward per row (``g_i = s_i ∇L_i``), each folded into its group's vector; dots with `grad` [P]."""
    grad_views = param_views(grad, params)
    group = zeros_full(params)  # [P] the current group's g_G
    group_views = param_views(group, params)
    total = zeros_full(params)  # [P] Σ_i g_i
    row_dot = torch.zeros(len(batch), dtype=torch.float64)  # [N]
    row_sq = torch.zeros(len(batch), dtype=torch.float64)  # [N]
    groups = batch.group_rows()
    group_dot = torch.zeros(len(groups), dtype=torch.float64)  # [G]
    group_sq = torch.zeros(len(groups), dtype=torch.float64)  # [G]
    for j, members in enumerate(groups.values()):
        group.zero_()
        for i in members:
            share = sub_batch_share(batch.response_mask, torch.tensor([i]), settings.agg)
            if share == 0.0:
                continue
            parts = torch.autograd.grad(step_loss(model, batch, torch.tensor([i]), inputs, settings, temperature),
                                        params, allow_unused=True)
            dot, sq = _fold(parts, share, grad_views, group_views)
            row_dot[i], row_sq[i] = dot, sq
        total.add_(group)
        group_dot[j], group_sq[j] = float(dot64(group, grad)), float(dot64(group, group))
    total.sub_(grad)  # [P] Σ_i g_i - g
    return RowGradients(row_dot, row_sq, torch.tensor(list(groups), dtype=torch.long), group_dot, group_sq,
                        float(dot64(total, total)))


def _fold(parts: tuple[torch.Tensor | None, ...], share: float, grad_views: list[torch.Tensor],
          group_views: list[torch.Tensor]) -> tuple[float, float]:
    """Add ``share · parts`` (a row's per-parameter gradient) to its group's views; return ``(<g_i, g>, ||g_i||²)``."""
    dot = torch.zeros((), dtype=torch.float64, device=grad_views[0].device if grad_views else "cpu")
    sq = torch.zeros_like(dot)
    for part, grad_view, group_view in zip(parts, grad_views, group_views, strict=True):
        if part is None:
            continue
        scaled = part.float() * share  # param shape
        dot += dot64(scaled, grad_view)
        sq += dot64(scaled, scaled)
        group_view.add_(scaled)
    return float(dot), float(sq)


def token_derivatives(logprobs: torch.Tensor, entropy: torch.Tensor, batch: RolloutBatch, inputs: ActorInputs,
                      settings: PolicyLossSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """∂L/∂logp and ∂L/∂H of the whole batch's loss at these log-probs and entropies ([N, L] each, leaf tensors).

    Old log-probs None: `loss_terms` takes the leaf's own values, detached (ratio exactly 1), as the update does.
    Returns ([N, L], [N, L]) float32, 0 where L does not depend on the entry.
    """
    logp = logprobs.detach().float().requires_grad_(True)  # [N, L]
    ent = entropy.detach().float().requires_grad_(True)  # [N, L]
    terms, _ = loss_terms(logp, ent, inputs.old_logprobs, inputs.advantages, batch.response_mask, settings,
                          ref_logprobs=inputs.ref_logprobs, rollout_logprobs=batch.rollout_logprobs)
    loss = weighted_total(terms, settings.coefs)  # []
    d_logp, d_ent = torch.autograd.grad(loss, [logp, ent], allow_unused=True)
    return (torch.zeros_like(logp) if d_logp is None else d_logp,  # [N, L]
            torch.zeros_like(ent) if d_ent is None else d_ent)  # [N, L]


class _TokenScores(torch.nn.Module):
    """`token_logprobs` of the sampled tokens (with entropies) as one module call, for `functional_call`."""

    def __init__(self, model, temperature: float):
        super().__init__()
        self.model = model
        self.temperature = temperature

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs(self.model, input_ids, attention_mask, temperature=self.temperature, with_entropy=True,
                              positions=positions, shared_prefix=False)  # [n, L], [n, L]


def directional_derivatives(model, batch: RolloutBatch, named: list[tuple[str, torch.Tensor]], tangent: torch.Tensor,
                            *, temperature: float, micro_batch_size: int,
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logp, H and their derivatives <∇logp_t, v>, <∇H_t, v> along `tangent` v [P] for every sampled token, by
    forward-mode AD (eager attention, no graph), micro-batch by micro-batch.

    Returns (logp, H, dlogp, dH), [N, L] float32 each on CPU, 0 outside the response mask.
    """
    device = tangent.device
    params = [p for _, p in named]
    primals = {f"model.{n}": p.detach() for n, p in named}
    tangents = {f"model.{n}": v.to(p.dtype) for (n, p), v in zip(named, param_views(tangent, params), strict=True)}
    wrapper = _TokenScores(model, temperature)
    out = [torch.zeros(batch.response_mask.shape) for _ in range(4)]  # logp, H, dlogp, dH: [N, L] each
    with eager_attention(model), padding_rows_constant(model), torch.no_grad():
        for rows in micro_batches(torch.arange(len(batch)), micro_batch_size):
            args = (batch.input_ids[rows].to(device), batch.attention_mask[rows].to(device),
                    batch.response_mask[rows].to(device))

            def scored(values: dict[str, torch.Tensor], args=args) -> tuple[torch.Tensor, torch.Tensor]:
                return functional_call(wrapper, values, args)

            (logp, ent), (dlogp, dent) = jvp(scored, (primals,), (tangents,))  # [n, L] each
            for buffer, values in zip(out, (logp, ent, dlogp, dent), strict=True):
                buffer[rows] = values.float().cpu()
    return tuple(out)


@contextlib.contextmanager
def eager_attention(model) -> Iterator[None]:
    """`model` with eager attention inside the block (forward-mode AD has no rule for the fused SDPA kernels), its
    own implementation restored on exit."""
    config = getattr(model, "config", None)
    before = getattr(config, "_attn_implementation", None)
    if before is None or before == "eager":
        yield
        return
    _set_attention(model, "eager")
    if config._attn_implementation != "eager":
        raise RuntimeError(f"could not switch {type(model).__name__} to eager attention (forward-mode AD needs it)")
    try:
        yield
    finally:
        _set_attention(model, before)


@contextlib.contextmanager
def padding_rows_constant(model) -> Iterator[None]:
    """Inside the block, every lookup of an `nn.Embedding`'s `padding_idx` row carries no forward-mode derivative.

    Backward never sends gradient into the padding row through a lookup (`nn.Embedding`'s `padding_idx` contract),
    so g is the gradient of a loss in which those lookups are constants; forward-mode AD's rule for `embedding`
    ignores `padding_idx` and would differentiate them (the padding row still moves g where it is used otherwise,
    e.g. as a tied LM head's row for a pad token that doubles as end-of-sequence). A forward hook detaches them.
    """
    hooks = [m.register_forward_hook(_detach_padding, with_kwargs=True) for m in model.modules()
             if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _detach_padding(module: torch.nn.Embedding, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
    ids = args[0] if args else kwargs["input"]  # [...]
    return torch.where((ids == module.padding_idx)[..., None], output.detach(), output)  # [..., D]


def _set_attention(model, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name
