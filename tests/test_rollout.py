"""The agent loop on the real tiny model and on scripted policies, including arbitrary garbage output."""

from __future__ import annotations

import copy
import math
import random
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rldynamics.config import make_config
from rldynamics.models.loading import load_model_and_tokenizer
from rldynamics.models.tiny import ensure_tiny_model
from rldynamics.rollout.agent import env_metric_summary, rollout
from rldynamics.rollout.sampling import (
    CdfSampling,
    NonFiniteLogits,
    SamplingGuard,
    keyed_gumbel,
    row_key,
    sampling_guard,
)
from rldynamics.train.sft_data import solver_policy
from rldynamics.train.warmstart import tiny_corpus


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = make_config(overrides=["env.max_new_tokens=8"])
    path = ensure_tiny_model(lambda: tiny_corpus(cfg.env, num_seeds=20), tmp_path_factory.mktemp("cache"),
                             hidden_size=32, num_layers=1, intermediate_size=64)
    model, tokenizer = load_model_and_tokenizer(str(path))
    return model, tokenizer, cfg


def test_model_rollout_shapes_masks_and_rewards(tiny):
    model, tokenizer, cfg = tiny
    torch.manual_seed(0)
    batch = rollout(model, tokenizer, [10, 11], 3, cfg.env, temperature=1.0)
    assert len(batch) == 6 and batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert batch.seeds == [10, 10, 10, 11, 11, 11]
    # sampled tokens are a strict subset of the real (non-pad) tokens
    assert (batch.response_mask <= batch.attention_mask).all()
    assert batch.response_mask.sum(1).min() > 0
    # the trajectory reward sits on the last sampled token only
    rewards = batch.token_rewards
    assert torch.allclose(rewards.sum(1), batch.scores)
    last = (batch.response_mask * torch.arange(batch.response_mask.shape[1])).argmax(1)
    assert torch.allclose(rewards[torch.arange(6), last], batch.scores)
    # a random model emits garbage: format penalties, no actions
    assert batch.scores.max() <= 0
    summary = env_metric_summary(batch, "train/sokoban", 3)
    assert {"train/sokoban/success", "train/sokoban/pass@3", "train/sokoban/action_is_valid"} <= set(summary)


def test_same_sampling_seed_same_rollout(tiny):
    model, tokenizer, cfg = tiny
    torch.manual_seed(3)
    a = rollout(model, tokenizer, [5], 2, cfg.env, temperature=1.0)
    torch.manual_seed(3)
    b = rollout(model, tokenizer, [5], 2, cfg.env, temperature=1.0)
    assert torch.equal(a.input_ids, b.input_ids) and a.texts == b.texts


def test_solver_demonstrations_solve_and_are_rewarded(tiny):
    _, tokenizer, cfg = tiny
    batch = rollout(None, tokenizer, list(range(20, 28)), 1, cfg.env,
                    respond=solver_policy(tokenizer, cfg.env, noise=0.0, rng=random.Random(0)))
    success = torch.tensor([m["success"] for m in batch.env_metrics])
    solved = success > 0
    assert solved.float().mean() > 0.5  # the optimal plan fits the 10-action budget for most puzzles
    assert (batch.scores[solved] > 9).all()  # +10 for solving dominates the step penalties
    # the sampled tokens decode to exactly the scripted answers
    first = tokenizer.decode(batch.input_ids[0][batch.response_mask[0] > 0], skip_special_tokens=True)
    assert first.startswith("<answer>") and "</answer>" in first


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.text(max_size=40), min_size=1, max_size=3))
def test_garbage_output_gets_format_penalty_never_a_crash(tiny, texts):
    _, tokenizer, cfg = tiny
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def respond(trajs):
        return [tokenizer(texts[i % len(texts)], add_special_tokens=False)["input_ids"] + [eos]
                for i, _ in enumerate(trajs)]

    batch = rollout(None, tokenizer, [1], 2, cfg.env, respond=respond)
    assert len(batch) == 2
    valid = [m["action_is_valid"] for m in batch.env_metrics]
    for score, v in zip(batch.scores.tolist(), valid, strict=True):
        if v == 0:  # no turn had a valid action: one format penalty per turn, nothing else
            assert score == pytest.approx(cfg.env.format_penalty * cfg.env.max_turns)


def test_sampling_guard_samples_exactly_like_hf_temperature(tiny):
    """The guard applies the temperature itself; sampled tokens are those of HF's own temperature warper."""
    model, tokenizer, _ = tiny
    prompt = torch.tensor([tokenizer("<|im_start|>user\nTurn 1:<|im_end|>\n", add_special_tokens=False)["input_ids"]])
    outs = []
    for kwargs in ({"temperature": 0.7}, {"temperature": 1.0, "logits_processor": sampling_guard(0.7)}):
        torch.manual_seed(3)
        outs.append(model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True, top_k=0,
                                   top_p=1.0, max_new_tokens=12, pad_token_id=tokenizer.pad_token_id, **kwargs))
    assert torch.equal(outs[0], outs[1])


