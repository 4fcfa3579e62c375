"""The benchmarks' matched-setting code runs on today's package (the benchmarks themselves are not in the suite).

`bench/vs_trl.py` feeds TRL our prompts and scores TRL's completions with our env's turn function; both reach
into the rollout, so a change there must not leave the benchmark broken. TRL itself is not needed here.
"""

import importlib
from pathlib import Path

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
