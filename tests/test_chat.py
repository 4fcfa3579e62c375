"""Prompts from real chat templates (ChatML, Llama-3 style, Gemma style without a system role): token streams,
stop tokens, masks and think parsing, on tokenizers and models built in code."""

from __future__ import annotations

import json
import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rldynamics.config import ConfigError, make_config
from rldynamics.envs import make_env
from rldynamics.models.loading import load_model_and_tokenizer
from rldynamics.models.tiny import (
    CHATML_TEMPLATE,
    TOKENIZER_CODE,
    build_tiny_model,
    build_tiny_tokenizer,
    save_tokenizer,
)
from rldynamics.rollout.agent import rollout, state_message, system_message
from rldynamics.rollout.chat import ChatPrompts
from rldynamics.train.sft_data import solver_policy
from rldynamics.train.warmstart import tiny_corpus

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n'"
    " + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
FAMILIES = {
    # name: (template, special tokens, bos, eos, extra eos ids of the model's generation config, end of turn)
    "llama3": (LLAMA3_TEMPLATE, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                 "<|eot_id|>"], "<|begin_of_text|>", "<|end_of_text|>", ["<|eot_id|>"], "<|eot_id|>"),
    "gemma": (GEMMA_TEMPLATE, ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>",
              ["<end_of_turn>"], "<end_of_turn>"),
}


def _corpus() -> list[str]:
    cfg = make_config(overrides=["env.sokoban.observation_format=grid"])
    return tiny_corpus(cfg.env, num_seeds=10)


def _tokenizer(family: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with the family's special tokens and chat template."""
    template, specials, bos, eos, _, _ = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                            show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=specials[1],
                                   chat_template=template, clean_up_tokenization_spaces=False)


def _model(tokenizer, family: str) -> LlamaForCausalLM:
    extra = [tokenizer.convert_tokens_to_ids(t) for t in FAMILIES[family][4]]
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=[tokenizer.eos_token_id, *extra])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *extra]
    return model


def _env_cfg(*extra: str):
    return make_config(overrides=["env.max_turns=3", "env.max_new_tokens=12", *extra]).env


@pytest.fixture(scope="module", params=["chatml", "llama3", "gemma"])
def family(request):
    if request.param == "chatml":
        tokenizer = build_tiny_tokenizer(_corpus(), vocab_size=400)
        model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                 intermediate_size=64)
        return request.param, tokenizer, model
    tokenizer = _tokenizer(request.param)
    return request.param, tokenizer, _model(tokenizer, request.param)


def test_stop_ids_are_the_end_of_turn_and_every_eos(family):
    name, tokenizer, model = family
    chat = ChatPrompts(tokenizer, model=model)
    if name == "chatml":
        assert chat.stop_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    else:
        expected = {tokenizer.convert_tokens_to_ids(t) for t in (FAMILIES[name][3], FAMILIES[name][5])}
        assert set(chat.stop_ids) == expected
    assert chat.system_role == (name != "gemma")


def test_scripted_conversation_decodes_to_the_template_rendering(family):
    """The token stream of a 3-turn episode is the template's rendering of the conversation with the replies."""
    name, tokenizer, _ = family
    cfg = _env_cfg()
    batch = rollout(None, tokenizer, [3], 1, cfg, respond=solver_policy(tokenizer, cfg, noise=1.0,
                                                                       rng=random.Random(0)))
    ids = batch.input_ids[0][batch.attention_mask[0] > 0]
    replies = _replies(tokenizer, batch)
    assert len(replies) == batch.env_metrics[0]["num_turns"] == 3
    users = _user_messages(tokenizer, batch.texts[0], name)
    system = users.pop(0) if name != "gemma" else None
    messages = [{"role": "system", "content": system}] if system else []
    for user, reply in zip(users, replies, strict=True):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    expected = tokenizer.apply_chat_template(messages, tokenize=False)
    decoded = tokenizer.decode(ids, skip_special_tokens=False)
    assert decoded == expected.rstrip("\n")  # the stream ends at the last reply's end-of-turn token
    if name == "gemma":  # no system role: the system text opens the first user message
        assert users[0].startswith("You're a helpful assistant.")


