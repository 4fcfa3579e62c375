"""LoRA adapters (`model.lora.*`, peft) end to end on the embedded tiny model, and once on SmolLM2.

A LoRA run trains the adapters alone (the base weights stay bit-identical to the base model's, the trained count is
peft's), its KL reference is the base with the adapters off (no second model is loaded), its checkpoints reload with
`PeftModel.from_pretrained` and, merged, with bare `from_pretrained` (equal log-probs), a resume gives the
uninterrupted run's metrics, the gradient analysis runs over the adapters and leaves them bit-identical, and
`rldyn eval`, `rldyn probe` and `rldyn replay` take adapter checkpoints.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from rldynamics.cli import main
from rldynamics.config import ConfigError, help_text, make_config
from rldynamics.models import lora
from rldynamics.models.forward import token_logprobs
from rldynamics.models.loading import load_model_and_tokenizer
from rldynamics.models.precision import enable_checkpointing
from rldynamics.tracking.run_dir import read_metrics
from rldynamics.train.checkpoint import verify_checkpoint
from rldynamics.train.record_io import weights_digest
from rldynamics.train.trainer import train
from test_probe import (  # noqa: F401  (single_thread: an autouse fixture)
    SIGNS,
    algo_cfg,
    bucket_rows,
    make_batch,
    params_of,
    probe,
    single_thread,
    sokoban_corpus,
)

pytest.importorskip("peft")

PRESET = "math-tiny"  # one-turn arithmetic whose length component varies: rewards and gradients from step 1
RUN = ["train.steps=3", "train.env_groups=2", "train.group_size=3", "train.mini_batch_size=3",
       "train.micro_batch_size=2", "env.max_new_tokens=40", "env.max_turns=1", "env.math.length_target=20",
       "val.env_groups=2", "val.every=3", "val.before_train=false", "model.warm_start_episodes=8",
       "model.warm_start_epochs=1", "log.progress=false", "log.samples_per_step=1", "log.report=false",
       "model.lora.rank=4", "model.lora.alpha=8", "algo.kl_coef=0.01", "algo.entropy_coef=0.01"]
ANALYSIS = ["analysis.enabled=true", "analysis.every=1", "analysis.num_buckets=2"]
SAVED = ["checkpoint.every=1", "checkpoint.save_merged=true", "record.every=1"]


def _train(overrides: list[str], name: str, *keys: str):
    return train(make_config(PRESET, overrides=[*overrides, *RUN, f"log.name={name}", *keys]))


def _training_rows(run) -> list[dict]:
    """The metrics rows without timings and validation (a run validates after its last step: the first leg of a
    resumed run validates where the uninterrupted one does not), NaN (an undefined cosine) made comparable."""
    other = ("timing_s/", "val-", "health/no_learning", "health/falling_validation", "record/bytes")
    return [{k: "nan" if v != v else v for k, v in row.items() if not k.startswith(other)} for row in read_metrics(run)]


def _base_path(run) -> str:
    from rldynamics.train.setup import base_model_path, run_config

    return base_model_path(run_config(run / "checkpoints" / "step_1"))


@pytest.fixture(scope="module")
def lora_run(tiny_cache, tmp_path_factory):
    """One LoRA run with the analysis every step, a checkpoint (with the merged export) and a record after each."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLDYN_CACHE", tiny_cache)
        root = tmp_path_factory.mktemp("lora")
        run = _train([f"log.run_dir={root / 'runs'}"], "lora", *ANALYSIS, *SAVED)
        yield run


@pytest.fixture
def overrides(fast_overrides):
    return [o for o in fast_overrides if o.startswith("log.run_dir=")]


# ---- a run trains the adapters alone -----------------------------------------------------------------------------


