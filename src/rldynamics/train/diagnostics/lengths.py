"""Reply lengths and truncation of the whole rollout, per reply (a turn of a multi-turn trajectory is one reply):

- `response_length/clip_ratio`: the share of replies that reached `env.max_new_tokens` (verl's name; with one turn
  it is verl's share of responses at the length limit). Replies cut off there are closed by the chat template
  and graded as written, so a rising share often means the policy rambles or loops.
- `response_length/reply_mean`, `response_length/reply_max`: sampled tokens per reply.

`response_length/mean|max|min` (`train/batch_ops.py` `data_metrics`) are whole trajectories of the filtered batch.
"""

from __future__ import annotations

from rldynamics import metric_names as names
from rldynamics.analysis.health_signals import reply_lengths
from rldynamics.config import Config
from rldynamics.train.diagnostics.base import ROLLOUT, Diagnostic, DiagnosticResult, StepRecord
from rldynamics.train.session import Session


class ReplyLengths(Diagnostic):
    """Tokens per reply and the share of replies cut off at `env.max_new_tokens`, on every step."""

    name, point = "reply_lengths", ROLLOUT

    @staticmethod
    def enabled(cfg: Config) -> bool:
        return True

    def run(self, s: Session, record: StepRecord) -> DiagnosticResult:
        lengths = reply_lengths(record.rollout.response_mask)
        if not lengths:
            return DiagnosticResult({})
        cap = self.cfg.env.max_new_tokens
        return DiagnosticResult({names.RESPONSE_CLIP_RATIO: sum(n >= cap for n in lengths) / len(lengths),
                                 names.response_length("reply_mean"): sum(lengths) / len(lengths),
                                 names.response_length("reply_max"): float(max(lengths))})
