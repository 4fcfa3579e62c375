"""The typed trace of every optimizer step (`train.update.StepTrace`), per-parameter-group norms, and the guard that
can refuse a step: group squares add up to the global norm, a refused step leaves parameters and optimizer state
bit-identical, the traced update is the applied one, tracing is read-only, and two ranks trace like one process."""

from __future__ import annotations

import copy
import dataclasses
import doctest
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

from rldynamics import metric_names as names
from rldynamics.analysis.objective import ActorInputs
from rldynamics.config import make_config
from rldynamics.models.loading import ValueModel
from rldynamics.models.tiny import build_tiny_model, build_tiny_tokenizer
from rldynamics.train import update
from rldynamics.train.actor import ActorUpdate, update_actor
from rldynamics.train.update import StepTrace, parameter_group
from test_probe import make_batch, single_thread, sokoban_corpus  # noqa: F401  (single_thread: an autouse fixture)

BASE = ["train.mini_batch_size=4", "train.micro_batch_size=3", "train.ppo_epochs=2", "train.shared_prefix=false",
        "algo.entropy_coef=0.01"]
TRACED_GROUPS = {"embed", "layer.0", "norm"}  # the tiny model's head is tied to its embedding


def tiny_model() -> torch.nn.Module:
    """The probe tests' tiny model: 1 layer, 32 wide, the LM head tied to the embedding."""
    return build_tiny_model(build_tiny_tokenizer(sokoban_corpus()), hidden_size=32, num_layers=1, intermediate_size=64)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def data(model):
    return make_batch(model)


def run(model, data, overrides=(), *, sgd_lr: float | None = None, ref: bool = True, optimizer=None,
        **kw) -> tuple[torch.nn.Module, ActorUpdate, torch.optim.Optimizer]:
    """One actor update on the probe's batch: of a copy of `model` (AdamW lr 1e-2, or plain SGD with `sgd_lr`), or,
    given an `optimizer`, of `model` itself."""
    batch, inputs, _ = data
    cfg = make_config(overrides=[*BASE, *overrides])
    if not ref:
        inputs = ActorInputs(old_logprobs=inputs.old_logprobs, advantages=inputs.advantages)
    if optimizer is None:
        model = copy.deepcopy(model)
        optimizer = (torch.optim.SGD(model.parameters(), lr=sgd_lr) if sgd_lr is not None else
                     torch.optim.AdamW(model.parameters(), lr=1e-2))
    result = update_actor(model, optimizer, batch, inputs, cfg.algo, cfg.train, **kw)
    return model, result, optimizer


WORKER_OVERRIDES = ["train.max_grad_norm=0.5"]


def second_refused():
    """A guard refusing its 2nd call only."""
    calls = []
    return lambda trace: calls.append(trace) or len(calls) == 2


