"""Reward-component gradients: each against an independent backward, self/identical cosines, Dr.GRPO linearity,
zero-gradient flags, layer groups."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rldynamics.algo.advantages import grpo_advantages
from rldynamics.algo.losses import policy_loss
from rldynamics.analysis.gram import gram, local_slices
from rldynamics.analysis.objective import ActorInputs, policy_loss_settings
from rldynamics.analysis.probe import ProbeSettings, gradient_probe
from rldynamics.analysis.reward_grad import layer_groups, reward_grad_metrics
from rldynamics.config import AlgoConfig
from rldynamics.models.forward import batch_logprobs, token_logprobs
from rldynamics.models.tiny import build_tiny_model, build_tiny_tokenizer
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.train.batch_ops import component_advantages

LENGTH = 16
GROUPS = 4
SIZE = 3
NAMES = ("correctness", "format", "length")
WEIGHTS = {"correctness": 0.34, "format": 0.33, "length": 0.33}


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    tokenizer = build_tiny_tokenizer(["\\boxed{12} first second step1 <answer>3</answer>"] * 5)
    return build_tiny_model(tokenizer, hidden_size=32, num_layers=2, intermediate_size=64)


def make_batch(model, components: torch.Tensor, seed: int = 0) -> RolloutBatch:
    """A random batch of GROUPS x SIZE rows with the given [N, K] reward components."""
    gen = torch.Generator().manual_seed(seed)
    n = GROUPS * SIZE
    input_ids = torch.randint(3, model.config.vocab_size, (n, LENGTH), generator=gen)  # [N, L]
    positions = torch.arange(LENGTH)[None, :]  # [1, L]
    starts = torch.randint(3, 8, (n, 1), generator=gen)  # [N, 1]
    response_mask = ((positions >= starts) & (positions < starts + 6)).float()  # [N, L]
    weights = torch.tensor([WEIGHTS[k] for k in NAMES])  # [K]
    return RolloutBatch(input_ids=input_ids, attention_mask=torch.ones(n, LENGTH, dtype=torch.long),
                        response_mask=response_mask, scores=components @ weights,
                        group_ids=torch.arange(GROUPS).repeat_interleave(SIZE), reward_components=components,
                        reward_names=NAMES, reward_weights=tuple(WEIGHTS[k] for k in NAMES))


def random_components(seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    correct = (torch.rand(GROUPS * SIZE, generator=gen) > 0.5).float()  # [N]
    fmt = torch.randint(0, 5, (GROUPS * SIZE,), generator=gen).float() / 4  # [N]
    length = torch.rand(GROUPS * SIZE, generator=gen)  # [N]
    return torch.stack([correct, fmt, length], dim=1)  # [N, K]


def run_probe(model, batch, algo, **kw):
    old, _ = batch_logprobs(model, batch.input_ids, batch.attention_mask, micro_batch_size=len(batch))  # [N, L]
    advantages = grpo_advantages(batch.scores, batch.group_ids, batch.response_mask,
                                 norm_by_std=algo.norm_adv_by_std)  # [N, L]
    inputs = ActorInputs(old_logprobs=old, advantages=advantages)
    stds = {g: float(batch.scores[batch.group_ids == g].std()) for g in range(GROUPS)}
    comps = component_advantages(batch, algo)
    settings = ProbeSettings(algo=algo, micro_batch_size=5, temperature=1.0, keep_gradients=True, **kw)
    return gradient_probe(model, batch, inputs, stds, settings, component_advantages=comps, component_weights=WEIGHTS)


def algo_cfg(norm_by_std: bool, mode: str = "token-mean") -> AlgoConfig:
    return AlgoConfig(adv_estimator="grpo", norm_adv_by_std=norm_by_std, loss_agg_mode=mode, entropy_coef=0.0)


def test_each_component_gradient_equals_an_independent_backward(model):
    batch = make_batch(model, random_components())
    algo = algo_cfg(norm_by_std=True, mode="seq-mean-token-mean")
    result = run_probe(model, batch, algo, num_buckets=1)
    old, _ = batch_logprobs(model, batch.input_ids, batch.attention_mask, micro_batch_size=len(batch))
    for k, name in enumerate(NAMES):
        fresh = copy.deepcopy(model)
        adv = grpo_advantages(batch.reward_components[:, k], batch.group_ids, batch.response_mask)  # [N, L]
        logprobs, _ = token_logprobs(fresh, batch.input_ids, batch.attention_mask)  # [N, L]
        loss, _ = policy_loss(logprobs, old, adv, batch.response_mask, policy_loss_settings(algo))
        loss.backward()
        expected = torch.cat([p.grad.reshape(-1) for p in fresh.parameters() if p.requires_grad])  # [P]
        got = result.gradients[f"all/reward/{name}"]  # [P]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))
        assert result.metrics[f"reward_grad/all/norm/{name}"] == pytest.approx(float(expected.norm()), rel=1e-5)


def test_self_cosine_is_one_and_identical_components_give_one(model):
    components = random_components()
    components[:, 1] = components[:, 0]  # format == correctness on every row
    batch = make_batch(model, components)
    result = run_probe(model, batch, algo_cfg(norm_by_std=True), num_buckets=2)
    matrices = result.reward_grad["all"]
    for i in range(len(NAMES)):
        assert matrices["cos"][i][i] == pytest.approx(1.0, abs=1e-6)
    for bucket in ("all", "bucket_1", "bucket_2"):
        assert result.metrics[f"reward_grad/{bucket}/cos/correctness__format"] == pytest.approx(1.0, abs=1e-5)


def test_dr_grpo_total_is_the_weighted_sum_of_component_gradients(model):
    batch = make_batch(model, random_components(seed=3))
    result = run_probe(model, batch, algo_cfg(norm_by_std=False), num_buckets=2)
    for bucket in ("all", "bucket_1", "bucket_2"):
        total = result.gradients[f"{bucket}/task"]  # [P]
        combined = sum(WEIGHTS[k] * result.gradients[f"{bucket}/reward/{k}"] for k in NAMES)  # [P]
        torch.testing.assert_close(combined, total, rtol=1e-5, atol=1e-6 * float(total.abs().max()))


def test_zero_advantage_component_is_flagged_not_zero(model):
    components = random_components()
    components[:, 2] = torch.arange(GROUPS).repeat_interleave(SIZE).float()  # constant within every group
    batch = make_batch(model, components)
    m = run_probe(model, batch, algo_cfg(norm_by_std=True), num_buckets=1).metrics
    assert m["reward_grad/all/norm/length"] == 0.0 and m["reward_grad/all/zero_grad/length"] == 1.0
    assert m["reward_grad/all/zero_grad/correctness"] == 0.0
    assert math.isnan(m["reward_grad/all/cos/correctness__length"])
    assert math.isnan(m["reward_grad/all/cos_total/length"])
    assert math.isnan(m["reward_grad/all/neg_layer_frac/format__length"])
    assert not math.isnan(m["reward_grad/all/cos/correctness__format"])


def test_layer_groups_and_conflict_fraction():
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up.weight",
             "model.layers.1.input_layernorm.weight", "model.norm.weight", "lm_head.weight"]
    groups = layer_groups(names, [4, 2, 2, 2, 1, 3])
    assert groups == {"embedding": [(0, 4)], "layer_0": [(4, 6), (6, 8)], "layer_1": [(8, 10)],
                      "final_norm": [(10, 11)], "head": [(11, 14)]}
    a = torch.tensor([1.0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 1, 1, 0, 0])  # [P]
    b = torch.tensor([1.0, 0, 0, 0, -1, 0, 0, 0, 1, 0, -1, 1, 0, 0])  # [P]: opposes a in layer_0, final_norm
    grams = gram([a, b, a + b], local_slices([(0, 14)], groups))  # [G, 3, 3]
    metrics, matrices = reward_grad_metrics(grams, ["a", "b"], True, {"a": 1.0, "b": 1.0}, list(groups))
    assert metrics["neg_layer_frac/a__b"] == pytest.approx(2 / 5)
    assert matrices["layer_cos"]["a__b"] == [1.0, -1.0, 1.0, -1.0, 1.0]
    assert metrics["cos/a__b"] == pytest.approx(1 / 5)  # (1 - 1 + 1 - 1 + 1) / (sqrt 5 * sqrt 5)


def test_gram_over_several_blocks_and_split_groups_equals_float64_products(monkeypatch):
    """Groups whose spans cross the float64 blocks (and a last, shorter block): each [K, K] is the float64 product of
    the group's coordinates, the vectors given in float32 and bfloat16."""
    from rldynamics.analysis import gram as gram_module

    monkeypatch.setattr(gram_module, "CHUNK", 7)
    gen = torch.Generator().manual_seed(0)
    vectors = [torch.randn(40, generator=gen), torch.randn(40, generator=gen).bfloat16(), torch.randn(40, generator=gen)]
    groups = {"a": [(0, 5), (18, 33)], "b": [(5, 18)], "c": [(33, 40)]}
    grams = gram(vectors, local_slices([(0, 40)], groups))  # [3, 3, 3]
    for g, parts in enumerate(groups.values()):
        rows = torch.stack([torch.cat([v[lo:hi] for lo, hi in parts]).double() for v in vectors])  # [3, n]
        torch.testing.assert_close(grams[g], rows @ rows.T, rtol=1e-13, atol=0)
    assert grams.dtype == torch.float64


