"""The benchmarks' matched-setting code runs on today's package (the benchmarks themselves are not in the suite).

`bench/vs_trl.py` feeds TRL our prompts and scores TRL's completions with our env's turn function; both reach
into the rollout, so a change there must not leave the benchmark broken. TRL itself is not needed here.
`bench/memory_model.py`'s budget is pinned term by term (float32 state, the compute dtype, checkpointing, the probe's
chunks), and the README's memory table must be the one it prints.
"""

import importlib
from pathlib import Path

import pytest

from rldynamics.config import make_config
from rldynamics.models.tiny import build_tiny_model, build_tiny_tokenizer
from rldynamics.train.warmstart import tiny_corpus

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_vs_trl_prompts_tokenise_alike_and_replies_score_as_the_env_says(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    vs_trl = importlib.import_module("vs_trl")
    cfg = make_config()
    tokenizer = build_tiny_tokenizer(tiny_corpus(cfg.env, num_seeds=20))
    model = build_tiny_model(tokenizer)
    rows, ctx, names = vs_trl.sokoban_rows(tokenizer, model, 2, 1)  # raises if TRL's path tokenises differently
    assert [r["seed"] for r in rows] == [cfg.train.seed_base, cfg.train.seed_base + 1]
    assert len({r["prompt"] for r in rows}) == 2

    garbage = tokenizer("no tags here")["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert vs_trl.sokoban_score(ctx, names, rows[0]["seed"], garbage) == cfg.env.format_penalty
    move = tokenizer("<answer>Up</answer>")["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert vs_trl.sokoban_score(ctx, names, rows[0]["seed"], move) != cfg.env.format_penalty


def _memory_model(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("memory_model")


def test_memory_model_keeps_state_float32_and_computes_in_the_compute_dtype(monkeypatch):
    mm = _memory_model(monkeypatch)
    arch = mm.ARCHS["3b"]
    full, mixed = (mm.budget(mm.Setup(arch, dtype=d, world=1, micro_rows=1)) for d in ("float32", "bfloat16"))
    for key in ("weights", "optimizer", "grads", "analysis"):  # float32 whatever the compute dtype
        assert mixed[key] == full[key], key
    assert full["weights"] == 2 * arch.params * 4 and full["optimizer"] == 2 * arch.params * 4
    assert mixed["kv_cache"] == full["kv_cache"] / 2
    # bfloat16: the norms' values and the log-softmax chunk stay float32, the rest halves, autocast casts each
    # projection's input on its own (3h more) and holds a bfloat16 copy of the weights
    tokens, h = 2048, arch.hidden
    layer = (4 * h + 2 * arch.kv + 4 * arch.intermediate) * 4 - (7 * h + 2 * arch.kv + 4 * arch.intermediate) * 2
    logits = tokens * 0.25 * arch.vocab
    assert full["activations"] - mixed["activations"] == pytest.approx(
        tokens * arch.layers * layer + logits * 2 * 2 - 2 * arch.params)


def test_memory_model_checkpointing_keeps_one_block_input_per_layer(monkeypatch):
    mm = _memory_model(monkeypatch)
    arch = mm.ARCHS["0.5b"]
    plain, ckpt = (mm.budget(mm.Setup(arch, dtype="float32", checkpointing=c, micro_rows=2, tokens=1024))
                   for c in (False, True))
    block = (8 * arch.hidden + 2 * arch.kv + 4 * arch.intermediate) * 4 * 2 * 1024  # one block's saved values
    assert plain["activations"] - ckpt["activations"] == pytest.approx(
        (arch.layers - 1) * block - arch.layers * arch.hidden * 4 * 2 * 1024)


def test_memory_model_chunked_probe_holds_one_chunk(monkeypatch):
    mm = _memory_model(monkeypatch)
    arch = mm.ARCHS["3b"]
    whole, chunked = (mm.budget(mm.Setup(arch, world=1, chunks=c)) for c in (1, 8))
    per_coordinate = (2 * 3 + 1) * 4 + 5  # 2 x 3 term vectors, the term differentiated, the sketch tables
    head = min(4 * 2048 * 0.25 * arch.vocab, mm.CHUNK_ELEMENTS) * 4 * 4  # kept for the other terms (retain_graph)
    assert whole["analysis"] == pytest.approx(arch.params * per_coordinate + head)
    assert chunked["analysis"] == pytest.approx(max(arch.params / 8, arch.vocab * arch.hidden) * per_coordinate + head)
    assert mm.budget(mm.Setup(arch, world=1, chunks=100))["analysis"] == pytest.approx(
        arch.vocab * arch.hidden * per_coordinate + head)  # no chunk is smaller than the embedding


def test_readme_memory_table_is_the_models(monkeypatch):
    mm = _memory_model(monkeypatch)
    readme = (BENCH.parent / "README.md").read_text().splitlines()
    table = mm.table().splitlines()
    start = readme.index(table[0])
    assert readme[start:start + len(table)] == table