def same_tensors(a, b) -> bool:
    """Bit-identical nested structures of tensors (and plain values)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_tensors(x, y) for x, y in zip(a, b, strict=True))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def same_weights(m1, m2) -> bool:
    return all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters(), strict=True))


# ---- parameter groups -------------------------------------------------------------------------------------------


def test_parameter_groups_of_the_tiny_model_llama_and_a_critic(model):
    tiny = {n: parameter_group(n) for n, _ in model.named_parameters()}
    assert tiny["model.embed_tokens.weight"] == "embed" and tiny["model.norm.weight"] == "norm"
    assert all(g == "layer.0" for n, g in tiny.items() if n.startswith("model.layers.0."))
    assert set(tiny.values()) == TRACED_GROUPS
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=12,
                      num_attention_heads=2, num_key_value_heads=1)
    llama = {n: parameter_group(n) for n, _ in LlamaForCausalLM(cfg).named_parameters()}
    assert llama["model.embed_tokens.weight"] == "embed" and llama["lm_head.weight"] == "lm_head"
    assert llama["model.layers.11.self_attn.q_proj.weight"] == "layer.11"
    assert llama["model.layers.1.post_attention_layernorm.weight"] == "layer.1"
    assert list(dict.fromkeys(llama.values())) == ["embed", *[f"layer.{i}" for i in range(12)], "norm", "lm_head"]
    critic = {n: parameter_group(n) for n, _ in ValueModel(LlamaModel(cfg), 16).named_parameters()}
    assert critic["head.weight"] == critic["head.bias"] == "value_head" and critic["backbone.norm.weight"] == "norm"
    assert parameter_group("transformer.h.3.attn.c_attn.weight") == "layer.3"  # GPT-2
    assert parameter_group("gpt_neox.embed_out.weight") == "lm_head" and parameter_group("rotary.freq") == "other"
    assert doctest.testmod(update).failed == 0


# ---- group norms ------------------------------------------------------------------------------------------------


def test_group_squares_sum_to_the_global_norm(model, data):
    _, result, _ = run(model, data, trace_groups=True)
    assert len(result.steps) == result.metrics["actor/num_updates"] == 6  # 2 epochs x 3 mini-batches of 12 rows
    weights = {g: 0.0 for g in TRACED_GROUPS}
    for n, p in model.named_parameters():
        weights[parameter_group(n)] += float(p.detach().double().square().sum())
    assert result.steps[0].group_weight_sq == pytest.approx(weights, rel=1e-6)  # weights before the first step
    for step in result.steps:
        assert step.group_grad_sq.keys() == step.group_update_sq.keys() == step.group_weight_sq.keys() == TRACED_GROUPS
        assert sum(step.group_grad_sq.values()) == pytest.approx(step.grad_norm ** 2, rel=1e-6)
        assert not step.skipped and step.clipped == (step.grad_norm > 1.0)


def test_plain_sgd_update_is_lr_times_the_clipped_gradient(model, data):
    """The change read back from the weights is lr x the clipped gradient, up to the float32 rounding of the new
    weights (at most 2^-24 of their norm)."""
    for max_norm in (0.05, 1e3):  # every step clipped (norms 1.4 to 2.1); none
        _, result, _ = run(model, data, [f"train.max_grad_norm={max_norm}"], sgd_lr=0.1, trace_groups=True)
        assert all(s.clipped == (max_norm < 1) for s in result.steps)
        assert result.metrics[names.CLIP_HIT_RATE] == float(max_norm < 1)
        for step in result.steps:
            scale = min(1.0, max_norm / step.grad_norm)
            for group, grad_sq in step.group_grad_sq.items():
                rounding = 1e-7 * math.sqrt(step.group_weight_sq[group])
                assert math.sqrt(step.group_update_sq[group]) == pytest.approx(0.1 * math.sqrt(grad_sq) * scale,
                                                                               rel=1e-5, abs=rounding)


def test_the_traced_change_is_the_norm_of_after_minus_before_bit_for_bit(model, data):
    """Each group's traced change equals the float32 norm of (weights after - weights before) computed apart from
    the trainer, bit for bit: AdamW, one step per mini-batch, the weights read before and after each step."""
    from rldynamics.train import update as update_module

    snapshots = []
    real_step = update_module._traced_step

    def spy(optimizer, params, groups):
        before = [p.detach().clone() for p in params]
        out = real_step(optimizer, params, groups)
        snapshots.append((before, [p.detach().clone() for p in params], out))
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(update_module, "_traced_step", spy)
        _, result, _ = run(model, data, trace_groups=True)
    names_ = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(snapshots) == len(result.steps) == 6
    for (before, after, traced), step in zip(snapshots, result.steps, strict=True):
        expected = dict.fromkeys(TRACED_GROUPS, 0.0)
        for name, b, a in zip(names_, before, after, strict=True):
            norm = float(torch.linalg.vector_norm(a - b, dtype=torch.float32))
            expected[parameter_group(name)] += norm * norm
        assert traced == step.group_update_sq == expected and all(v > 0 for v in expected.values())


# ---- the guard --------------------------------------------------------------------------------------------------


def test_a_guard_refusing_every_step_leaves_parameters_and_optimizer_state_bit_identical(model, data):
    trained, _, optimizer = run(model, data)  # an optimizer with state (AdamW moments, step counts)
    params = [p.detach().clone() for p in trained.parameters()]
    state = copy.deepcopy(optimizer.state_dict())
    seen: list[StepTrace] = []

    def refuse(trace: StepTrace) -> bool:
        assert not trace.skipped and trace.group_grad_sq and trace.group_update_sq == {}  # before the step
        seen.append(trace)
        return True

    _, result, _ = run(trained, data, optimizer=optimizer, guard=refuse, trace_groups=True)
    assert all(torch.equal(p, q) for p, q in zip(params, trained.parameters(), strict=True))
    assert same_tensors(optimizer.state_dict(), state)
    assert seen == result.steps and all(s.skipped and math.isfinite(s.grad_norm) for s in result.steps)
    assert all(v == 0.0 for s in result.steps for v in s.group_update_sq.values())
    assert result.metrics["actor/skipped_steps"] == result.metrics["actor/num_updates"] == 6
    assert all(p.grad is None for p in trained.parameters())


def test_a_refused_step_is_as_if_its_mini_batch_were_left_out(model, data):
    """Three epochs over one mini-batch with the 2nd step refused give the weights and optimizer state of two."""
    whole = ["train.mini_batch_size=12", "train.shuffle=false"]
    three, result, opt3 = run(model, data, [*whole, "train.ppo_epochs=3"], guard=second_refused())
    two, _, opt2 = run(model, data, [*whole, "train.ppo_epochs=2"])
    assert [s.skipped for s in result.steps] == [False, True, False]
    assert same_weights(three, two) and same_tensors(opt3.state_dict(), opt2.state_dict())


def test_a_mini_batch_of_equal_reward_groups_is_marked_without_a_reward_signal(model, data):
    """Under GRPO and RLOO a group whose rewards are all equal has advantages 0 (up to rounding):
    a mini-batch of such groups alone has no reward signal (`StepTrace.signal` False, its norm left
    out of the spike history)."""
    batch, inputs, stds = data
    scores = batch.scores.clone()  # groups of rows 0-1, 2-4, 5-6, 7-9, 10-11
    scores[:7], scores[10:] = 0.3, -0.7  # the first three groups and the last: equal rewards
    equal = (dataclasses.replace(batch, scores=scores), inputs, stds)
    seen: list[bool] = []
    for estimator in ("grpo", "rloo"):
        _, result, _ = run(model, equal, ["train.shuffle=false", f"algo.adv_estimator={estimator}"],
                           guard=lambda t: seen.append(t.signal) or False)
        # rows 0-3, 4-7, 8-11; two epochs
        assert [t.signal for t in result.steps] == [False, True, True] * 2
    assert seen == [False, True, True] * 4  # the guard sees it
    for estimator in ("gae", "reinforce_pp"):  # a critic's or the batch's advantages: not 0
        _, result, _ = run(model, equal, ["train.shuffle=false", f"algo.adv_estimator={estimator}"])
        assert all(t.signal for t in result.steps)


def test_a_non_finite_norm_is_skipped_without_asking_the_guard(model, data):
    batch, inputs, stds = data
    bad = ActorInputs(old_logprobs=inputs.old_logprobs, advantages=inputs.advantages.clone())
    bad.advantages[:, :] = float("nan")
    asked = []
    updated, result, _ = run(model, (batch, bad, stds), guard=asked.append)
    assert asked == [] and all(s.skipped and not math.isfinite(s.grad_norm) for s in result.steps)
    assert result.metrics["actor/skipped_steps"] == 6 and same_weights(updated, model)


# ---- typed fields and metrics -----------------------------------------------------------------------------------


@pytest.mark.parametrize("ref", [True, False])
def test_typed_fields_and_group_metrics_equal_the_metrics(model, data, ref):
    _, result, _ = run(model, data, ["algo.kl_coef=0.1", "train.max_grad_norm=0.5"], ref=ref, trace_groups=True)
    m, steps = result.metrics, result.steps
    assert (result.ppo_kl, result.clipfrac_high, result.clipfrac_low) == (
        m["actor/ppo_kl"], m["actor/pg_clipfrac"], m["actor/pg_clipfrac_lower"])
    assert result.kl_loss == (m["actor/kl_loss"] if ref else None) and result.entropy == m["actor/entropy_loss"]
    assert result.ppo_kl != 0 and (not ref or result.kl_loss > 0)
    assert sum(s.grad_norm for s in steps) / len(steps) == pytest.approx(m["actor/grad_norm"], rel=1e-12)
    for key in ("pg_loss", "ppo_kl", "pg_clipfrac"):
        assert sum(s.stats[key] for s in steps) / len(steps) == pytest.approx(m[f"actor/{key}"], rel=1e-12)
    assert m[names.CLIP_HIT_RATE] == sum(s.clipped for s in steps) / len(steps) and 0 < m[names.CLIP_HIT_RATE]
    for group in TRACED_GROUPS:
        pre = [math.sqrt(s.group_grad_sq[group]) for s in steps]
        post = [p * min(1.0, 0.5 / s.grad_norm) for p, s in zip(pre, steps, strict=True)]
        ratio = [math.sqrt(s.group_update_sq[group] / s.group_weight_sq[group]) for s in steps]
        for metric, values in ((names.GROUP_GRAD_NORM, pre), (names.GROUP_GRAD_NORM_CLIPPED, post),
                               (names.GROUP_UPDATE_RATIO, ratio)):
            assert m[names.actor_group(metric, group)] == pytest.approx(sum(values) / len(values), rel=1e-12)
    assert m[names.actor_group(names.GROUP_UPDATE_RATIO, "layer.0")] > 0


def test_tracing_is_read_only(model, data):
    """Group norms, the weights' copy and a guard that refuses nothing change neither the weights nor the stats."""
    plain, off, _ = run(model, data)
    traced, on, _ = run(model, data, trace_groups=True, guard=lambda trace: False)
    assert same_weights(plain, traced)
    grouped = {k for k in on.metrics if k.count("/") == 2}
    assert grouped and on.metrics.keys() - grouped == off.metrics.keys()
    assert {k: on.metrics[k] for k in off.metrics} == off.metrics
    assert all(s.group_grad_sq == s.group_update_sq == s.group_weight_sq == {} for s in off.steps)
    assert [s.stats for s in on.steps] == [s.stats for s in off.steps]


