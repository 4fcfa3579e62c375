"""The collapse estimators (analysis/collapse.py): scripted policies with known mutual information, prompt
equivalence classes, top-k chance, the EMA recursion and the bootstrap intervals."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from rldynamics.analysis.collapse import (
    bootstrap_intervals,
    chance_level,
    collapse_metrics,
    ema,
    matched_and_marginal,
    retrieval_hits,
)
from rldynamics.analysis.cross_scoring import cross_loglik, first_turn_pairs, reply_lengths

VOCAB, REPLY = 40, 6


class ScriptedPolicy(torch.nn.Module):
    """A causal LM whose next-token logits depend only on the prompt's first token p (its identity):
    `determined` puts logit 30 on token 10 + p (the reply is a function of the input), otherwise every token
    gets the same logit at every position (the reply ignores the input; uniform over the vocabulary)."""

    def __init__(self, determined: bool):
        super().__init__()
        self.determined = determined
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, input_ids, attention_mask=None, **kwargs):
        logits = torch.zeros(*input_ids.shape, VOCAB)  # [N, T, V]
        if self.determined:
            logits.scatter_(2, (10 + input_ids[:, :1, None]).expand(-1, input_ids.shape[1], 1), 30.0)
        return SimpleNamespace(logits=logits * self.scale)

    def sample(self, prompt: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if self.determined:
            return torch.full((REPLY,), 10 + int(prompt[0]))
        return torch.randint(0, VOCAB, (REPLY,), generator=generator)


def _rollout(policy: ScriptedPolicy, prompt_ids: list[int], per_prompt: int):
    """Rows [prompt | reply] (prompts [p, 1, 2, 3]) sampled from `policy`, as a rollout's tensors."""
    generator = torch.Generator().manual_seed(0)
    rows, masks, groups = [], [], []
    for g, p in enumerate(prompt_ids):
        prompt = torch.tensor([p, 1, 2, 3])
        for _ in range(per_prompt):
            rows.append(torch.cat([prompt, policy.sample(prompt, generator)]))
            masks.append(torch.tensor([0.0] * 4 + [1.0] * REPLY))
            groups.append(g)
    return torch.stack(rows), torch.stack(masks), torch.tensor(groups)


def _metrics(policy: ScriptedPolicy, prompt_ids: list[int], per_prompt: int = 8) -> dict[str, float]:
    ids, mask, groups = _rollout(policy, prompt_ids, per_prompt)
    pairs, _ = first_turn_pairs(ids, mask, groups, 0, torch.Generator().manual_seed(0))
    loglik = cross_loglik(policy, pairs, pad_id=0, micro_batch_size=16)  # [N, C]
    return collapse_metrics(loglik, reply_lengths(pairs), pairs.column, pairs.classes)


def test_input_ignoring_policy_is_at_chance_with_zero_mi_and_high_entropy():
    m = _metrics(ScriptedPolicy(determined=False), [0, 1, 2, 3, 4, 5, 6, 7])
    assert m["mi_estimate"] == pytest.approx(0.0, abs=1e-9) and m["mi_seq_estimate"] == pytest.approx(0.0, abs=1e-9)
    assert m["mi_mixture_estimate"] == pytest.approx(0.0, abs=1e-9)
    assert m["retrieval_accuracy"] == pytest.approx(m["retrieval_chance_level"]) == pytest.approx(1 / 8)
    assert m["retrieval_above_chance"] == pytest.approx(0.0)
    assert m["conditional_entropy_est"] == pytest.approx(math.log(VOCAB), rel=1e-6)  # the most a token can have
    assert m["reasoning_entropy_est"] == pytest.approx(math.log(VOCAB), rel=1e-6)
    assert m["mi_upper_bound"] == pytest.approx(math.log(8))


def test_input_determined_policy_retrieves_its_prompt_with_mi_log_of_distinct_prompts():
    m = _metrics(ScriptedPolicy(determined=True), [0, 1, 2, 3, 4, 5, 6, 7])
    assert m["retrieval_accuracy"] == 1.0 and m["retrieval_above_chance"] == pytest.approx(7 / 8)
    assert m["mi_seq_estimate"] == pytest.approx(math.log(8), abs=1e-6)
    assert m["mi_mixture_estimate"] == pytest.approx(math.log(8) / REPLY, abs=1e-6)
    assert m["mi_estimate"] == pytest.approx(math.log(8), abs=1e-6)  # RAGEN's per-token logsumexp
    assert m["conditional_entropy_est"] == pytest.approx(0.0, abs=1e-6)
    assert m["mi_seq_estimate"] == pytest.approx(m["reasoning_entropy_seq_est"] - m["conditional_entropy_seq_est"])


