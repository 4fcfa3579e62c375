"""Tests for rldynamics.analysis.probe (gradient probe) and rldynamics.analysis.sketch (count-sketch).

The probe's gradients are checked against independent computations: one forward over the whole batch
with ``torch.autograd.grad`` (derived ``all``), and ``loss.backward()`` on a fresh model copy (buckets).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from rldynamics.algo.losses import AGG_MODES
from rldynamics.algo.shares import sub_batch_share
from rldynamics.analysis.engines import chunk_bounds
from rldynamics.analysis.objective import ActorInputs, actor_terms, policy_loss_settings
from rldynamics.analysis.probe import ProbeResult, ProbeSettings, gradient_probe
from rldynamics.analysis.probe_metrics import numerically_zero
from rldynamics.analysis.sketch import GradientSketcher
from rldynamics.config import AlgoConfig
from rldynamics.models.forward import batch_logprobs
from rldynamics.models.tiny import build_tiny_model, build_tiny_tokenizer
from rldynamics.rollout.batch import RolloutBatch

GRID = "######\n#_OX√#\n#_P__#\n#S___#\n######"
GROUP_SIZES = (2, 3, 2, 3, 2)  # 5 groups, 12 rows
LENGTH = 20
SIGNS = {"task": ("pg", 1.0), "entropy": ("entropy", -1.0), "kl": ("kl", 1.0)}


def sokoban_corpus() -> list[str]:
    """Sokoban-like texts for the tiny tokenizer."""
    return [f"Turn {t}:\n{GRID}\nPlayer: ({t}, {t + 2})\n<think>push</think><answer>Up || Left</answer>"
            for t in range(1, 6)]


@pytest.fixture(scope="module", autouse=True)
def single_thread(one_thread):
    """Tiny tensors gain nothing from threads (`conftest.one_thread`)."""


@pytest.fixture(scope="module")
def model():
    tokenizer = build_tiny_tokenizer(sokoban_corpus())
    return build_tiny_model(tokenizer, hidden_size=32, num_layers=1, intermediate_size=64)


def make_batch(model, group_sizes=GROUP_SIZES, seed: int = 0) -> tuple[RolloutBatch, ActorInputs, dict[int, float]]:
    """Random rollout: right-padded rows, short response spans, old/ref log-probs near the model's own."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(group_sizes)
    vocab = model.config.vocab_size
    input_ids = torch.randint(3, vocab, (n, LENGTH), generator=gen)  # [N, L]
    lengths = torch.randint(LENGTH - 8, LENGTH + 1, (n,), generator=gen)  # [N]
    positions = torch.arange(LENGTH)[None, :]  # [1, L]
    attention_mask = (positions < lengths[:, None]).long()  # [N, L]
    starts = torch.randint(2, 6, (n,), generator=gen)  # [N]
    span_a = (positions >= starts[:, None]) & (positions < starts[:, None] + 3)  # [N, L]
    ends = starts[:, None] + 6 + torch.randint(1, 5, (n, 1), generator=gen)  # [N, 1]
    span_b = (positions >= starts[:, None] + 6) & (positions < ends)  # [N, L]
    response_mask = ((span_a | span_b) & attention_mask.bool()).float()  # [N, L]
    response_mask[n // 3] = 0.0  # a row without sampled tokens carries no aggregation weight
    group_ids = torch.repeat_interleave(torch.arange(len(group_sizes)) * 10 + 7, torch.tensor(group_sizes))  # [N]
    scores = torch.randn(n, generator=gen)  # [N]
    batch = RolloutBatch(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                         scores=scores, group_ids=group_ids)
    own, _ = batch_logprobs(model, input_ids, attention_mask, micro_batch_size=n)  # [N, L]
    inputs = ActorInputs(
        old_logprobs=own + 0.05 * torch.randn(n, LENGTH, generator=gen),
        advantages=torch.randn(n, LENGTH, generator=gen),
        ref_logprobs=own + 0.2 * torch.randn(n, LENGTH, generator=gen),
    )
    group_std = {g: float(scores[group_ids == g].std()) for g in group_ids.unique().tolist()}
    return batch, inputs, group_std


@pytest.fixture(scope="module")
def data(model):
    return make_batch(model)


def algo_cfg(mode: str = "token-mean") -> AlgoConfig:
    return AlgoConfig(loss_agg_mode=mode, entropy_coef=0.01, kl_coef=0.05, kl_type="low_var_kl")


def probe(model, data, **kw) -> ProbeResult:
    batch, inputs, stds = data
    kw.setdefault("algo", algo_cfg())
    kw.setdefault("micro_batch_size", 3)
    components = {k: kw.pop(k) for k in ("component_advantages", "component_weights") if k in kw}
    return gradient_probe(model, batch, inputs, stds, ProbeSettings(temperature=1.0, **kw), **components)


def bucket_rows(result: ProbeResult, batch: RolloutBatch, bucket: str) -> torch.Tensor:
    gids = torch.tensor([g for b, g, _ in result.groups if b == bucket])  # [G_b]
    return torch.isin(batch.group_ids, gids).nonzero().squeeze(1)  # [n_b]


def params_of(model) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


# ---- exactness ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", AGG_MODES)
def test_derived_all_equals_direct_gradient(model, data, mode):
    batch, inputs, _ = data
    algo = algo_cfg(mode)
    result = probe(model, data, algo=algo, keep_gradients=True, micro_batch_size=2, num_buckets=3)
    terms, _ = actor_terms(model, batch, torch.arange(len(batch)), inputs, policy_loss_settings(algo), temperature=1.0)
    for comp, (term, sign) in SIGNS.items():
        parts = torch.autograd.grad(terms[term], params_of(model), retain_graph=True, allow_unused=True)
        direct = sign * torch.cat([p.reshape(-1) for p in parts])  # [P]
        derived = result.gradients[f"all/{comp}"]  # [P]
        torch.testing.assert_close(derived, direct, rtol=1e-5, atol=1e-5 * float(direct.abs().max()))
        assert result.metrics[f"grad_norm/all/raw/{comp}" if comp != "task" else "grad_norm/all/task"] == (
            pytest.approx(float(direct.norm()), rel=1e-5))
    assert result.metrics["grad_norm/all/loss/policy"] == pytest.approx(terms["pg"].item(), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_bucket_gradient_matches_backward_on_fresh_copy(model, data, mode):
    batch, inputs, _ = data
    algo = algo_cfg(mode)
    result = probe(model, data, algo=algo, keep_gradients=True, micro_batch_size=1, num_buckets=2)
    for bucket in ("bucket_1", "bucket_2"):
        rows = bucket_rows(result, batch, bucket)
        for comp, (term, sign) in SIGNS.items():
            fresh = copy.deepcopy(model)
            terms, _ = actor_terms(fresh, batch, rows, inputs, policy_loss_settings(algo), temperature=1.0)
            (sign * terms[term]).backward()
            expected = torch.cat([p.grad.reshape(-1) for p in params_of(fresh)])  # [P]
            got = result.gradients[f"{bucket}/{comp}"]  # [P]
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_norms_independent_of_micro_batch_size(model, data):
    results = [probe(model, data, micro_batch_size=m, sketch_dim=0).metrics for m in (1, 2, len(data[0]))]
    for other in results[1:]:
        assert other.keys() == results[0].keys()
        for key, value in results[0].items():
            assert other[key] == pytest.approx(value, rel=1e-4, abs=1e-8), key


# ---- read-only ----------------------------------------------------------------------------------------------


def test_probe_is_read_only(model, data):
    noisy = copy.deepcopy(model).train()  # dropout on: the forward passes draw from the global RNG
    for module in noisy.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.3
    before = [p.detach().clone() for p in noisy.parameters()]
    state = torch.get_rng_state()
    probe(noisy, data)
    assert all(p.grad is None for p in noisy.parameters()), "the probe must not populate .grad"
    assert all(torch.equal(a, p) for a, p in zip(before, noisy.parameters(), strict=True)), "parameters changed"
    assert torch.equal(torch.get_rng_state(), state), "the probe must restore the global RNG state"
    assert noisy.training, "the probe must leave the model's mode alone"
    batch = data[0]
    noisy(input_ids=batch.input_ids[:2], attention_mask=batch.attention_mask[:2])
    assert not torch.equal(torch.get_rng_state(), state), "sanity: dropout does consume the global RNG"


# ---- edge cases ---------------------------------------------------------------------------------------------


def test_single_group_buckets(model, data):
    result = probe(model, data, num_buckets=6)  # 5 groups -> 5 buckets of one group each
    names = sorted({b for b, _, _ in result.groups})
    assert names == [f"bucket_{k}" for k in range(1, 6)]
    stds = [s for _, _, s in result.groups]
    assert stds == sorted(stds), "bucket_1 holds the lowest-variance group"
    for b in names:
        assert result.metrics[f"grad_norm/{b}/group_rv_count"] == 1.0
        assert result.metrics[f"grad_norm/{b}/reward_std_min"] == result.metrics[f"grad_norm/{b}/reward_std_max"]
        assert result.metrics[f"grad_norm/{b}/task"] > 0
    assert sum(result.metrics[f"grad_norm/{b}/sample_count"] for b in names) == len(data[0])


def test_fixed_rv_buckets_keep_interval_names(model, data):
    batch, inputs, _ = data
    stds = dict(zip((7, 17, 27, 37, 47), (2.5, 2.7, 5.5, 3.1, 2.2), strict=True))  # [0,1) and [1,2) stay empty
    fixed = gradient_probe(model, batch, inputs, stds, ProbeSettings(algo=algo_cfg(), micro_batch_size=3,
                                                                     temperature=1.0, bucket_mode="fixed_rv",
                                                                     sketch_dim=0))
    names = {k.split("/")[1] for k in fixed.metrics if k.startswith("grad_norm/bucket_")}
    assert names == {"bucket_3", "bucket_4", "bucket_6"}
    assert {b: sorted(s for bb, _, s in fixed.groups if bb == b) for b in names} == {
        "bucket_3": [2.2, 2.5, 2.7], "bucket_4": [3.1], "bucket_6": [5.5]}
    # the derived `all` does not depend on how the batch was partitioned
    quantile = gradient_probe(model, batch, inputs, stds, ProbeSettings(algo=algo_cfg(), micro_batch_size=3,
                                                                        temperature=1.0, num_buckets=2, sketch_dim=0))
    for key, value in quantile.metrics.items():
        if key.startswith("grad_norm/all/") or key.startswith("actor/"):
            assert fixed.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-8), key


def test_one_bucket_equals_all(model, data):
    m = probe(model, data, num_buckets=1).metrics
    for key in ("task", "entropy", "kl", "loss/total", "cos/task_entropy", "regularizer"):
        assert m[f"grad_norm/bucket_1/{key}"] == pytest.approx(m[f"grad_norm/all/{key}"], rel=1e-5)


def test_empty_batch(model, data):
    batch, inputs, stds = data
    none = torch.zeros(0, dtype=torch.long)
    empty = batch.select(none)
    empty_inputs = ActorInputs(inputs.old_logprobs[none], inputs.advantages[none], inputs.ref_logprobs[none])
    result = gradient_probe(model, empty, empty_inputs, stds, ProbeSettings(algo=algo_cfg(), micro_batch_size=2,
                                                                            temperature=1.0))
    assert result.metrics == {} and result.groups == [] and result.sketches == {}


def test_without_reference_no_kl_keys(model, data):
    batch, inputs, stds = data
    no_ref = dataclasses.replace(inputs, ref_logprobs=None)
    result = gradient_probe(model, batch, no_ref, stds, ProbeSettings(algo=algo_cfg(), micro_batch_size=4,
                                                                      temperature=1.0))
    assert not [k for k in result.metrics if "kl" in k.split("/")[-1]]
    assert "grad_norm/all/entropy" in result.metrics and "grad_norm/all/cos/task_entropy" in result.metrics
    assert not [k for k in result.sketches if k.endswith("/kl")]


def test_missing_group_std_is_named(model, data):
    batch, inputs, stds = data
    partial = dict(list(stds.items())[1:])
    with pytest.raises(ValueError, match="group ids"):
        gradient_probe(model, batch, inputs, partial, ProbeSettings(algo=algo_cfg(), micro_batch_size=4,
                                                                    temperature=1.0))


# ---- metric names and definitions ---------------------------------------------------------------------------


def test_metric_keys_and_definitions(model, data):
    algo = algo_cfg()
    result = probe(model, data, algo=algo, num_buckets=2)
    m = result.metrics
    batch = data[0]
    suffixes = ["task", "entropy", "kl", "raw/entropy", "raw/kl", "sample_count", "sample_pct", "reward_std_mean",
                "reward_std_min", "reward_std_max", "group_rv_count", "cos/task_entropy", "cos/task_kl",
                "cos/entropy_kl", "regularizer", "reg_share"]
    suffixes += [f"{kind}/{c}" for kind in ("per_sample", "per_token") for c in ("task", "entropy", "kl")]
    suffixes += [f"loss/{name}" for name in ("policy", "entropy", "kl", "total")]
    for b in ("all", "bucket_1", "bucket_2"):
        rows = torch.arange(len(batch)) if b == "all" else bucket_rows(result, batch, b)
        count, tokens = float(rows.numel()), float(batch.response_mask[rows].sum())
        for s in suffixes:
            assert f"grad_norm/{b}/{s}" in m, s
        key = f"grad_norm/{b}"
        assert m[f"{key}/sample_count"] == count
        assert m[f"{key}/sample_pct"] == pytest.approx(count / len(batch))
        for c in ("task", "entropy", "kl"):
            assert m[f"{key}/per_sample/{c}"] == pytest.approx(m[f"{key}/{c}"] / count)
            assert m[f"{key}/per_token/{c}"] == pytest.approx(m[f"{key}/{c}"] / tokens)
        assert m[f"{key}/entropy"] == pytest.approx(algo.entropy_coef * m[f"{key}/raw/entropy"])
        assert m[f"{key}/kl"] == pytest.approx(algo.kl_coef * m[f"{key}/raw/kl"])
        losses = [m[f"{key}/loss/{n}"] for n in ("policy", "entropy", "kl")]
        assert m[f"{key}/loss/total"] == pytest.approx(sum(losses))
        assert m[f"{key}/loss/entropy"] < 0, "the entropy loss term is -coef * H"
        assert 0.0 <= m[f"{key}/reg_share"] <= 1.0
        assert -1.0 <= m[f"{key}/cos/task_entropy"] <= 1.0
    for c in ("task", "entropy", "kl"):
        assert m[f"actor/grad_norm/{c}"] == m[f"grad_norm/all/{c}"]
    for n in ("policy", "entropy", "kl", "total"):
        assert m[f"actor/loss/{n}"] == m[f"grad_norm/all/loss/{n}"]
    assert {k for k in result.sketches} == {f"{b}/{c}" for b in ("all", "bucket_1", "bucket_2")
                                           for c in ("task", "entropy", "kl")}
    assert all(s.shape == (1024,) and s.dtype == torch.float32 for s in result.sketches.values())


def test_regularizer_and_cosines_from_vectors(model, data):
    algo = algo_cfg()
    result = probe(model, data, algo=algo, keep_gradients=True, num_buckets=2)
    g = {c: result.gradients[f"all/{c}"] for c in ("task", "entropy", "kl")}  # [P] each
    reg = algo.entropy_coef * g["entropy"] + algo.kl_coef * g["kl"]  # [P]
    m = result.metrics
    assert m["grad_norm/all/regularizer"] == pytest.approx(float(reg.norm()), rel=1e-5)
    cos = torch.nn.functional.cosine_similarity(g["task"], g["entropy"], dim=0)
    assert m["grad_norm/all/cos/task_entropy"] == pytest.approx(float(cos), abs=1e-5)
    assert m["grad_norm/all/reg_share"] == pytest.approx(float(reg.norm()) / (float(g["task"].norm())
                                                                               + float(reg.norm())), rel=1e-5)


def test_zero_gradients_give_undefined_cosines_not_zero(model, data):
    batch, inputs, stds = data
    # k3 KL at pi = pi_ref: reference log-probs computed exactly as the probe's forward (one row at a time) make
    # d = 0 everywhere, where the k3 gradient 1 - e^d is exactly 0
    own, _ = batch_logprobs(model, batch.input_ids, batch.attention_mask, micro_batch_size=1)  # [N, L]
    at_ref = dataclasses.replace(inputs, ref_logprobs=own)
    m = gradient_probe(model, batch, at_ref, stds, ProbeSettings(algo=algo_cfg(), micro_batch_size=1, temperature=1.0,
                                                                 num_buckets=2, sketch_dim=0)).metrics
    for b in ("all", "bucket_1", "bucket_2"):
        key = f"grad_norm/{b}"
        assert m[f"{key}/raw/kl"] == 0.0 and m[f"{key}/zero_grad/kl"] == 1.0
        assert m[f"{key}/zero_grad/task"] == 0.0 and m[f"{key}/zero_grad/entropy"] == 0.0
        assert math.isnan(m[f"{key}/cos/task_kl"]) and math.isnan(m[f"{key}/cos/entropy_kl"])
        assert -1.0 <= m[f"{key}/cos/task_entropy"] <= 1.0
        assert 0.0 < m[f"{key}/reg_share"] < 1.0  # the entropy term is still there
    # zero advantages (zero-variance groups under GRPO): no task gradient; the regulariser is the whole update
    flat = dataclasses.replace(inputs, advantages=torch.zeros_like(inputs.advantages))
    m = probe(model, (batch, flat, stds), sketch_dim=0).metrics
    assert m["grad_norm/all/task"] == 0.0 and m["grad_norm/all/zero_grad/task"] == 1.0
    assert math.isnan(m["grad_norm/all/cos/task_entropy"]) and math.isnan(m["grad_norm/all/cos/task_kl"])
    assert m["grad_norm/all/reg_share"] == 1.0
    # no task gradient and no regulariser (coefficients 0, KL at the reference): the share is 0/0
    none = dataclasses.replace(flat, ref_logprobs=own)
    quiet = dataclasses.replace(algo_cfg(), entropy_coef=0.0)
    m = gradient_probe(model, batch, none, stds, ProbeSettings(algo=quiet, micro_batch_size=1, temperature=1.0,
                                                               sketch_dim=0)).metrics
    assert m["grad_norm/all/regularizer"] == 0.0 and math.isnan(m["grad_norm/all/reg_share"])


def test_kl_gradient_at_rounding_level_counts_as_zero(model, data):
    # the reference pass and the probe's forward round differently, so at pi = pi_ref the k3 gradient comes out
    # ~1e-7 of the others instead of 0: flagged as zero with undefined cosines; a real difference is not
    batch, inputs, stds = data
    own, _ = batch_logprobs(model, batch.input_ids, batch.attention_mask, micro_batch_size=1)  # [N, L]
    noise = 1e-6 * torch.randn(own.shape, generator=torch.Generator().manual_seed(0))  # [N, L]
    for shift, zero in ((noise, True), (1e-2 + noise, False)):
        at = dataclasses.replace(inputs, ref_logprobs=own + shift)
        m = gradient_probe(model, batch, at, stds, ProbeSettings(algo=algo_cfg(), micro_batch_size=1, temperature=1.0,
                                                                 num_buckets=2, sketch_dim=0)).metrics
        for b in ("all", "bucket_1", "bucket_2"):
            key = f"grad_norm/{b}"
            assert m[f"{key}/zero_grad/kl"] == float(zero)
            assert math.isnan(m[f"{key}/cos/task_kl"]) == zero and math.isnan(m[f"{key}/cos/entropy_kl"]) == zero
            if zero:
                largest = max(m[f"{key}/task"], m[f"{key}/raw/entropy"])  # raw norms (the task weight is 1)
                assert 0.0 < m[f"{key}/raw/kl"] < 1e-5 * largest  # tiny but not exactly 0
    assert numerically_zero(0.0, [0.0, 0.0]) and numerically_zero(1e-9, [1.0, 1e-9])
    assert not numerically_zero(1e-4, [1.0, 1e-4])


def test_other_prefix_is_not_mirrored(model, data):
    m = probe(model, data, prefix="grad_norm_prefilter", sketch_dim=0).metrics
    assert "grad_norm_prefilter/all/task" in m
    assert not [k for k in m if k.startswith("actor/") or k.startswith("grad_norm/")]


# ---- sketches -----------------------------------------------------------------------------------------------


SHAPES = [(40, 30), (30,), (500, 20)]  # P = 11230


def test_sketch_is_linear_and_deterministic():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(11230, generator=gen), torch.randn(11230, generator=gen)  # [P]
    sk = GradientSketcher(SHAPES, dim=256, seed=3)
    torch.testing.assert_close(sk.sketch(a + b), sk.sketch(a) + sk.sketch(b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sk.sketch(2.5 * a), 2.5 * sk.sketch(a), rtol=1e-5, atol=1e-5)
    again = GradientSketcher(SHAPES, dim=256, seed=3)
    assert torch.equal(again.sketch(a), sk.sketch(a)), "same seed must give the same projection"
    assert not torch.equal(GradientSketcher(SHAPES, dim=256, seed=4).sketch(a), sk.sketch(a))
    assert sk.index.dtype == torch.int32 and sk.sign.dtype == torch.int8
    assert set(sk.sign.tolist()) == {-1, 1}
    assert int(sk.index.min()) >= 0 and int(sk.index.max()) < 256
    with pytest.raises(ValueError, match="flat vector"):
        sk.sketch(torch.zeros(7))


@pytest.mark.parametrize("true_cos", [-0.6, 0.0, 0.5, 0.9])
def test_sketch_cosine_tracks_true_cosine(true_cos):
    gen = torch.Generator().manual_seed(2)
    u, v = torch.randn(11230, generator=gen), torch.randn(11230, generator=gen)  # [P]
    v = v - (v @ u) / (u @ u) * u  # [P] orthogonal to u
    a = u / u.norm()  # [P]
    b = true_cos * a + (1 - true_cos**2) ** 0.5 * v / v.norm()  # [P] unit, cos(a, b) = true_cos
    sk = GradientSketcher(SHAPES, dim=8192, seed=0)
    est = torch.nn.functional.cosine_similarity(sk.sketch(a), sk.sketch(b), dim=0)
    assert float(est) == pytest.approx(true_cos, abs=0.08)
    assert float(torch.nn.functional.cosine_similarity(sk.sketch(a), sk.sketch(a), dim=0)) == pytest.approx(1.0)


def test_probe_sketches_are_sketches_of_the_gradients(model, data):
    result = probe(model, data, keep_gradients=True, sketch_dim=64, sketch_seed=5, num_buckets=2)
    sk = GradientSketcher([p.shape for p in params_of(model)], dim=64, seed=5)
    for key, grad in result.gradients.items():
        torch.testing.assert_close(result.sketches[key], sk.sketch(grad))


# ---- several ranks (gloo, 2 processes) ------------------------------------------------------------------------

# case -> (loss_agg_mode, probe arguments); run by tests/dist_probe_worker.py on 2 ranks, replicas and FSDP2 shards
DIST_CASES = {
    "token-mean": ("token-mean", dict(micro_batch_size=2, num_buckets=3, sketch_dim=32)),
    "seq-mean-token-sum-norm/components": ("seq-mean-token-sum-norm", dict(micro_batch_size=5, num_buckets=2,
                                                                           sketch_dim=16)),
    "seq-mean-token-mean/per_group": ("seq-mean-token-mean", dict(micro_batch_size=2, num_buckets=2, sketch_dim=0,
                                                                  per_group=True, resamples=50)),
}


def components_of(batch: RolloutBatch) -> dict[str, torch.Tensor]:
    """Two made-up reward components' advantages for the batch of `make_batch`. name -> [N, L]"""
    gen = torch.Generator().manual_seed(11)
    return {k: torch.randn(batch.response_mask.shape, generator=gen) * batch.response_mask for k in ("a", "b")}


@pytest.mark.slow
def test_probe_over_two_ranks_equals_one_process(model, data, tmp_path):
    """Each rank probes a contiguous block of rows and holds half of each gradient (replicas: a slice of the flat
    vector; FSDP2: each parameter's row shard); the all-reduced norms, cosines, losses, sketches, reward-component
    matrices, per-group norms and bootstrap intervals are those of one process."""
    from conftest import run_ranks

    run_ranks([str(Path(__file__).with_name("dist_probe_worker.py")), str(tmp_path)], timeout=240)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    batch = data[0]
    for case, (mode, kwargs) in DIST_CASES.items():
        single = probe(model, data, algo=algo_cfg(mode), component_advantages=components_of(batch)
                       if "components" in case else None, **kwargs)
        for out in ranks:
            for shard in (False, True):
                got = out[f"{case}/shard={shard}"]
                assert got["metrics"].keys() == single.metrics.keys()
                for key, value in single.metrics.items():
                    assert got["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-7, nan_ok=True), (case, key)
                for key, sketch in single.sketches.items():
                    torch.testing.assert_close(torch.tensor(got["sketches"][key]), sketch, rtol=1e-4, atol=1e-6)
                for gid, norms in single.group_norms.items():
                    assert got["group_norms"][str(gid)] == pytest.approx(norms, rel=1e-4, abs=1e-7, nan_ok=True)


# ---- per-group gradients and bootstrap intervals --------------------------------------------------------------


@pytest.mark.parametrize("mode", AGG_MODES)
def test_per_group_gradients_rebuild_the_bucket_gradient(model, data, mode):
    batch, inputs, _ = data
    algo = algo_cfg(mode)
    plain = probe(model, data, algo=algo, keep_gradients=True, num_buckets=2, sketch_dim=0)
    grouped = probe(model, data, algo=algo, keep_gradients=True, num_buckets=2, sketch_dim=0, per_group=True,
                    resamples=50)
    for key, value in plain.gradients.items():  # g_b = Σ_j s_j g_j, whatever the aggregation mode
        # float32 rounding: the entropy gradient of this random-init model's near-uniform distributions, -p (log p +
        # H), cancels terms near log V; each way of computing it lies up to about 1e-5 of its largest entry from a
        # float64 probe (measured 8.5e-6), a missing or misweighted group far more
        torch.testing.assert_close(grouped.gradients[key], value, rtol=1e-5, atol=1e-5 * float(value.abs().max()))
    assert set(grouped.group_norms) == set(batch.group_ids.tolist())
    for bucket in ("bucket_1", "bucket_2"):
        gids = [g for b, g, _ in grouped.groups if b == bucket]
        shares = [grouped.group_norms[g]["share"] for g in gids]
        for comp, (term, sign) in SIGNS.items():
            key = "task" if comp == "task" else f"raw/{comp}"
            # each group's norm is that of its own rows differentiated alone, on a fresh copy
            rows = torch.isin(batch.group_ids, torch.tensor(gids[:1])).nonzero().squeeze(1)
            fresh = copy.deepcopy(model)
            terms, _ = actor_terms(fresh, batch, rows, inputs, policy_loss_settings(algo), temperature=1.0)
            (sign * terms[term]).backward()
            alone = float(torch.cat([p.grad.reshape(-1) for p in params_of(fresh)]).norm())
            assert grouped.group_norms[gids[0]][key] == pytest.approx(alone, rel=1e-4)
            # triangle inequality: the bucket norm is at most the share-weighted sum of the group norms
            bucket_norm = grouped.metrics[f"grad_norm/{bucket}/{key}"]
            assert bucket_norm <= sum(s * grouped.group_norms[g][key] for s, g in zip(shares, gids, strict=True)) + 1e-6
        if mode != "seq-mean-token-sum-norm":
            assert sum(shares) == pytest.approx(1.0, rel=1e-6)  # normalising modes: the shares are a mean's weights


def test_per_group_intervals_contain_the_bucket_values(model, data):
    result = probe(model, data, num_buckets=2, sketch_dim=0, per_group=True, resamples=200)
    m = result.metrics
    for bucket in ("bucket_1", "bucket_2"):
        for key in ("task", "entropy", "kl", "raw/entropy", "raw/kl", "regularizer", "reg_share"):
            low, high = m[f"grad_norm/{bucket}/{key}/ci_low"], m[f"grad_norm/{bucket}/{key}/ci_high"]
            assert 0.0 <= low <= m[f"grad_norm/{bucket}/{key}"] <= high, (bucket, key)
            assert high > low  # two or three distinct groups: a real spread
        assert m[f"grad_norm/{bucket}/reg_share/ci_high"] <= 1.0
    assert not any(k.startswith("grad_norm/all/") and k.endswith("/ci_low") for k in m)  # `all` gets none
    again = probe(model, data, num_buckets=2, sketch_dim=0, per_group=True, resamples=200).metrics
    assert again == pytest.approx(m, nan_ok=True)  # seeded resampling: the same intervals every time


def test_single_group_bucket_has_no_interval(model, data):
    m = probe(model, data, num_buckets=6, sketch_dim=0, per_group=True, resamples=50).metrics
    assert math.isnan(m["grad_norm/bucket_1/task/ci_low"]) and math.isnan(m["grad_norm/bucket_1/task/ci_high"])


def test_zero_bucket_in_the_probe(model, data):
    batch, inputs, stds = data
    stds = {**stds, 7: 0.0, 27: 0.0}
    result = gradient_probe(model, batch, inputs, stds, ProbeSettings(algo=algo_cfg(), micro_batch_size=3,
                                                                      temperature=1.0, num_buckets=2, sketch_dim=0,
                                                                      zero_bucket=True))
    assert sorted(g for b, g, _ in result.groups if b == "bucket_0") == [7, 27]
    assert {b for b, _, _ in result.groups} == {"bucket_0", "bucket_1", "bucket_2"}
    assert result.metrics["grad_norm/bucket_0/reward_std_max"] == 0.0


# ---- bounded memory: the probe streamed by parameter chunks (analysis.memory_chunks) ------------------------------

BENCH = Path(__file__).resolve().parents[1] / "bench"
CHUNKED_REL = 1e-9  # chunks add the same float64 inner products in another order: 1e-14 relative measured


@pytest.fixture
def probe_bench(monkeypatch):
    """`bench/probe_memory.py`: the tensor-memory counter and the flattening of every reported number."""
    import importlib

    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("probe_memory")


def test_chunk_bounds_split_whole_parameters_evenly():
    assert chunk_bounds([10, 10, 10, 10], 1) == [(0, 4)]
    assert chunk_bounds([10, 10, 10, 10], 2) == [(0, 2), (2, 4)]
    assert chunk_bounds([10, 10, 10, 10], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert chunk_bounds([10, 10, 10, 10], 9) == [(0, 1), (1, 2), (2, 3), (3, 4)]  # at most one chunk per parameter
    assert chunk_bounds([60, 5, 5, 30], 2) == [(0, 1), (1, 4)]  # a parameter above P / chunks is a chunk alone
    assert chunk_bounds([1, 1, 98], 3) == [(0, 2), (2, 3)]


@pytest.mark.parametrize("chunks", [2, 5, 100])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_chunked_probe_equals_the_whole_probe(model, data, probe_bench, chunks, mode):
    """Every reported number (metrics, sketches, reward-component matrices, per-group norms and intervals) and every
    gradient of the chunked probe is the whole probe's, within CHUNKED_REL."""
    kwargs = dict(algo=algo_cfg(mode), num_buckets=2, micro_batch_size=2, sketch_dim=64, keep_gradients=True,
                  component_advantages=components_of(data[0]), per_group=True, resamples=50)
    whole = probe(model, data, **kwargs)
    chunked = probe(model, data, memory_chunks=chunks, **kwargs)
    error, where = probe_bench.worst_error(probe_bench.flat_results(whole), probe_bench.flat_results(chunked))
    assert error <= CHUNKED_REL, where
    assert chunked.gradients.keys() == whole.gradients.keys() and chunked.group_norms.keys() == whole.group_norms.keys()
    for key, grad in whole.gradients.items():
        torch.testing.assert_close(chunked.gradients[key], grad, rtol=1e-6, atol=1e-9 * float(grad.abs().max()))


def test_chunked_probe_equals_the_whole_probe_in_bfloat16_with_checkpointing(model, data, probe_bench):
    from rldynamics.models.precision import compute_in, enable_checkpointing

    mixed = enable_checkpointing(compute_in(copy.deepcopy(model), "bfloat16"))  # as train.setup.prepare sets it up
    kwargs = dict(num_buckets=2, sketch_dim=64, component_advantages=components_of(data[0]), per_group=True,
                  resamples=50)
    whole = probe(mixed, data, **kwargs)
    chunked = probe(mixed, data, memory_chunks=3, **kwargs)
    error, where = probe_bench.worst_error(probe_bench.flat_results(whole), probe_bench.flat_results(chunked))
    assert error <= CHUNKED_REL, where


def test_chunked_bucket_gradients_sum_to_all(model, data):
    batch = data[0]
    result = probe(model, data, num_buckets=3, keep_gradients=True, sketch_dim=0, memory_chunks=3)
    buckets = sorted({b for b, _, _ in result.groups})
    shares = {b: sub_batch_share(batch.response_mask, bucket_rows(result, batch, b), "token-mean") for b in buckets}
    for comp in ("task", "entropy", "kl"):
        total = sum(shares[b] * result.gradients[f"{b}/{comp}"] for b in buckets)  # [P]
        whole = result.gradients[f"all/{comp}"]  # [P]
        torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-6 * float(whole.abs().max()))


def test_chunked_probe_is_read_only_and_every_chunk_draws_the_same_dropout(model, data):
    noisy = copy.deepcopy(model).train()  # dropout on: every chunk's forward passes must draw the same masks
    for module in noisy.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.3
    grads = [torch.full_like(p, 0.5) for p in noisy.parameters()]
    for p, g in zip(noisy.parameters(), grads, strict=True):
        p.grad = g
    before = [p.detach().clone() for p in noisy.parameters()]
    state = torch.get_rng_state()
    chunked = probe(noisy, data, memory_chunks=4, sketch_dim=0)
    assert all(p.grad is g and bool((g == 0.5).all()) for p, g in zip(noisy.parameters(), grads, strict=True))
    assert all(torch.equal(a, p) for a, p in zip(before, noisy.parameters(), strict=True)), "parameters changed"
    assert torch.equal(torch.get_rng_state(), state), "the probe must restore the global RNG state"
    whole = probe(noisy, data, sketch_dim=0)  # from the same RNG state: the same dropout masks
    for key, value in whole.metrics.items():
        assert chunked.metrics[key] == pytest.approx(value, rel=CHUNKED_REL, abs=1e-12, nan_ok=True), key


def test_chunked_norms_independent_of_micro_batch_size(model, data):
    results = [probe(model, data, micro_batch_size=m, sketch_dim=0, memory_chunks=3).metrics for m in (1, 4)]
    for key, value in results[0].items():
        assert results[1][key] == pytest.approx(value, rel=1e-4, abs=1e-8), key


def test_chunked_probe_holds_less_tensor_memory(probe_bench):
    """On a model whose gradients outweigh the activations (1.1M parameters, 12 short rows), the tensor bytes the
    probe holds at its peak fall with chunks: the whole probe holds at least the 2 x 3 gradient vectors."""
    tokenizer = build_tiny_tokenizer(sokoban_corpus())
    big = build_tiny_model(tokenizer, hidden_size=128, num_layers=4, intermediate_size=512)
    data = make_batch(big)
    size = 4 * sum(p.numel() for p in big.parameters())  # bytes of one float32 gradient vector
    whole, _ = probe_bench.peak_bytes(lambda: probe(big, data))
    chunked, _ = probe_bench.peak_bytes(lambda: probe(big, data, memory_chunks=4))
    assert whole >= 6 * size  # task, entropy, KL for `all` and for a bucket
    assert chunked < 0.5 * whole


def test_memory_chunks_is_one_process_only(model, data):
    from rldynamics.config import ConfigError, make_config
    from rldynamics.train.setup import check_world

    cfg = make_config(overrides=["analysis.memory_chunks=4"])
    check_world(cfg, 1)
    with pytest.raises(ConfigError, match=r"analysis.memory_chunks=4 .* set analysis.memory_chunks=1"):
        check_world(cfg, 2)
    with pytest.raises(ConfigError, match="analysis.memory_chunks must be"):
        make_config(overrides=["analysis.memory_chunks=0"])
    with pytest.raises(ValueError, match="memory_chunks=0"):
        probe(model, data, memory_chunks=0)