# ---- two ranks --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_ranks_trace_like_one_process(model, data, tmp_path):
    """Replicas (synced full gradients: no sum over ranks) and FSDP2 shards (local squares summed over ranks) give
    the one-process group norms; a guard refusing the 2nd step refuses it on every rank."""
    from conftest import run_ranks

    run_ranks([str(Path(__file__).with_name("dist_update_worker.py")), str(tmp_path)], timeout=240)
    _, single, _ = run(model, data, WORKER_OVERRIDES, sgd_lr=0.1, trace_groups=True, guard=second_refused())
    for r in range(2):
        out = json.loads((tmp_path / f"rank{r}.json").read_text())
        for shard in ("False", "True"):
            for got, want in zip(out[shard], single.steps, strict=True):
                assert got["skipped"] == want.skipped and got["grad_norm"] == pytest.approx(want.grad_norm, rel=1e-5)
                for key in ("group_grad_sq", "group_update_sq", "group_weight_sq"):
                    assert got[key] == pytest.approx(getattr(want, key), rel=1e-4, abs=1e-12), (shard, key)



@pytest.mark.parametrize("max_norm", [0.5, 1e3])  # every gradient scaled; none
def test_clipping_equals_clip_grad_norm_bit_for_bit(max_norm):
    """`clip_gradients` returns `clip_grad_norm_`'s norm and leaves its gradients, bit for bit, whether it takes the
    norms itself or reuses the trace's (`_gradient_norms`), with a parameter that has no gradient."""
    from rldynamics.models.sharding import clip_gradients

    torch.manual_seed(0)
    reference = tiny_model()
    params = [p for p in reference.parameters() if p.requires_grad]
    for p in params[1:]:
        p.grad = torch.randn_like(p) * 0.3
    assert params[0].grad is None
    expected_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    expected = [p.grad.clone() for p in params[1:]]
    assert (expected_norm > max_norm) == (max_norm == 0.5)
    for reuse in (False, True):
        torch.manual_seed(0)
        ours = tiny_model()
        mine = [p for p in ours.parameters() if p.requires_grad]
        for p in mine[1:]:
            p.grad = torch.randn_like(p) * 0.3
        norms = update._gradient_norms(mine)
        taken = [n for n, p in zip(norms, mine, strict=True) if p.grad is not None] if reuse else None
        assert clip_gradients(mine, max_norm, taken) == expected_norm
        assert all(torch.equal(p.grad, e) for p, e in zip(mine[1:], expected, strict=True))


def test_all_finite_finds_nan_and_inf_and_passes_huge_finite_weights():
    """A NaN or an infinity anywhere makes a model non-finite; finite weights so large that their norm overflows
    float32 (1e30: squares of 1e60) are still finite (the entry-by-entry fallback)."""
    from rldynamics.models.sharding import all_finite

    model = tiny_model()
    assert all_finite(model, None)
    weight = next(model.parameters())
    for value, finite in ((float("nan"), False), (float("inf"), False), (-float("inf"), False), (1e30, True)):
        kept = float(weight.data[0, 0])
        weight.data[0, 0] = value
        assert bool(torch.linalg.vector_norm(weight).isfinite()) is (value == 0)  # 1e30 overflows the norm too
        assert all_finite(model) is finite, value
        weight.data[0, 0] = kept
    assert all_finite(model)
