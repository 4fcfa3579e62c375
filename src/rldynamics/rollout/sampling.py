"""Sampling guard: temperature scaling plus a check that the sampling probabilities are defined.

HF `generate` raises a bare RuntimeError deep inside `torch.multinomial` ("probability tensor contains either
inf, nan or element < 0") when a policy's logits overflow (an exploded update such as `train.lr=1e6`, or a
temperature so small that logits / temperature overflow), and on CUDA the same condition is a device-side
assert that poisons the process. `SamplingGuard` divides the scores by the temperature itself (so it sees what
is sampled from) and raises `NonFiniteLogits` first, which the trainer handles like a non-finite gradient.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList


class NonFiniteLogits(RuntimeError):
    """The policy's next-token scores are NaN / +inf, or -inf everywhere: nothing can be sampled."""


class SamplingGuard(LogitsProcessor):
    """`scores / temperature`, raising NonFiniteLogits when a row cannot be turned into probabilities."""

    def __init__(self, temperature: float):
        self.temperature = temperature

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores / self.temperature  # [B, V]
        usable = ~(torch.isnan(scores) | torch.isposinf(scores)).any(-1) & (scores > -torch.inf).any(-1)  # [B]
        if not bool(usable.all()):
            raise NonFiniteLogits(f"{int((~usable).sum())} of {len(usable)} sequences have non-finite next-token "
                                  f"scores at temperature {self.temperature:g}")
        return scores


def sampling_guard(temperature: float) -> LogitsProcessorList:
    """The `logits_processor` argument of `generate` (pass `temperature=1.0` there: the guard applies it)."""
    return LogitsProcessorList([SamplingGuard(temperature)])
