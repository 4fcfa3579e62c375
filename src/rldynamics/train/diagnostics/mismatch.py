"""The sampler/trainer mismatch of the step's batch (`rollout/corr/*`, docs/vllm.md) as a diagnostic.

Due on every step of a run that measures it (`algo.rollout_corr.measures_mismatch`: a rollout engine other than
the trainer's own model, or a correction on). It compares the sampler's log-probs of the sampled tokens with the
trainer's under the rollout policy: from the old-log-prob pass where one runs for another reason, else from the
update's own (its first optimizer step's forwards and the pass over the other rows: no extra pass; under torchrun
each rank computes its own rows and the update sums them over the ranks into the whole batch's).
"""

from __future__ import annotations

from rldynamics.algo.rollout_corr import batch_mismatch, measures_mismatch
from rldynamics.config import Config
from rldynamics.train.diagnostics.base import END, Diagnostic, DiagnosticResult, Needs, StepRecord
from rldynamics.train.session import Session


class Mismatch(Diagnostic):
    """`rollout/corr/*` of the filtered batch: how far off-policy the update trains."""

    name, point = "mismatch", END

    @staticmethod
    def enabled(cfg: Config) -> bool:
        return measures_mismatch(cfg)

    def needs(self, step: int) -> Needs:
        return Needs(update_logprobs=True)

    def run(self, s: Session, record: StepRecord) -> DiagnosticResult:
        if record.filtered is None:
            return DiagnosticResult({})
        return DiagnosticResult(batch_mismatch(self.cfg, record.filtered.batch, record.rollout_policy_logprobs()))
