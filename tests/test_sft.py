"""`rldyn sft`: assistant-only loss, packing equal to padding, held-out puzzles, exact resume, checkpoints to train."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from rldynamics.cli import main
from rldynamics.config import ConfigError, make_config
from rldynamics.models.loading import load_model_and_tokenizer
from rldynamics.train.checkpoint import CheckpointError, verify_checkpoint
from rldynamics.train.sft import check_packing, nll_sum, rows_of, sft_base_path, sft_data, step_rows
from rldynamics.train.sft_data import demonstrations, from_messages, pack, read_conversations

SFT = ["sft.episodes=12", "sft.batch_size=2", "sft.max_length=400", "sft.lr=1e-3", "val.env_groups=4",
       "env.max_turns=2", "env.max_new_tokens=8", "log.progress=false", "model.threads=1"]
CHAT = [{"role": "system", "content": "You play a game."}, {"role": "user", "content": "Where next?"},
        {"role": "assistant", "content": "<answer>Left</answer>"}, {"role": "user", "content": "And now?"},
        {"role": "assistant", "content": "<answer>Down</answer>"}]


@pytest.fixture(scope="module")
def tiny(tiny_cache):
    """The untrained embedded tiny model (the one `rldyn sft` starts from) and its ChatML tokenizer; the module's
    runs (and the processes they start) share the session's model cache."""
    before = os.environ.get("RLDYN_CACHE")
    os.environ["RLDYN_CACHE"] = tiny_cache
    torch.manual_seed(0)
    yield load_model_and_tokenizer(sft_base_path(make_config("frozenlake-tiny")))
    if before is None:
        os.environ.pop("RLDYN_CACHE")
    else:
        os.environ["RLDYN_CACHE"] = before


def test_pack_is_first_fit_longest_first():
    # lengths 5 3 4 2 6 into rows of 8: 6 -> row 0, 5 -> row 1, 4 -> row 2, 3 -> row 1 (full), 2 -> row 0 (full)
    assert pack([5, 3, 4, 2, 6], 8) == [[4, 3], [0, 1], [2]]
    with pytest.raises(ValueError, match=r"1 conversation\(s\) are longer than sft.max_length=8 tokens \(the "
                                         r"longest: 9\); raise sft.max_length"):
        pack([3, 9], 8)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 20), max_size=30), st.integers(20, 40))
def test_pack_places_every_sequence_once_within_the_row_length(lengths, max_length):
    rows = pack(lengths, max_length)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= max_length for row in rows)


def test_only_the_assistants_tokens_are_trained(tiny):
    """Each trained span decodes to an assistant message and the template's closing tokens, and nothing else is
    trained: a user or system token in the mask would show in the decoded text."""
    _, tokenizer = tiny
    conv = from_messages(tokenizer, CHAT, "test")
    assert tokenizer.decode(list(conv.ids)) == tokenizer.apply_chat_template(CHAT, tokenize=False)
    spans, current = [], []
    for token, trained in zip(conv.ids, conv.trained, strict=True):
        if trained:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    spans += [tokenizer.decode(current)] if current else []
    assert spans == ["<answer>Left</answer><|im_end|>\n", "<answer>Down</answer><|im_end|>\n"]


def test_the_loss_is_the_nll_of_the_assistant_tokens_alone(tiny):
    """`nll_sum` (packed and padded) against log-softmax of the full logits at the assistant positions, by hand; a
    change of a user token's target leaves the loss alone."""
    model, tokenizer = tiny
    conv = from_messages(tokenizer, CHAT, "test")
    ids = torch.tensor([conv.ids])  # [1, L]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)  # [L-1, V]
        expected = -sum(logp[t - 1, conv.ids[t]] for t in range(1, len(conv)) if conv.trained[t])
        for packed in (True, False):
            nll, tokens, _ = nll_sum(model, [[conv]], tokenizer.pad_token_id, packed)
            assert tokens == sum(conv.trained)
            torch.testing.assert_close(nll, expected, rtol=1e-5, atol=1e-5)