def test_a_lora_run_trains_the_adapters_and_keeps_the_base_bit_identical(lora_run):
    """The record of the last step holds the digest of every weight the session held after it (base included): the
    base model loaded afresh with the saved adapter gives that digest, so the trained base weights were never
    touched; the adapters' B matrices (zero at the start) have moved."""
    from rldynamics.tracking.step_records import read_record, record_path

    base, _ = load_model_and_tokenizer(_base_path(lora_run))
    actor = lora.load_adapter(base, lora_run / "checkpoints" / "step_3" / "actor")
    _, meta = read_record(record_path(lora_run, 3))
    assert weights_digest(actor) == meta["weights_after"]
    adapter = load_file(str(lora_run / "checkpoints" / "step_3" / "actor" / "adapter_model.safetensors"))
    assert all(".lora_A." in k or ".lora_B." in k for k in adapter)
    assert all(t.dtype == torch.float32 for t in adapter.values())
    assert any(bool(t.abs().max() > 0) for k, t in adapter.items() if ".lora_B." in k)
    rows = {row["step"]: row for row in read_metrics(lora_run)}
    assert sorted(rows) == [1, 2, 3] and all(rows[s]["actor/grad_norm"] > 0 for s in (1, 2, 3))
    groups = {k.split("/")[-1] for k in rows[1] if k.startswith("actor/grad_norm_clipped/")}
    assert groups == {"layer.0", "layer.1"}  # peft's names (base_model.model..., lora_A/B) group by block


def test_the_trained_count_is_peft_s_and_the_optimizer_holds_the_adapters_alone(lora_run):
    from peft import LoraConfig, get_peft_model

    base, _ = load_model_and_tokenizer(_base_path(lora_run))
    expected, total = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                                     task_type="CAUSAL_LM")).get_nb_trainable_parameters()
    assert 0 < expected < total / 5
    environment = json.loads((lora_run / "environment.jsonl").read_text().splitlines()[0])
    assert environment["trained_parameters"] == expected
    assert all(row["grad_analysis/parameters"] == expected for row in read_metrics(lora_run))
    adapter = load_file(str(lora_run / "checkpoints" / "step_3" / "actor" / "adapter_model.safetensors"))
    assert sum(t.numel() for t in adapter.values()) == expected
    optim = torch.load(lora_run / "checkpoints" / "step_3" / "optimizer.pt", weights_only=True)["actor"]
    assert sum(len(group["params"]) for group in optim["param_groups"]) == len(adapter)  # given the adapters alone
    assert sum(s["exp_avg"].numel() for s in optim["state"].values()) == expected
    assert all(s["exp_avg"].dtype == torch.float32 for s in optim["state"].values())


# ---- checkpoints -------------------------------------------------------------------------------------------------