def test_generation_stops_at_a_stop_id_and_masks_only_sampled_tokens(family):
    _, tokenizer, model = family
    cfg = _env_cfg()
    chat = ChatPrompts(tokenizer, model=model)
    torch.manual_seed(0)
    batch = rollout(model, tokenizer, [1, 2], 2, cfg, temperature=1.0)
    for row in range(len(batch)):
        ids = batch.input_ids[row].tolist()
        mask = batch.response_mask[row].tolist()
        spans = _spans(mask)
        assert spans, "every trajectory has at least one sampled reply"
        for start, end in spans:
            reply = ids[start:end]
            stops = [i for i, t in enumerate(reply) if t in chat.stop_ids]
            assert stops in ([], [len(reply) - 1])  # a stop id can only be the last sampled token
            assert len(reply) <= cfg.max_new_tokens
            if not stops:  # cut off by the token limit: the template's closing tokens follow, untrained
                assert ids[end:end + len(chat.closing_ids())] == chat.closing_ids()


def test_think_opener_in_the_prompt_counts_when_parsing(family):
    """With enable_think the prompt ends with `<think>`; a reply `plan</think><answer>..` is well formed."""
    _, tokenizer, _ = family
    cfg = _env_cfg("env.enable_think=true", "env.max_turns=1")
    chat = ChatPrompts(tokenizer, enable_think=True)
    closing = chat.closing_ids()

    def respond(trajs):
        return [tokenizer("plan</think><answer>Up || Left</answer>", add_special_tokens=False)["input_ids"] + closing
                for _ in trajs]

    batch = rollout(None, tokenizer, [5], 2, cfg, respond=respond)
    assert tokenizer.decode(batch.input_ids[0][: _spans(batch.response_mask[0].tolist())[0][0]]).endswith("<think>")
    assert all(m["action_is_valid"] == 1.0 and m["num_actions"] == 2.0 for m in batch.env_metrics)
    assert "format_penalty" in batch.reward_names
    assert batch.reward_components[:, batch.reward_names.index("format_penalty")].eq(0).all()


def test_every_turn_of_a_think_conversation_opens_think_and_trains_the_sampled_tokens(family):
    """Multi-turn with enable_think: every turn's generation prompt ends with `<think>`, every reply
    `plan</think><answer>..` parses as well formed, the masked tokens are exactly the sampled ones, and the
    stream is the template's rendering of the conversation with each assistant message `<think>` + reply."""
    name, tokenizer, _ = family
    cfg = _env_cfg("env.enable_think=true", "env.max_actions_per_turn=1")
    closing = ChatPrompts(tokenizer, enable_think=True).closing_ids()
    prompts, sampled = [], []

    def respond(trajs):
        prompts.extend(tokenizer.decode(t.ids, skip_special_tokens=False) for t in trajs)
        out = [tokenizer("plan</think><answer>Up</answer>", add_special_tokens=False)["input_ids"] + closing
               for _ in trajs]
        sampled.extend(out)
        return out

    batch = rollout(None, tokenizer, [3], 1, cfg, respond=respond)
    assert batch.env_metrics[0]["num_turns"] == 3 and len(prompts) == 3
    assert all(p.endswith("<think>") for p in prompts), [p[-40:] for p in prompts]
    assert batch.env_metrics[0]["action_is_valid"] == 1.0
    assert batch.reward_components[0, batch.reward_names.index("format_penalty")] == 0
    ids = batch.input_ids[0].tolist()
    assert [ids[s:e] for s, e in _spans(batch.response_mask[0].tolist())] == sampled  # trained == sampled
    users = _user_messages(tokenizer, batch.texts[0], name)
    messages = [{"role": "system", "content": users.pop(0)}] if name != "gemma" else []
    for user, reply in zip(users, _replies(tokenizer, batch), strict=True):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": "<think>" + reply}]
    expected = tokenizer.apply_chat_template(messages, tokenize=False).rstrip("\n")
    assert tokenizer.decode(batch.input_ids[0][batch.attention_mask[0] > 0], skip_special_tokens=False) == expected


