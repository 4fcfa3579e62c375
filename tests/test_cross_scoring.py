"""Cross-scoring for the collapse diagnostics: pairs from rollouts, and the shared-prefix scores equal to
independent full-sequence forwards."""

from __future__ import annotations

import torch

from conftest import micro_model_batch
from rldynamics.analysis.cross_scoring import (
    cross_loglik,
    first_turn_pairs,
    pair_rows,
    prompt_classes,
    trajectory_pairs,
    turn_spans,
)
from rldynamics.models.forward import token_logprobs


def test_turn_spans_and_prompt_classes():
    assert turn_spans(torch.tensor([0, 0, 1, 1, 0, 1, 0, 1, 1])) == [(2, 4), (5, 6), (7, 9)]
    assert turn_spans(torch.zeros(4)) == []
    assert prompt_classes([torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([1, 2]), torch.tensor([1])]).tolist() \
        == [0, 1, 0, 2]


def test_pair_rows_put_each_reply_after_each_prompt():
    ids, attn, pos = pair_rows([torch.tensor([5, 6, 7]), torch.tensor([8])], [torch.tensor([1, 2]),
                                                                            torch.tensor([3])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 1, 2], [5, 6, 7, 3, 0], [8, 1, 2, 0, 0], [8, 3, 0, 0, 0]]
    assert attn.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert pos.tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 1, 0], [0, 1, 1, 0, 0], [0, 1, 0, 0, 0]]


def _independent(model, x: torch.Tensor, z: torch.Tensor, temperature: float) -> float:
    """log p(z | x) from one plain forward of the whole sequence [x | z] (no cache, no positions)."""
    ids = torch.cat([x, z])[None]  # [1, T]
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, ids, torch.ones_like(ids), temperature=temperature)  # [1, T]
    return float(logprobs[0, len(x):].double().sum())


def test_cross_scores_equal_independent_full_sequence_forwards(tiny_cache):
    model, tokenizer, batch = micro_model_batch(tiny_cache, group_size=3)
    generator = torch.Generator().manual_seed(0)
    first, valid = first_turn_pairs(batch.input_ids, batch.response_mask, batch.group_ids, 0, generator)
    trajectory = trajectory_pairs(batch.input_ids, batch.response_mask, 7, generator)
    assert valid == 6 and len(first.prompts) == 2 and first.column.tolist() == [0, 0, 0, 1, 1, 1]
    assert len(trajectory.replies) == 7 and any(len(p) > len(first.prompts[0]) for p in trajectory.prompts)
    for pairs in (first, trajectory):
        for micro in (2, 64):
            loglik = cross_loglik(model, pairs, pad_id=tokenizer.pad_token_id, micro_batch_size=micro,
                                  temperature=0.7)  # [N, C]
            expected = torch.tensor([[_independent(model, x, z, 0.7) for x in pairs.prompts]
                                     for z in pairs.replies], dtype=torch.float64)  # [N, C]
            torch.testing.assert_close(loglik, expected, rtol=1e-5, atol=1e-4)
        naive = cross_loglik(model, pairs, pad_id=tokenizer.pad_token_id, micro_batch_size=4, temperature=0.7,
                             shared_prefix=False)
        torch.testing.assert_close(naive, expected, rtol=1e-5, atol=1e-4)