def test_a_checkpoint_loads_with_peft_and_merged_with_bare_transformers(lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = lora_run / "checkpoints" / "step_3"
    verify_checkpoint(ckpt)
    assert not (ckpt / "actor" / "config.json").exists() and not (ckpt / "actor" / "README.md").exists()
    base, tokenizer = load_model_and_tokenizer(_base_path(lora_run))
    ids = torch.tensor([tokenizer.encode("What is 12 + 7? <answer>19</answer>")])  # [1, L]
    mask = torch.ones_like(ids)  # [1, L]
    adapted = PeftModel.from_pretrained(base, str(ckpt / "actor")).eval()
    merged = AutoModelForCausalLM.from_pretrained(ckpt / "actor_merged", dtype=torch.float32).eval()
    with torch.no_grad():
        with adapted.disable_adapter():
            before, _ = token_logprobs(adapted, ids, mask)  # [1, L]
        theirs, _ = token_logprobs(adapted, ids, mask)
        ours, _ = token_logprobs(merged, ids, mask)
    assert float((theirs - before).abs().max()) > 1e-4  # the adapter changes the policy
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert merged.lm_head.weight is merged.model.embed_tokens.weight  # the tie survives the export


def test_resume_gives_the_uninterrupted_runs_metrics(lora_run, overrides):
    keys = [*ANALYSIS, *SAVED]
    _train(overrides, "split", *keys, "train.steps=2")
    resumed = _train(overrides, "split", *keys, "checkpoint.resume=latest")
    assert [r["step"] for r in read_metrics(resumed)] == [1, 2, 3]
    assert _training_rows(resumed) == _training_rows(lora_run)


# ---- the reference -----------------------------------------------------------------------------------------------


def test_the_reference_is_the_base_with_the_adapters_off_and_no_second_model(overrides, monkeypatch):
    from rldynamics.models import loading
    from rldynamics.train import setup
    from rldynamics.train.prepare import logprob_pass, prepare_update
    from rldynamics.train.setup import Start, make_session

    loads = []
    real = loading.load_model_and_tokenizer
    monkeypatch.setattr(setup, "load_model_and_tokenizer", lambda *a, **k: loads.append(a) or real(*a, **k))
    cfg = make_config(PRESET, overrides=[*overrides, *RUN])
    s = make_session(cfg, setup.resolve_run_dir(cfg), Start())  # writes nothing
    assert len(loads) == 1 and s.ref_model is s.model and lora.is_adapted(s.model)
    with torch.no_grad():
        for name, p in s.model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.5)  # adapters that change the policy
    base, tokenizer = real(setup.base_model_path(cfg))
    batch = make_batch(base)[0]
    reference = prepare_update(s, batch, 1.0).inputs.ref_logprobs  # [N, L] the training step's reference pass
    expected, = logprob_pass(cfg, base, batch, with_entropy=False)
    adapted, = logprob_pass(cfg, s.model, batch, with_entropy=False)
    assert torch.equal(reference, expected)
    assert float((adapted - expected).abs().max()) > 1e-3


