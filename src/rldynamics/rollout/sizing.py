"""The memory of one CPU rank that trains beside its own vLLM engine, estimated before a run: `--nproc auto` starts
two such ranks only where the machine's available memory holds both (`cli._auto_nproc`).

A rank's peak: per parameter, float32 weights, gradients and AdamW's two moments (16 bytes), the compute-dtype copy
and the health monitor's copy before a step (up to 8), the engine's weights (up to 4); the engine's KV cache; 1 GiB
for the libraries; and, per token a micro-batch forwards (each distinct prompt once, then the rest of each row), per
layer and hidden unit, its activations, the update's casts and buffers and its replies' logits, fitted to whole runs
of SmolLM2-135M with the vLLM engine in bfloat16 (Intel Xeon Sapphire Rapids; rows from `trajectory_tokens`, the
longest of env seeds 0-15):

| preset | micro-batch | tokens forwarded | measured peak | estimate |
|---|---|---:|---:|---:|
| `math-smollm2` | 16 rows of up to 151, 2 prompts | 1,212 | 6.26 GiB | 8.0 GiB |
| `sokoban-smollm2` | 4 rows of up to 918, 1 prompt | 2,925 | 10.0-10.3 GiB | 11.5 GiB |
| `frozenlake-smollm2` (base model) | 8 rows of up to 979, 1 prompt | 5,942 | 15.6 GiB | 17.8 GiB |

A reference model adds its float32 weights and their compute-dtype copy, a critic its weights, gradients, AdamW
moments and copies (its activations come at another time than the actor's); the gradient analysis adds what this
does not count.
"""

from __future__ import annotations

import math

from rldynamics.config import Config

RANK_BYTES_PER_PARAMETER = 28
RANK_RUNTIME_BYTES = 2**30
RANK_ACTIVATION_BYTES = 128  # per token a micro-batch forwards, per layer and hidden unit (the table above)
RANK_REFERENCE_BYTES_PER_PARAMETER = 6  # a frozen reference model: float32 weights and the compute-dtype copy
RANK_CRITIC_BYTES_PER_PARAMETER = 24  # a critic: as the actor's 28 without an engine's weights
RANK_MEMORY_HEADROOM = 1.25  # `--nproc auto` wants a quarter more than the estimate


def engine_rank_bytes(parameters: int, kv_cache_gib: float, tokens: int = 0, width: int = 0) -> int:
    """Estimated peak resident memory of one rank training a model of `parameters` beside its own engine, with
    micro-batches that forward `tokens` tokens through `width` (layers x hidden size)."""
    return (parameters * RANK_BYTES_PER_PARAMETER + int(kv_cache_gib * 2**30) + RANK_RUNTIME_BYTES
            + tokens * width * RANK_ACTIVATION_BYTES)


def micro_batch_tokens(rows: int, group_size: int, prompt: int, whole: int, shared_prefix: bool) -> int:
    """Tokens a micro-batch of `rows` rows of `whole` tokens forwards: with a shared prefix, the `prompt` tokens of
    each group it holds (its rows are kept together) once and the rest of every row; else every row whole."""
    if not shared_prefix:
        return rows * whole
    return math.ceil(rows / group_size) * prompt + rows * (whole - prompt)


def engine_rank_memory(cfg: Config, reference: bool = False) -> int | None:
    """`engine_rank_bytes` for the run: its model (`model.path`; a GGUF source is counted in its converted directory,
    converted here if no run has yet; the embedded tiny model has nothing to speak of), its KV cache, its
    micro-batches of rows as long as `rollout.agent.trajectory_tokens` estimates, a `reference` model (the caller
    knows whether the run loads one: `train.diagnostics.needs_reference`) and a critic (`algo.has_critic`). None
    where the model cannot be read before loading (a hub name: nothing local to read)."""
    from transformers import AutoConfig

    from rldynamics.models.gguf import ensure_gguf_model, is_gguf_source
    from rldynamics.models.loading import load_tokenizer, parameter_count
    from rldynamics.rollout.agent import trajectory_tokens

    path, kv = cfg.model.path, cfg.rollout.vllm_kv_cache_gib
    if path == "tiny":
        return engine_rank_bytes(0, kv)
    try:
        directory = str(ensure_gguf_model(path) if is_gguf_source(path) else path)
        parameters = parameter_count(directory)
        if parameters is None:
            return None
        config = AutoConfig.from_pretrained(directory)
        tokenizer = load_tokenizer(directory, chat_template=cfg.model.chat_template)
        prompt, whole = trajectory_tokens(cfg.env, tokenizer)
    except Exception:  # noqa: BLE001 (the run reports a model it cannot load, with its own words)
        return None
    tokens = micro_batch_tokens(cfg.train.micro_batch_size, cfg.train.group_size, prompt, whole,
                                cfg.train.shared_prefix)
    others = (RANK_REFERENCE_BYTES_PER_PARAMETER * reference
              + RANK_CRITIC_BYTES_PER_PARAMETER * cfg.algo.has_critic) * parameters
    return engine_rank_bytes(parameters, kv, tokens, config.num_hidden_layers * config.hidden_size) + others