def test_packing_gives_the_losses_and_gradients_of_padding(tiny):
    model, tokenizer = tiny
    cfg = make_config("frozenlake-tiny", overrides=SFT)
    convs = demonstrations(cfg, tokenizer, list(range(6)), 0.3, 0)
    pad = tokenizer.pad_token_id
    results = {}
    for packed in (True, False):
        rows = rows_of(convs, packed, 1200)
        assert len(rows) < len(convs) if packed else len(rows) == len(convs)
        model.zero_grad()
        nll, tokens, _ = nll_sum(model, rows, pad, packed)
        (nll / tokens).backward()
        results[packed] = (nll.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=1e-5)
    for name, grad in results[True][1].items():
        torch.testing.assert_close(grad, results[False][1][name], rtol=1e-4, atol=1e-6, msg=name)
    check_packing(model, convs)  # the run's own start-up check agrees


def test_a_demonstration_is_the_envs_chat_with_the_solvers_replies_trained(tiny):
    _, tokenizer = tiny
    cfg = make_config("frozenlake-tiny", overrides=SFT)
    (conv,) = demonstrations(cfg, tokenizer, [7], 0.0, 0)
    text = tokenizer.decode(list(conv.ids))
    trained = tokenizer.decode([t for t, m in zip(conv.ids, conv.trained, strict=True) if m])
    assert text.startswith("<|im_start|>system\n") and "<|im_start|>user\n" in text
    assert trained.count("<answer>") == trained.count("<|im_end|>") >= 1
    assert "<|im_start|>" not in trained and "Turn" not in trained


def test_no_validation_puzzle_is_among_the_demonstrations(tiny):
    """Bandit has 24 problems: with `val.held_out` 0 the validation seeds show them all, and every demonstration is
    left out (a clear error); split by content, training keeps its own problems and validation its own."""
    _, tokenizer = tiny
    with pytest.raises(ConfigError, match="plays a validation puzzle.*set val.held_out"):
        sft_data(make_config("bandit-tiny", overrides=[*SFT, "val.env_groups=128"]), tokenizer, log=lambda *_: None)
    for preset, held_out in (("bandit-tiny", 0.3), ("frozenlake-tiny", 0.0), ("countdown-tiny", 0.3)):
        cfg = make_config(preset, overrides=[*SFT, "sft.episodes=60", "val.env_groups=64", f"val.held_out={held_out}"])
        data = sft_data(cfg, tokenizer, log=lambda *_: None)
        assert data.train and data.val
        assert not {c.problem for c in data.train} & {c.problem for c in data.val}, preset


def test_the_bandit_smollm2_preset_validates_on_arm_boards_it_never_demonstrates(tiny):
    """RAGEN's 20 arm pairs in both orders are 40 boards; the preset's content split keeps 12-20 of them for
    validation alone (its 128 episodes see them all) and demonstrates only the others."""
    _, tokenizer = tiny
    cfg = make_config("bandit-smollm2", overrides=[*SFT[:4], "env.max_new_tokens=8", "sft.episodes=200"])
    assert len(cfg.env.bandit.arm_pairs) == 20 and cfg.sft.noise == 1.0
    data = sft_data(cfg, tokenizer, log=lambda *_: None)
    train, val = {c.problem for c in data.train}, {c.problem for c in data.val}
    assert 12 <= len(val) <= 20 and len(train) + len(val) == 40 and not train & val