# ---- the analysis ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapted():
    """The micro tiny model with rank-2 adapters whose B matrices are not zero (peft's start would give zero
    adapter gradients for A)."""
    from rldynamics.models.tiny import build_tiny_model, build_tiny_tokenizer

    model = build_tiny_model(build_tiny_tokenizer(sokoban_corpus()), hidden_size=32, num_layers=1,
                             intermediate_size=64)
    torch.manual_seed(0)
    model = lora.add_adapters(model, 2, 4, 0.0, ["all-linear"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.1)
    return model


def test_merged_weights_are_the_exports_under_the_base_names(adapted):
    """What the vLLM engine loads: the merged export's values under the bare model's parameter names (a tied weight
    once), in new tensors; `adapted_blocks` keeps the attention and MLP blocks alone, whole."""
    bare = {name for name, _ in adapted.get_base_model().named_parameters() if ".lora_" not in name}
    bare = {name.replace(".base_layer.", ".") for name in bare}
    exported = lora.merged_state_dict(adapted)
    weights = lora.merged_weights(adapted)
    assert {name for name, _ in weights} == bare and len(weights) == len(bare)
    assert all(torch.equal(tensor, exported[name]) for name, tensor in weights)
    own = {p.data_ptr() for p in adapted.parameters()}
    changed = [name for name, tensor in weights if tensor.data_ptr() not in own]
    assert changed and all(name.endswith("_proj.weight") for name in changed)  # the adapted weights, merged anew
    blocks = [name for name, _ in lora.merged_weights(adapted, adapted_blocks=True)]
    assert sorted(blocks) == sorted(name for name in bare if ".self_attn." in name or ".mlp." in name)
    assert not any("embed" in name or "norm" in name for name in blocks)


def test_bucket_gradients_over_the_adapters_sum_to_the_all_gradient(adapted):
    """Over the adapter parameters alone: the buckets' gradients, weighted by their token shares, sum to the `all`
    gradient, which is the gradient of the whole batch's loss (autograd on one forward)."""
    from rldynamics.algo.shares import sub_batch_share
    from rldynamics.analysis.objective import actor_terms, policy_loss_settings

    data = make_batch(adapted)
    batch, inputs, _ = data
    result = probe(adapted, data, keep_gradients=True, micro_batch_size=2, num_buckets=3)
    trained = sum(p.numel() for p in params_of(adapted))
    assert trained == lora.count(adapted).trained < sum(p.numel() for p in adapted.parameters()) / 2
    buckets = sorted({b for b, _, _ in result.groups})
    shares = {b: sub_batch_share(batch.response_mask, bucket_rows(result, batch, b), "token-mean") for b in buckets}
    terms, _ = actor_terms(adapted, batch, torch.arange(len(batch)), inputs, policy_loss_settings(algo_cfg()),
                           temperature=1.0)
    for comp, (term, sign) in SIGNS.items():
        total = result.gradients[f"all/{comp}"]  # [P] over the adapter parameters
        assert total.numel() == trained and float(total.abs().max()) > 0
        summed = sum(shares[b] * result.gradients[f"{b}/{comp}"] for b in buckets)  # [P]
        torch.testing.assert_close(summed, total, rtol=1e-5, atol=1e-6 * float(total.abs().max()))
        direct = sign * torch.cat([g.reshape(-1) for g in torch.autograd.grad(terms[term], params_of(adapted),
                                                                              retain_graph=True)])  # [P]
        torch.testing.assert_close(total, direct, rtol=1e-5, atol=1e-5 * float(direct.abs().max()))


def test_the_analysis_leaves_the_adapters_bit_identical(adapted):
    data = make_batch(adapted)
    before = {k: v.clone() for k, v in adapted.state_dict().items()}
    rng = torch.get_rng_state()
    probe(adapted, data)
    assert all(torch.equal(v, before[k]) for k, v in adapted.state_dict().items())
    assert all(p.grad is None for p in adapted.parameters()) and torch.equal(torch.get_rng_state(), rng)


def test_analysis_on_leaves_the_lora_run_bit_identical(lora_run, overrides):
    off = _train(overrides, "off", *SAVED)
    ours = load_file(str(lora_run / "checkpoints" / "step_3" / "actor" / "adapter_model.safetensors"))
    theirs = load_file(str(off / "checkpoints" / "step_3" / "actor" / "adapter_model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_activation_checkpointing_keeps_the_adapter_gradients(adapted):
    batch = make_batch(adapted)[0]

    def grads(model):
        lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, positions=batch.response_mask)
        return torch.autograd.grad((lp * batch.response_mask).sum(), params_of(model))

    plain, checkpointed = grads(adapted), grads(enable_checkpointing(copy.deepcopy(adapted)))
    for a, b in zip(plain, checkpointed, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_mixed_precision_computes_in_bfloat16_around_float32_adapters(adapted):
    from rldynamics.models.precision import compute_in

    model = compute_in(copy.deepcopy(adapted), "bfloat16")
    batch = make_batch(adapted)[0]
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    assert logits.dtype == torch.bfloat16  # the forward (the peft wrapper's) runs under autocast
    grads = torch.autograd.grad(logits.float().logsumexp(-1).mean(), params_of(model))
    assert all(p.dtype == torch.float32 for p in params_of(model)) and all(g.dtype == torch.float32 for g in grads)
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".lora_" not in n)


def test_shared_prefix_forward_goes_through_the_peft_wrapper(adapted):
    """The cache keyword is read from the transformers model under peft's `**kwargs` wrapper, so a group's prompt is
    forwarded once (and gives the log-probs of the unshared forward)."""
    from rldynamics.models.forward import cache_kwarg, caches_plainly

    assert cache_kwarg(adapted) in ("cache", "past_key_values") and caches_plainly(adapted)
    batch = make_batch(adapted)[0]
    shared, _ = token_logprobs(adapted, batch.input_ids, batch.attention_mask, positions=batch.response_mask)
    plain, _ = token_logprobs(adapted, batch.input_ids, batch.attention_mask, positions=batch.response_mask,
                              shared_prefix=False)
    torch.testing.assert_close(shared, plain, rtol=1e-5, atol=1e-5)


def test_adapter_dropout_acts_in_the_update_alone(adapted):
    model = copy.deepcopy(adapted)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleDict) and "default" in module and isinstance(module["default"],
                                                                                           torch.nn.Identity):
            module["default"] = torch.nn.Dropout(0.5).eval()
    batch = make_batch(model)[0]

    def forward():
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits

    whole = forward()
    rng = torch.get_rng_state()
    with lora.adapter_dropout(model, seed=1):
        dropped = forward()
    with lora.adapter_dropout(model, seed=1):
        again = forward()
    assert torch.equal(torch.get_rng_state(), rng)  # the masks come from a forked, seeded stream
    assert torch.equal(forward(), whole) and not torch.equal(dropped, whole) and torch.equal(again, dropped)
    assert torch.equal(forward(), whole) and not model.training


def test_a_step_with_adapter_dropout_replays_bit_identically(overrides):
    from rldynamics.train.replay import replay_command

    run = _train(overrides, "dropout", "model.lora.dropout=0.3", "train.steps=2", "checkpoint.every=1",
                 "record.every=1", "val.every=0")
    summary = json.loads((replay_command(run, 2, []) / "replay.json").read_text())
    assert summary["weights_identical"] is True and summary["metrics_identical"] is True


def test_a_tied_lm_head_is_not_adapted():
    from rldynamics.models.tiny import build_tiny_model, build_tiny_tokenizer

    model = build_tiny_model(build_tiny_tokenizer(sokoban_corpus()), hidden_size=32, num_layers=1,
                             intermediate_size=64)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="tied LM head"):
        lora.add_adapters(model, 2, 4, 0.0, ["lm_head"])