@pytest.mark.slow
def test_training_run_logs_component_gradients(fast_overrides):
    import json

    from rldynamics.config import make_config
    from rldynamics.tracking.run_dir import read_metrics
    from rldynamics.train.trainer import train

    run = train(make_config(overrides=[*fast_overrides, "log.name=rg", "analysis.enabled=true", "analysis.every=1",
                                       "analysis.reward_grad=true", "analysis.num_buckets=2", "train.group_size=3"]))
    row = read_metrics(run)[1]
    names = ("step", "box", "solved", "format_penalty")
    assert all(f"reward_grad/all/norm/{k}" in row for k in names)
    assert row["reward_grad/all/zero_grad/step"] == 1.0  # step_penalty is 0 in the tiny preset: constant
    matrices = json.loads((run / "analysis" / "step_1" / "reward_grad.json").read_text())
    assert matrices["grad_norm"]["all"]["components"] == list(names)
    assert len(matrices["grad_norm"]["all"]["cos"]) == 4 and matrices["grad_norm"]["all"]["cos"][0][0] is None

    from rldynamics.plots.cli import plot_command, report_command

    assert plot_command(run) == 0 and report_command(run) == 0
    for name in ("reward_components.png", "response_lengths.png", "reward_grad_cosines.png",
                 "reward_grad_matrix_step_1.png", "reward_grad_layers_step_1.png"):
        assert (run / "plots" / name).stat().st_size > 5000, name
    page = (run / "report.html").read_text()
    assert 'id="reward-components"' in page and "constant within every group" in page  # step is always 0
    assert plot_command(run, [2], out=run / "step2") == 0  # one step asked: no figure of another step
    assert (run / "step2" / "reward_grad_matrix_step_2.png").is_file()
    assert not list((run / "step2").glob("*step_1*"))