def test_the_sokoban_smollm2_preset_demonstrates_only_rooms_it_never_validates_on(tiny):
    """RAGEN's CoordSokoban on SmolLM2: 6x6 rooms with one box, every turn's grid and coordinates; the solver's
    demonstrations (a quarter of the moves random) leave out every room of the 64 validation rooms."""
    _, tokenizer = tiny
    cfg = make_config("sokoban-smollm2", overrides=["sft.episodes=100", "log.progress=false"])
    assert (cfg.env.name, cfg.env.sokoban.observation_format, cfg.sft.noise) == ("sokoban", "grid_coord", 0.25)
    assert list(cfg.env.sokoban.dim_room) == [6, 6] and cfg.env.sokoban.num_boxes == 1
    data = sft_data(cfg, tokenizer, log=lambda *_: None)
    val = {c.problem for c in data.val}
    assert len(val) == 64 and 80 <= len(data.train) <= 100
    assert not {c.problem for c in data.train} & val


def test_a_conversation_set_in_trls_format_is_read_and_bad_rows_are_named(tiny, tmp_path):
    _, tokenizer = tiny
    (tmp_path / "x.jsonl").write_text('{"prompt": "Say 1."}\n')
    source = f"env.prompts.source={tmp_path / 'x.jsonl'}"
    prompts = make_config(None, None, ["env.name=prompts", "env.max_turns=1", source, "env.reward_funcs=[json:dumps]"])
    with pytest.raises(ConfigError, match="env 'prompts' has no solver to demonstrate; give conversations with sft"):
        sft_data(prompts, tokenizer)
    good = tmp_path / "chats.jsonl"
    good.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"messages": CHAT[:3]}) + "\n")
    convs = read_conversations(str(good), tokenizer)
    assert [sum(c.trained) for c in convs][1] < sum(convs[0].trained)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl, line 2: no `messages` column .* it has prompt"):
        read_conversations(str(bad), tokenizer)
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="line 1: no assistant message"):
        read_conversations(str(bad), tokenizer)


def test_steps_follow_a_seeded_order_per_epoch():
    rows = [[i] for i in range(5)]
    first = [step_rows(rows, 2, 0, s) for s in (1, 2, 3)]
    assert sorted(x for batch in first for row in batch for x in row) == list(range(5))
    assert [len(b) for b in first] == [2, 2, 1]
    assert step_rows(rows, 2, 0, 4) != step_rows(rows, 2, 1, 4) or step_rows(rows, 2, 0, 5) != step_rows(rows, 2, 1, 5)
    assert [step_rows(rows, 2, 0, s) for s in (1, 2, 3)] == first  # a function of (seed, step) alone