def test_a_rank_above_the_narrowest_adapted_layer_is_refused():
    """A rank above min(in, out) of an adapted layer adds parameters and no expressiveness there:
    refused in one line naming the rank, the width and the module, before any adapter exists."""
    from rldynamics.models.tiny import build_tiny_model, build_tiny_tokenizer

    model = build_tiny_model(build_tiny_tokenizer(sokoban_corpus()), hidden_size=32, num_layers=1,
                             intermediate_size=64)  # k_proj and v_proj: 32 -> 16
    named = r"model.lora.rank=100000 .* 16 .*model.layers.0.self_attn.k_proj"
    with pytest.raises(ValueError, match=named) as error:
        lora.add_adapters(model, 100000, 16, 0.0, ["all-linear"])
    assert len(str(error.value).splitlines()) == 1 and not lora.is_adapted(model)
    with pytest.raises(ValueError, match="rank=33 .* 32 .*q_proj"):
        lora.add_adapters(model, 33, 16, 0.0, ["q_proj"])
    assert lora.count(lora.add_adapters(model, 16, 16, 0.0, ["all-linear"])).rank == 16


# ---- commands on adapter checkpoints -----------------------------------------------------------------------------


def test_eval_of_an_adapter_checkpoint_reproduces_its_validation(lora_run, tmp_path, capsys):
    logged = read_metrics(lora_run)[-1]
    assert logged["step"] == 3
    assert main(["eval", str(lora_run / "checkpoints" / "step_3"), f"log.run_dir={tmp_path}"]) == 0
    [row] = read_metrics(tmp_path / "eval_lora_step_3")
    keys = [k for k in logged if k.startswith("val-env/")]
    assert keys and all(row[k] == logged[k] for k in keys)
    capsys.readouterr()
    assert main(["eval", str(lora_run / "checkpoints" / "step_3" / "actor"), f"log.run_dir={tmp_path}"]) == 2
    assert "is a LoRA adapter, not a whole model" in capsys.readouterr().err