def test_cdf_sampling_draws_each_token_with_its_probability():
    """400,000 rows of one distribution with a masked token and a tail of 7e-15: every row keeps one finite score
    (0, at its token); token frequencies match softmax within 4 standard errors; the masked token is never drawn;
    a seed gives the same tokens again."""
    scores = torch.tensor([0.0, 1.0, 2.0, -float("inf"), -30.0, 0.5]).repeat(400_000, 1)  # [B, V]
    torch.manual_seed(0)
    out = CdfSampling()(None, scores)  # [B, V]
    assert ((out == 0).sum(1) == 1).all() and (torch.isinf(out).sum(1) == 5).all()
    picked = out.argmax(1)  # [B]
    counts = torch.bincount(picked, minlength=6).double()  # [V]
    p = torch.softmax(scores[0].double(), -1)  # [V]
    se = (p * (1 - p) / len(scores)).sqrt()  # [V]
    assert ((counts / len(scores) - p).abs() <= 4 * se + 1e-12).all() and counts[3] == 0
    torch.manual_seed(0)
    assert torch.equal(CdfSampling()(None, scores).argmax(1), picked)


def test_cdf_sampling_takes_the_only_finite_token_and_the_last_one_at_the_top_of_the_range(monkeypatch):
    inf = float("inf")
    scores = torch.tensor([[-inf, -inf, 3.0, -inf], [0.0, 0.0, -inf, -inf]])  # [B, V]
    assert CdfSampling()(None, scores).argmax(1).tolist()[0] == 2
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(*a[0], dtype=k.get("dtype")))  # u at the total
    assert CdfSampling()(None, scores).argmax(1).tolist() == [2, 1]  # never the zero-weight ids after the last


@pytest.mark.parametrize("row", [[0.0, float("nan"), 1.0], [0.0, float("inf"), 1.0], [-float("inf")] * 3])
def test_sampling_guard_names_non_finite_scores(row):
    scores = torch.tensor([[0.0, -float("inf"), 1.0], row])  # [B, V]: the first row is fine (-inf = masked)
    with pytest.raises(NonFiniteLogits, match="1 of 2 sequences"):
        SamplingGuard(1.0)(torch.zeros(2, 1, dtype=torch.long), scores)
    assert torch.equal(SamplingGuard(2.0)(None, scores[:1]), scores[:1] / 2)


def test_exploded_policy_raises_non_finite_logits_not_a_sampling_crash(tiny):
    model, tokenizer, cfg = tiny
    broken = copy.deepcopy(model)
    with torch.no_grad():
        next(broken.parameters()).fill_(float("nan"))
    with pytest.raises(NonFiniteLogits):
        rollout(broken, tokenizer, [10], 2, cfg.env, temperature=1.0)
    with pytest.raises(NonFiniteLogits):  # finite weights, but logits / temperature overflow
        rollout(model, tokenizer, [10], 2, cfg.env, temperature=1e-308)


def test_answer_only_costs_the_format_penalty_for_text_after_the_answer_and_grades_the_answer_alike(tiny):
    _, tokenizer, _ = tiny
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def respond(trajs):  # the sum of the puzzle's two numbers; the second reply writes on past its answer
        replies = []
        for i, traj in enumerate(trajs):
            a, b = re.search(r"nums: \[(\d+), (\d+)\]", traj.observation).groups()
            text = f"<answer>{a} + {b}</answer>" + ("" if i % 2 == 0 else f"{a} + {b}</answer>")
            replies.append(tokenizer(text, add_special_tokens=False)["input_ids"] + [eos])
        return replies

    def components(answer_only: bool) -> list[dict[str, float]]:
        cfg = make_config("countdown-tiny", overrides=[f"env.answer_only={str(answer_only).lower()}"])
        batch = rollout(None, tokenizer, [3], 2, cfg.env, respond=respond)
        return [dict(zip(batch.reward_names, row.tolist(), strict=True)) for row in batch.reward_components]

    loose, strict = components(False), components(True)
    assert [c["format_penalty"] for c in loose] == [0.0, 0.0]  # RAGEN's tolerance
    assert [c["format_penalty"] for c in strict] == [0.0, pytest.approx(-0.1)]  # text after </answer>
    assert [c["format"] for c in strict] == [1.0, 1.0]  # the answer itself still counts, graded the same
    for a, b in zip(loose, strict, strict=True):
        assert (a["format"], a["correct"]) == (b["format"], b["correct"])


def _lowbias32(x: int) -> int:
    """Wellons' lowbias32 on a Python int, written out independently of `rollout.sampling`."""
    x ^= x >> 16
    x = (x * 0x21F0AAAD) % 2**32
    x ^= x >> 15
    x = (x * 0x735A2D97) % 2**32
    return x ^ (x >> 15)


def test_keyed_gumbel_noise_is_the_hash_of_key_index_and_id():
    keys = [row_key(7, row, 3) for row in range(3)]
    key_tensor = torch.tensor(keys)  # [3]
    noise = keyed_gumbel(key_tensor, 2, 50)  # [3, 50]
    for row, key in enumerate(keys):
        step = _lowbias32(key ^ _lowbias32(2))
        for token in (0, 1, 17, 49):
            bits = _lowbias32(_lowbias32(step ^ token) ^ step)
            expected = -math.log(-math.log((bits + 0.5) / 2**32))
            assert noise[row, token].item() == pytest.approx(expected, rel=1e-6)
    assert key_tensor.tolist() == keys  # the in-place hashing leaves the caller's keys as they were