def test_identical_prompts_form_one_class():
    # groups 0 and 1 show the same prompt: one class of 2 columns out of 4
    m = _metrics(ScriptedPolicy(determined=True), [5, 5, 6, 7])
    assert m["retrieval_accuracy"] == 1.0
    assert m["retrieval_chance_level"] == pytest.approx((2 / 4 * 2 + 1 / 4 * 2) / 4)
    # the batch's prompt distribution is (1/2, 1/4, 1/4): the MI is its entropy
    assert m["mi_seq_estimate"] == pytest.approx(-(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)), abs=1e-6)
    scores = torch.tensor([[0.0, 0.0, -9.0, -9.0]] * 2)  # rows of column 1 tie with column 0, which wins the argmax
    column = torch.tensor([1, 1])
    assert retrieval_hits(scores, column, torch.tensor([0, 0, 1, 2])).tolist() == [True, True]
    assert retrieval_hits(scores, column, torch.tensor([0, 1, 2, 3])).tolist() == [False, False]


def test_top_k_chance_is_that_of_k_columns_drawn_without_replacement():
    classes = torch.tensor([0, 0, 1, 2, 3])
    column = torch.tensor([0, 1, 2, 3, 4, 4])
    for k in (1, 2, 3, 5, 8):
        kk = min(k, 5)
        expected = sum(sum(any(classes[j] == classes[c] for j in pick) for pick in itertools.combinations(range(5), kk))
                       / math.comb(5, kk) for c in column.tolist()) / len(column)
        assert chance_level(column, classes, k) == pytest.approx(expected)
    assert chance_level(torch.arange(8), torch.arange(8), 2) == pytest.approx(2 / 8)  # RAGEN's k / C, distinct prompts


def test_matched_and_marginal_and_top_k_hits():
    scores = torch.tensor([[-1.0, -2.0, -3.0], [-5.0, -1.0, -0.5]])
    matched, marginal = matched_and_marginal(scores, torch.tensor([0, 1]))
    assert matched.tolist() == [-1.0, -1.0]
    assert marginal.tolist() == pytest.approx([math.log((math.exp(-1) + math.exp(-2) + math.exp(-3)) / 3),
                                               math.log((math.exp(-5) + math.exp(-1) + math.exp(-0.5)) / 3)])
    classes = torch.arange(3)
    assert retrieval_hits(scores, torch.tensor([0, 1]), classes, 1).tolist() == [True, False]
    assert retrieval_hits(scores, torch.tensor([0, 1]), classes, 2).tolist() == [True, True]


def test_ema_recursion_over_diagnosed_steps():
    assert ema(None, 2.0, 0.9) == 2.0
    assert ema(2.0, 4.0, 0.9) == pytest.approx(2.2)
    state: dict[str, float] = {}
    stds = []
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        loglik = torch.randn(6, 3, generator=generator, dtype=torch.float64) * 3  # [N, C]
        m = collapse_metrics(loglik, torch.full((6,), 2.0), torch.tensor([0, 0, 1, 1, 2, 2]), torch.arange(3),
                             ema_std=state, ema_decay=0.9, std_eps=1e-3)
        stds.append(m["marginal_std"])
    expected = stds[0]
    for s in stds[1:]:
        expected = 0.9 * expected + 0.1 * s
    assert m["marginal_std_ema"] == pytest.approx(expected) and state["marginal_std"] == pytest.approx(expected)
    matched, marginal = matched_and_marginal(loglik / 2.0, torch.tensor([0, 0, 1, 1, 2, 2]))
    assert m["mi_zscore_ema"] == pytest.approx(float(((matched - marginal) / (expected + 1e-3)).mean()))
    assert m["mi_zscore"] == pytest.approx(float(((matched - marginal) / (stds[-1] + 1e-3)).mean()))


def test_bootstrap_intervals_bracket_the_estimates_and_need_two_prompts():
    generator = torch.Generator().manual_seed(3)
    loglik = torch.randn(12, 4, generator=generator, dtype=torch.float64) * 2  # [N, C]
    column, lengths = torch.arange(4).repeat_interleave(3), torch.full((12,), 3.0)
    point = collapse_metrics(loglik, lengths, column, torch.arange(4))
    ci = bootstrap_intervals(loglik, lengths, column, torch.arange(4), resamples=200, seed=0)
    for name in ("mi_estimate", "mi_seq_estimate", "mi_mixture_estimate", "retrieval_accuracy"):
        assert ci[f"{name}/ci_low"] < point[name] < ci[f"{name}/ci_high"], name
    assert ci == bootstrap_intervals(loglik, lengths, column, torch.arange(4), resamples=200, seed=0)  # seeded
    one = bootstrap_intervals(loglik[:3], lengths[:3], torch.zeros(3, dtype=torch.long), torch.arange(4),
                              resamples=50, seed=0)
    assert all(math.isnan(v) for v in one.values())