def _sft(args: list[str], crash_at: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RLDYN_CRASH_AT", None)
    if crash_at:
        env["RLDYN_CRASH_AT"] = crash_at
    return subprocess.run([sys.executable, "-m", "rldynamics.cli", "sft", "--preset", "frozenlake-tiny", *args],
                          capture_output=True, text=True, env=env, timeout=600)


def test_a_killed_fine_tuning_resumes_exactly_and_rl_trains_on_its_checkpoint(tiny, tmp_path, capsys):
    """Killed after step 3 (checkpoint at 2), resumed: the weights and rows of the uninterrupted run. Then `rldyn
    train model.path=<checkpoint>/actor` trains from it, starting at the fine-tuned weights."""
    runs = tmp_path / "runs"
    settings_ = [*SFT, "sft.epochs=2", "sft.packing=false", "checkpoint.every=2", "sft.val_every=2",
                 f"log.run_dir={runs}"]
    assert main(["sft", "--preset", "frozenlake-tiny", *settings_, "log.name=whole"]) == 0
    killed = _sft([*settings_, "log.name=killed"], crash_at="sft_step:3")
    assert killed.returncode == -9, killed.stderr
    assert main(["sft", "log.name=killed", "checkpoint.resume=latest",
                 f"log.run_dir={runs}", "log.progress=false"]) == 0
    whole, resumed = (sorted((runs / n / "checkpoints").iterdir())[-1] for n in ("whole", "killed"))
    assert whole.name == resumed.name
    a, b = (load_file(c / "actor" / "model.safetensors") for c in (whole, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [[json.loads(line) for line in (runs / n / "metrics.jsonl").read_text().splitlines()]
            for n in ("whole", "killed")]
    untimed = [[{k: v for k, v in r.items() if not k.startswith("timing_s/")} for r in run] for run in rows]
    assert untimed[0] == untimed[1]
    assert rows[0][-1]["sft/val_loss"] < rows[0][0]["sft/val_loss"]
    with pytest.raises(CheckpointError, match="a checkpoint of `rldyn sft`, which `rldyn train` does not continue"):
        verify_checkpoint(whole)
    capsys.readouterr()
    assert main(["eval", str(whole), "val.env_groups=2", "log.progress=false"]) == 0
    assert "eval of" in capsys.readouterr().out
    actor = whole / "actor"
    assert main(["train", "--preset", "frozenlake-tiny", f"model.path={actor}", "train.steps=1", "train.env_groups=2",
                 "train.group_size=2", "val.env_groups=2", "val.before_train=false", "env.max_turns=2",
                 "env.max_new_tokens=8", "log.progress=false", "log.report=false", f"log.run_dir={runs}",
                 "log.name=rl", "model.threads=1"]) == 0
    assert (runs / "rl" / "checkpoints" / "step_1" / "actor" / "model.safetensors").is_file()


def test_packing_is_refused_on_a_model_that_attends_across_conversations(tiny):
    """With a cache, transformers builds a plain causal mask whatever the position ids say: the check sees it."""
    model, tokenizer = tiny
    cfg = make_config("frozenlake-tiny", overrides=SFT)
    convs = demonstrations(cfg, tokenizer, [1, 2], 0.0, 0)

    class CachedForward(torch.nn.Module):
        def forward(self, **kwargs):
            return model(**{**kwargs, "use_cache": True})

    with pytest.raises(ConfigError, match="attends across packed conversations .* set sft.packing=false"):
        check_packing(CachedForward(), convs)


def test_a_lora_fine_tuning_writes_the_merged_model_rl_starts_from(tiny, tmp_path):
    runs = tmp_path / "runs"
    assert main(["sft", "--preset", "frozenlake-tiny", *SFT, "sft.episodes=4", "sft.success=false", "model.lora.rank=4",
                 "checkpoint.save_merged=true", f"log.run_dir={runs}", "log.name=lora"]) == 0
    (checkpoint,) = (runs / "lora" / "checkpoints").iterdir()
    assert (checkpoint / "actor" / "adapter_config.json").is_file()
    merged, _ = load_model_and_tokenizer(str(checkpoint / "actor_merged"))
    base, _ = tiny
    changed = [n for n, p in merged.named_parameters() if not torch.equal(p, dict(base.named_parameters())[n])]
    assert changed and all("proj" in n for n in changed)  # the adapted linear layers, nothing else


@pytest.mark.slow
def test_on_smollm2_the_assistant_tokens_and_packing_hold(smollm2_dir):
    """SmolLM2's own template (a default system prompt, `<|im_end|>` closings) and its Llama attention."""
    model, tokenizer = load_model_and_tokenizer(smollm2_dir)
    conv = from_messages(tokenizer, CHAT, "test")
    trained = tokenizer.decode([t for t, m in zip(conv.ids, conv.trained, strict=True) if m])
    assert trained == "<answer>Left</answer><|im_end|>\n<answer>Down</answer><|im_end|>\n"
    cfg = make_config("frozenlake-tiny", overrides=[*SFT, "model.path=smollm2"])
    convs = demonstrations(cfg, tokenizer, [3, 4, 5], 0.3, 0)
    with torch.no_grad():
        packed, tokens, _ = nll_sum(model, rows_of(convs, True, 4000), tokenizer.pad_token_id, True)
        padded, _, _ = nll_sum(model, rows_of(convs, False, 4000), tokenizer.pad_token_id, False)
    assert tokens > 20
    torch.testing.assert_close(packed / tokens, padded / tokens, rtol=1e-4, atol=1e-4)
    check_packing(model, convs)