@pytest.mark.parametrize("open_answer", [False, True])
def test_open_answer_ends_every_prompt_with_the_answer_tag(family, open_answer):
    """env.open_answer (RAGEN's no-think prompt): every turn's prompt ends with `<answer>` and the reply
    `Up || Left</answer>` is well formed; without it that reply has no opening tag and is malformed."""
    _, tokenizer, _ = family
    cfg = _env_cfg(f"env.open_answer={str(open_answer).lower()}", "env.max_turns=2", "env.max_actions_per_traj=4")
    closing = ChatPrompts(tokenizer).closing_ids()
    prompts = []

    def respond(trajs):
        prompts.extend(tokenizer.decode(t.ids, skip_special_tokens=False) for t in trajs)
        return [tokenizer("Up || Left</answer>", add_special_tokens=False)["input_ids"] + closing for _ in trajs]

    batch = rollout(None, tokenizer, [5], 1, cfg, respond=respond)
    assert len(prompts) == 2 and all(p.endswith("<answer>") == open_answer for p in prompts)
    assert batch.env_metrics[0]["action_is_valid"] == float(open_answer)
    assert batch.env_metrics[0]["num_actions"] == (4.0 if open_answer else 0.0)


def test_open_answer_with_think_is_a_config_error():
    with pytest.raises(ConfigError, match="env.open_answer=true needs env.enable_think=false"):
        make_config(overrides=["env.open_answer=true", "env.enable_think=true"])


def test_missing_chat_template_is_a_clear_error():
    tokenizer = _tokenizer("llama3")
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="model.chat_template=chatml"):
        ChatPrompts(tokenizer)


def test_chatml_fallback_and_template_file(tmp_path, tiny_cache_dir):
    (tmp_path / "t.jinja").write_text(LLAMA3_TEMPLATE)
    _, tok = load_model_and_tokenizer(str(tiny_cache_dir), chat_template="chatml")
    assert tok.chat_template == CHATML_TEMPLATE
    _, tok = load_model_and_tokenizer(str(tiny_cache_dir), chat_template=str(tmp_path / "t.jinja"))
    assert tok.chat_template == LLAMA3_TEMPLATE
    with pytest.raises(FileNotFoundError, match="no such template file"):
        load_model_and_tokenizer(str(tiny_cache_dir), chat_template=str(tmp_path / "missing.jinja"))


def _varied_texts(tokenizer) -> list[str]:
    """Chat-rendered first prompts and observations of every env (every observation format of the grid envs), a
    multi-turn conversation with replies, and seeded random unicode (combining marks, ligatures, wide forms, emoji,
    CJK, controls, runs of whitespace: the characters where NFC or another pre-tokeniser would split differently)."""
    texts = []
    for name, extra in [("sokoban", f) for f in ("grid", "coord", "grid_coord")] + [
            ("frozenlake", f) for f in ("grid", "coord", "grid_coord")] + [("countdown", None), ("bandit", None),
                                                                          ("math", None)]:
        key = [f"env.{name}.observation_format={extra}"] if extra else []
        cfg = make_config(overrides=[f"env.name={name}", *key])
        env = make_env(name, **cfg.env.options())
        for seed in range(3):
            observation = env.reset(seed)
            user = state_message(env, 1, observation, cfg.env.max_actions_per_traj)
            messages = [{"role": "system", "content": system_message(env, cfg.env)}, {"role": "user", "content": user}]
            texts += [observation, tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)]
    texts.append(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Turn 1:\nState:\n#_OX√#\n(1, 2)"},
         {"role": "assistant", "content": "<think>go</think><answer>Up || Left</answer>"},
         {"role": "user", "content": "Reward: -0.1\nTurn 2:"}], tokenize=False, add_generation_prompt=True))
    rng = random.Random(0)
    pool = ("abcXYZ019 (,)_#√|<>/\n\r\t  \u00e9e\u0301\u212b\ufb01\uff21\uff10\u00bd\u2460\u4e2d\u6587\u3042"
            "\u0928\u093f\U0001f600\U0001f44d\u200d\u00a0\u2028\x00\x7f")
    texts += ["".join(rng.choice(pool) for _ in range(rng.randint(1, 60))) for _ in range(200)]
    code_points = [c for c in range(1, 0x2FFFF) if not 0xD800 <= c < 0xE000]  # any character but the surrogates
    texts += ["".join(chr(rng.choice(code_points)) for _ in range(rng.randint(1, 30))) for _ in range(200)]
    return texts


