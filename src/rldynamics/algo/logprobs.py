"""The log-prob of one token per row and the entropy of each row's distribution, from logits, in cache-sized chunks.

``selected_logprobs(logits [M, V], targets [M], temperature, with_entropy)`` returns ``log softmax(z / T)[target]``
and ``H = -sum p log p`` per row in float32, as ``torch.log_softmax`` and ``algo.losses.entropy_from_logprobs``
compute them, bit for bit, but as one autograd node (`SelectedLogProbs`) that works through the rows a chunk at a
time and saves only its input:

- Forward: each chunk of rows is cast to float32, divided by the temperature (`algo.losses.tempered`), and
  log-softmaxed; the chunk's target entries and entropies are kept, the chunk itself is dropped.
- Backward, from the upstream gradients ``g`` (log-probs) and ``h`` (entropies) of a row, with ``l`` its
  log-softmax and ``p = exp(l)``: the gradient with respect to ``l``, ``g [j = target] - h p_j (l_j + 1)``, goes
  through the log-softmax's own backward kernel (``u - p sum(u)``), then ``/ T``: in all,
  ``dz_j = (g [j = target] - p_j (g + h (l_j + H))) / T``. Each chunk's ``l`` is recomputed (the same operations,
  so the same bits) and its gradient written in the logits' dtype. With ``h = 0`` (an entropy coefficient of 0)
  this is the composition's backward bit for bit.
- Forward-mode (``torch.func.jvp``, the attribution's directional derivatives): with ``mu = sum_j p_j dz_j``,
  ``d logp = dz_target - mu`` and ``dH = -sum_j p_j dz_j (l_j + H)`` (for ``dz`` already divided by ``T``).

Composing the same operations eagerly writes every float32 temporary of all rows ([M, V]: the cast, the
division, the log-softmax, exp, product) to memory and reads it back in backward; in chunks small enough
they stay in the CPU's cache (`CHUNK_ELEMENTS`: a row or a few on a CPU; large chunks elsewhere, for few kernel
launches), and what is kept for backward is the logits alone (bfloat16 ones at half the bytes of one float32 copy).
Figures (`bench/logprobs.py`): docs/benchmarks.md, "Log-probs in cache-sized chunks".
"""

from __future__ import annotations

import torch

from rldynamics.algo.losses import entropy_from_logprobs, tempered

CHUNK_ELEMENTS = {"cpu": 2**16}  # float32 entries of a chunk's temporaries, by device type (CPU: 256 KiB, in cache)
OTHER_CHUNK_ELEMENTS = 2**25  # elsewhere (CUDA): large chunks, few kernel launches (128 MiB)


def chunk_rows(vocab: int, chunk_elements: int) -> int:
    """Rows per chunk: as many as `chunk_elements` entries hold, at least one."""
    return max(1, chunk_elements // max(vocab, 1))


def _log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-softmax of `logits` [m, V] / temperature, in float32 (float64 stays float64). [m, V]"""
    return torch.log_softmax(tempered(logits.to(_compute_dtype(logits)), temperature), dim=-1)


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


class SelectedLogProbs(torch.autograd.Function):
    """(log-prob of each row's target [M], entropy of each row [M] or an empty tensor), float32; see the module."""

    @staticmethod
    def forward(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = _compute_dtype(logits)
        logp = logits.new_empty(logits.shape[0], dtype=dtype)  # [M]
        entropy = logits.new_empty(logits.shape[0] if with_entropy else 0, dtype=dtype)  # [M] | [0]
        for start in range(0, logits.shape[0], rows):
            part = slice(start, start + rows)
            every = _log_softmax(logits[part], temperature)  # [m, V]
            logp[part] = every.gather(-1, targets[part, None]).squeeze(-1)  # [m]
            if with_entropy:
                entropy[part] = entropy_from_logprobs(every)  # [m]
        return logp, entropy

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        logits, targets, temperature, with_entropy, rows = inputs
        ctx.temperature, ctx.with_entropy, ctx.rows = temperature, with_entropy, rows
        ctx.save_for_backward(logits, targets, output[1])
        ctx.save_for_forward(logits, targets, output[1])

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor):
        logits, targets, _ = ctx.saved_tensors
        entropy_used = ctx.with_entropy and bool(grad_entropy.any())  # a zero coefficient adds nothing
        grad = torch.empty_like(logits)  # [M, V]
        for start in range(0, logits.shape[0], ctx.rows):
            part = slice(start, start + ctx.rows)
            every = _log_softmax(logits[part], ctx.temperature)  # [m, V]
            upstream = (every.exp() * (every + 1.0) * -grad_entropy[part, None] if entropy_used
                        else torch.zeros_like(every))  # [m, V] dH/dl = -p (l + 1)
            upstream.scatter_add_(-1, targets[part, None], grad_logp[part, None])  # + g at the target
            chunk = torch._log_softmax_backward_data(upstream, every, -1, every.dtype)  # [m, V]
            grad[part] = tempered(chunk, ctx.temperature)
        return grad, None, None, None, None

    @staticmethod
    def jvp(ctx, tangent: torch.Tensor, *_):
        logits, targets, entropy = ctx.saved_tensors
        dlogp = logits.new_empty(logits.shape[0], dtype=entropy.dtype)  # [M]
        dentropy = logits.new_empty(entropy.shape[0], dtype=entropy.dtype)  # [M] | [0]
        for start in range(0, logits.shape[0], ctx.rows):
            part = slice(start, start + ctx.rows)
            every = _log_softmax(logits[part], ctx.temperature)  # [m, V]
            dz = tempered(tangent[part].to(every.dtype), ctx.temperature)  # [m, V]
            p_dz = every.exp() * dz  # [m, V]
            dlogp[part] = dz.gather(-1, targets[part, None]).squeeze(-1) - p_dz.sum(-1)  # [m]
            if ctx.with_entropy:
                dentropy[part] = -(p_dz * (every + entropy[part, None])).sum(-1)  # [m]
        return dlogp, dentropy


def selected_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                      with_entropy: bool = False, chunk_elements: int | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 ``log softmax(logits / T)`` at `targets` [M] for `logits` [M, V], and each row's entropy (or None).

    One autograd node, in chunks of `chunk_elements` entries (None: the device's, `CHUNK_ELEMENTS`; see the
    module). ([M], [M] | None)"""
    elements = chunk_elements or CHUNK_ELEMENTS.get(logits.device.type, OTHER_CHUNK_ELEMENTS)
    logp, entropy = SelectedLogProbs.apply(logits, targets, temperature, with_entropy,
                                           chunk_rows(logits.shape[-1], elements))
    return logp, (entropy if with_entropy else None)