def test_components_alone_skip_the_actor_terms(model):
    batch = make_batch(model, random_components())
    full = run_probe(model, batch, algo_cfg(norm_by_std=True), num_buckets=2)
    alone = run_probe(model, batch, algo_cfg(norm_by_std=True), num_buckets=2, terms=())
    assert not any(k.startswith("grad_norm/all/task") or "cos_total" in k for k in alone.metrics)
    for key in ("reward_grad/all/norm/format", "reward_grad/bucket_1/cos/correctness__length"):
        assert alone.metrics[key] == pytest.approx(full.metrics[key], rel=1e-6)
    assert alone.reward_grad["all"]["cos_total"] is None


def test_conflict_flags_from_cosines_with_the_total(tmp_path):
    from rldynamics.plots.data import RunData
    from rldynamics.plots.reward_components import check_reward_components

    key = "reward_grad/all/cos_total/"
    rows = [{"step": s, f"{key}length": c, f"{key}format": f, f"{key}correctness": 0.9}
            for s, c, f in [(1, 0.5, -0.2), (26, 0.4, -0.3), (51, -0.4, 0.1)]]
    flags = {f.check: f for f in check_reward_components(RunData(tmp_path, rows))}
    assert flags["reward_component_conflict"].title.startswith("The format gradient opposes")  # median < 0
    latest = flags["reward_component_conflict_latest"]
    assert "length" in latest.title and "step 51" in latest.detail
    assert len(flags) == 2  # correctness never opposes the total