@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_tiny_checkpoint_tokenizer_gives_identical_ids_through_bare_auto_tokenizer(tmp_path, tiny_cache_dir,
                                                                                 trust_remote_code):
    """Bare `AutoTokenizer.from_pretrained` on a tiny model directory and on a training checkpoint saved from it
    gives our tokenizer's ids, text and chat template (transformers would rebuild a qwen2 tokenizer as
    Qwen2Tokenizer with Qwen's pre-tokeniser without the saved `auto_map`)."""
    _, ours = load_model_and_tokenizer(str(tiny_cache_dir))
    save_tokenizer(ours, tmp_path)  # as a checkpoint saves it
    texts = _varied_texts(ours)
    for directory in (tiny_cache_dir, tmp_path):
        bare = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
        assert type(bare).__name__ != "Qwen2Tokenizer"
        assert bare.chat_template == ours.chat_template == CHATML_TEMPLATE
        assert (bare.eos_token, bare.pad_token, len(bare)) == (ours.eos_token, ours.pad_token, len(ours))
        for text in texts:
            ids = ours(text, add_special_tokens=False)["input_ids"]
            assert bare(text, add_special_tokens=False)["input_ids"] == ids, text
            assert bare.decode(ids) == ours.decode(ids) == text, text


def test_saved_hub_style_tokenizer_gets_no_auto_map(tmp_path):
    """Only the tiny tokenizer gets the `auto_map` and the class file; other tokenizers save as they are."""
    save_tokenizer(_tokenizer("llama3"), tmp_path)
    assert "auto_map" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert not (tmp_path / TOKENIZER_CODE.name).exists()


@pytest.fixture(scope="module")
def tiny_cache_dir(tmp_path_factory):
    from rldynamics.models.tiny import ensure_tiny_model

    return ensure_tiny_model(_corpus, tmp_path_factory.mktemp("cache"), vocab_size=400, hidden_size=32,
                             num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


def _spans(mask: list[float]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0.0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def _replies(tokenizer, batch) -> list[str]:
    ids = batch.input_ids[0].tolist()
    return [tokenizer.decode(ids[s:e], skip_special_tokens=True) for s, e in _spans(batch.response_mask[0].tolist())]


def _user_messages(tokenizer, text: str, family: str) -> list[str]:
    """The system (if any) and user message contents of a decoded conversation, in order."""
    if family == "chatml":
        parts = text.split("<|im_start|>")[1:]
        return [p.split("\n", 1)[1].split("<|im_end|>")[0] for p in parts if p.startswith(("system", "user"))]
    if family == "llama3":
        parts = text.split("<|start_header_id|>")[1:]
        return [p.split("<|end_header_id|>\n\n", 1)[1].split("<|eot_id|>")[0] for p in parts
                if p.startswith(("system", "user"))]
    parts = text.split("<start_of_turn>")[1:]
    return [p.split("\n", 1)[1].split("<end_of_turn>")[0] for p in parts if p.startswith("user")]