def test_probe_of_an_adapter_checkpoint_runs_over_the_adapters(lora_run, tmp_path):
    from rldynamics.train.probe import probe_checkpoint

    out = probe_checkpoint(lora_run / "checkpoints" / "step_2", [f"log.run_dir={tmp_path}"])
    [row] = read_metrics(out)
    assert row["grad_analysis/parameters"] == read_metrics(lora_run)[0]["grad_analysis/parameters"]
    assert row["grad_norm/all/raw/kl"] > 0  # the trained adapters against the base: a KL gradient


def test_replay_of_a_lora_step_is_bit_identical(lora_run):
    from rldynamics.train.replay import replay_command

    out = replay_command(lora_run, 3, [], attribute=True)
    summary = json.loads((out / "replay.json").read_text())
    assert summary["weights_identical"] is True and summary["metrics_identical"] is True
    rows = json.loads((out / "attribution.json").read_text())["rows"]
    assert sum(r["share"] for r in rows) == pytest.approx(1.0, abs=1e-6)


# ---- config ------------------------------------------------------------------------------------------------------


def test_config_keys_and_refusals():
    """`--help-config` lists the keys; settings LoRA cannot honour are one ConfigError each (RAGEN's and verl's key
    names: tests/test_ragen_keys.py)."""
    text = help_text()
    assert all(f"model.lora.{k}=" in text for k in ("rank", "alpha", "dropout", "target_modules"))
    assert "checkpoint.save_merged=" in text
    make_config(overrides=["model.lora.rank=4", "rollout.engine=vllm"])  # the engine samples the merged weights
    for bad, match in ((["checkpoint.save_merged=true"], "needs model.lora.rank > 0"),
                       (["model.lora.target_modules=[]"], "adapts nothing"),
                       (["model.lora.rank=4", "model.lora.target_modules=[all-linear,q_proj]"], "alone")):
        with pytest.raises(ConfigError, match=match):
            make_config(overrides=bad)


def test_lora_without_peft_is_one_line_before_any_work(overrides, tmp_path, capsys, monkeypatch):
    import importlib.util

    from rldynamics.train.setup import check_world

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    assert main(["train", *overrides, "model.lora.rank=4", "log.name=nopeft"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs peft" in err and "pip install -e '.[lora]'" in err
    assert not (tmp_path / "runs" / "nopeft").exists()
    check_world(make_config(overrides=["model.lora.rank=4"]), 2)  # several ranks take adapters (test_dist_lora.py)


# ---- a real model ------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_lora_two_steps_reload_both_ways(smollm2_dir, overrides):
    """SmolLM2 (Llama, tied embeddings): two LoRA steps in mixed precision where the CPU computes bfloat16 fast; the
    adapter and the merged export give the same log-probs, and the base weights never moved."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = train(make_config("math-smollm2", overrides=[
        *overrides, f"model.path={smollm2_dir}", "train.steps=2", "train.env_groups=2", "train.group_size=2",
        "train.mini_batch_size=4", "train.micro_batch_size=2", "val.env_groups=2", "val.every=0",
        "env.max_new_tokens=12", "log.progress=false", "log.report=false", "model.lora.rank=8",
        "checkpoint.save_merged=true", "record.every=1", "algo.kl_coef=0.01", "log.name=smol"]))
    ckpt = run / "checkpoints" / "step_2"
    base, tokenizer = load_model_and_tokenizer(smollm2_dir)
    ids = torch.tensor([tokenizer.encode("What is 12 + 7? The answer is 19.")])  # [1, L]
    mask = torch.ones_like(ids)
    adapted = PeftModel.from_pretrained(base, str(ckpt / "actor")).eval()
    from rldynamics.tracking.step_records import read_record, record_path

    assert weights_digest(adapted) == read_record(record_path(run, 2))[1]["weights_after"]
    merged = AutoModelForCausalLM.from_pretrained(ckpt / "actor_merged", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs, _ = token_logprobs(adapted, ids, mask)
        ours, _ = token_logprobs(merged, ids, mask)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
