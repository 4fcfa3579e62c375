"""The vLLM rollout engine, colocated in the trainer's process (`rollout.engine=vllm`).

Design choices:
- Token ids in, token ids and their sampling log-probs out (`generate`, the `rollout.engines.RolloutEngine`
  protocol, which `agent.HFEngine` follows too): the rollout loop keeps building prompts turn by turn, and the
  trained tokens are exactly the sampled ones. Each prompt is one vLLM request with the HF path's stop ids
  (`stop_token_ids`, the model's own EOS ignored otherwise), temperature (top-p 1, top-k off) and max new tokens.
- Log-probs are vLLM's `processed_logprobs`: log softmax of the logits after the temperature, the distribution
  actually sampled from, which is what the trainer's old log-probs (`train.temperature` applied) are compared
  with (`algo.rollout_corr`).
- Seeds: each request carries its own seed: the row key (`rollout.sampling.row_key`) with
  `train.row_seeded_sampling`, otherwise a draw from the global torch RNG (seeded by the caller), so a seeded
  rollout is reproducible and a row's tokens do not depend on the other rows.
- Multi-turn: vLLM's prefix caching keeps the KV blocks of every conversation, so a turn encodes only its new
  tokens; nothing is held per trajectory here (`drop` does nothing).
- Weight sync: `sync(model)` loads the trainer's parameters (FSDP2-sharded ones gathered once per sync, one
  all-gather per block, as for the trainer's own no-grad passes), cast to the engine's dtype, into the engine's
  model in place (the worker's `reload_weights` with the parameters as the weights iterator: the model's own
  `load_weights` maps HF names and fuses q/k/v, then the CPU kernels' weight layout is rebuilt), with no disk round
  trip. A tied LM head is
  pointed at the new embedding again and its kernel weights rebuilt (the reload restores the head's old ones);
  then the prefix cache is reset (its blocks hold keys and values of the old weights). The trainer calls it
  after every optimizer step; the engine is built once per run (`rollout.engines.rollout_engine`).
- LoRA adapters: the engine samples the merged weights (`models.lora.merged_weights`: W + scale x B A in new
  tensors, the base's names), all of them at an adapted model's first sync, then only the blocks holding adapters
  (layers sent nothing keep their weights; a block goes whole, since vLLM fuses q/k/v and gate/up). vLLM's own
  LoRA (`enable_lora`) runs on the CPU build but generated 3.5x slower or more than merged weights (docs/vllm.md).
- Compiled (`rollout.vllm_compile`, `compile=True`): vLLM traces the model once (dynamic shapes) and inductor fuses
  the norms and activations, which the CPU build runs as separate torch operations when eager; the graph takes the
  weights as inputs, so a sync is read by the next forward with no recompilation. vLLM's own cache of compiled
  graphs is switched off (`VLLM_USE_AOT_COMPILE=0`: under torch 2.13 it fails to load what it saved); inductor's
  cache keeps later starts short. The engine's first generation (three short prompts) must give finite log-probs:
  a compiled model that does not is rebuilt eager (in one process), an eager one is a ConfigError.
- One process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): the engine's model lives in the trainer's process, as in TRL's
  `vllm_mode="colocate"` and verl's hybrid engine. Under torchrun every rank builds its own engine (tensor parallel
  size 1, vLLM's `external_launcher` on the ranks' process group) and samples its own groups; vLLM makes its groups
  inside ours, and its shutdown destroys them, ours included, so the engine is closed when the process leaves the
  group (`dist.before_leaving`), after the ranks waited for each other.
- AMX: on a CPU with AMX tiles the CPU build's attention uses them, and Linux kills a process that runs one
  without having asked for them first (SIGILL). torch asks at its first bfloat16 matmul; a float32 trainer with a
  bfloat16 engine has run none before the engine's first forward, so the engine asks itself.
- Threads: the CPU build replaces `torch.set_num_threads` by a no-op once it has bound its threads; the engine
  keeps the trainer's thread count (set before it, `model.threads`) and puts the function back.
- Memory on a GPU (`rollout.vllm_sleep`): between rollouts the engine sleeps (vLLM's sleep level 1: weights
  offloaded to host memory, KV cache freed), so the trainer's passes and update have the GPU; `sync` wakes the
  weights, loads the new ones, then wakes the KV cache, and `generate` wakes whatever still sleeps. vLLM has no
  sleep mode on CPU, where it is off.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import weakref

import torch

from rldynamics import dist
from rldynamics.config import ConfigError
from rldynamics.models import lora
from rldynamics.models.sharding import gathered
from rldynamics.rollout.engines import check_installed

# vLLM's messages that say nothing a user can act on -> the logger that writes them, dropped while an engine is built
NOISE = {
    "Attempted to load weight %s with dtype": "vllm.model_executor.models.utils",  # a float32 checkpoint in bfloat16,
    # once per weight
    "CPU backend doesn't allow to use `torch.set_num_threads`": "vllm.v1.worker.cpu_worker",  # inductor compiling
}


def _not_noise(record: logging.LogRecord) -> bool:
    """A logging filter: False for the messages of `NOISE`."""
    return not str(record.msg).startswith(tuple(NOISE))


class VllmEngine:
    """A vLLM `LLM` on the model directory `path`, sampling as the HF engine does and synced from the trainer."""

    def __init__(self, path: str, *, dtype: str = "bfloat16", kv_cache_gib: float = 1.0, seed: int = 0,
                 max_model_len: int | None = None, sleep: bool = False, compile: bool = True):
        check_installed("vllm")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM

        if compile:  # vLLM 0.32's own cache of compiled graphs fails to load under torch 2.13 ("'function' object has
            os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")  # no attribute 'finalize_loading'"); inductor's loads
            if dist.is_main():
                print("vllm engine: compiling the model (rollout.vllm_compile=true): about a minute the first time, "
                      "seconds once cached", flush=True)
        if torch.cpu._is_amx_tile_supported():  # the CPU build's attention runs AMX tiles, which Linux lets a process
            torch.cpu._init_amx()  # use once it asked; torch asks at its first bfloat16 matmul, maybe none yet
        self.sleeps = sleep and torch.cuda.is_available()  # vLLM has no sleep mode on CPU
        self.sleeping: set[str] = set()  # the parts now asleep: "weights", "kv_cache"
        self.adapted: weakref.ref | None = None  # the LoRA model last synced: its next sync sends its adapted blocks
        set_num_threads = torch.set_num_threads
        settings = dict(model=path, dtype=dtype, seed=seed, enable_prefix_caching=True,
                        # whole prefills: the CPU build rewinds a partly prefilled request's seeded generator, which
                        # its CPU generators refuse ("CPU Generator does not use offset")
                        enable_chunked_prefill=False,
                        kv_cache_memory_bytes=int(kv_cache_gib * 2**30), logprobs_mode="processed_logprobs",
                        max_model_len=max_model_len, enable_sleep_mode=self.sleeps, **_launcher())
        try:
            for logger in set(NOISE.values()):  # a filter: vLLM's logging config, applied while the engine is built,
                logging.getLogger(logger).addFilter(_not_noise)  # resets its loggers' levels
            self.llm = LLM(enforce_eager=not compile, **settings)
            atexit.register(self.close)  # before vLLM's own finalizer, which fails on a process group gone by then
            dist.before_leaving(self.close)  # its shutdown destroys the process group: the last thing done in it
            finite = self._samples_finite()  # kernels that refuse the model fail here, not mid-run
            if compile and not finite and not dist.distributed():
                self.close()
                print("vllm engine: the compiled model gave non-finite log-probs on a test prompt (as seen with an "
                      "inductor cache written under another instruction set); running it eager instead "
                      "(rollout.vllm_compile=false)", flush=True)
                self.llm, compile = LLM(enforce_eager=True, **settings), False
                finite = self._samples_finite()
        except Exception as e:  # noqa: BLE001 (vLLM raises plain ValueErrors / RuntimeErrors; name the cause)
            raise ConfigError(_load_error(path, dtype, e, compile)) from e
        finally:
            torch.set_num_threads = set_num_threads  # the CPU build made it a no-op
        if not finite:  # eager, or compiled under torchrun (vLLM's shutdown there destroys the ranks' process group)
            kind, fix = ("compiled", "rollout.vllm_compile=false") if compile else ("eager", "rollout.engine=hf")
            raise ConfigError(f"rollout.engine=vllm: the {kind} model at {path} in {dtype} gives non-finite log-probs "
                              f"on a test prompt (its weights or this machine's kernels); set {fix}")

    def _samples_finite(self) -> bool:
        """Whether the log-probs of a few sampled tokens (three rows of three lengths) are finite: a model whose
        weights or kernels give NaN logits samples garbage."""
        _, logprobs = self.generate([[0], [1] * 6, [2] * 11], 3, 1.0, [], row_keys=[0, 1, 2])
        return all(math.isfinite(v) for row in logprobs for v in row)

    def close(self) -> None:
        """Shut the engine down (idempotent)."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None:
            core.shutdown()
            self.llm.llm_engine.engine_core = None

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, stop_ids: list[int], *,
                 row_keys: list[int] | None = None,
                 cache_keys: list[int] | None = None) -> tuple[list[list[int]], list[list[float]]]:
        """One response per prompt, ending at its first stop id (kept), and the sampler's log-prob of each token."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._wake()
        seeds = row_keys if row_keys is not None else torch.randint(0, 2**31 - 1, (len(prompts),)).tolist()
        params = [SamplingParams(n=1, temperature=temperature, top_p=1.0, top_k=0, max_tokens=max_new_tokens,
                                 stop_token_ids=list(stop_ids), ignore_eos=True, logprobs=0, seed=int(seed),
                                 detokenize=False) for seed in seeds]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                    use_tqdm=False)
        responses, logprobs = [], []
        for out in outputs:
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            responses.append(ids)
            logprobs.append([float(step[token].logprob) for step, token in zip(sample.logprobs, ids, strict=True)])
        return responses, logprobs

    def drop(self, key: int) -> None:
        """Nothing to free: prefix caching keeps (and evicts) conversation blocks by itself."""

    def release(self) -> None:
        """Free the engine's GPU memory until it is next used (`rollout.vllm_sleep` on a GPU; otherwise nothing)."""
        if self.sleeps and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = {"weights", "kv_cache"}

    def _wake(self, parts: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Wake the given parts of a sleeping engine (those asleep; nothing on CPU)."""
        waking = [part for part in parts if part in self.sleeping]
        if waking:
            self.llm.wake_up(tags=waking)
            self.sleeping -= set(waking)

    @torch.no_grad()
    def sync(self, model: torch.nn.Module) -> None:
        """Load `model`'s parameters (an HF causal LM of the engine's architecture) into the engine, in place; with
        LoRA adapters, the merged weights of the adapted blocks (`lora.merged_weights`), the rest being the base's.

        Sharded (FSDP2): the full weights are gathered for the load, on every rank (a collective of all ranks)."""
        self._wake(("weights",))
        # layers sent no weights (a tied head; with adapters, all but the adapted blocks) keep their own, and vLLM
        # warns that it "failed to load" them
        for name in ("layerwise", "inplace"):
            logging.getLogger(f"vllm.model_executor.model_loader.reload.{name}").setLevel(logging.ERROR)
        adapted = lora.is_adapted(model)
        blocks = adapted and self.adapted is not None and self.adapted() is model  # the rest is already its base
        dtype = self.llm.llm_engine.model_config.dtype  # cast here, one tensor at a time: vLLM would cast each
        # float32 weight into its bfloat16 parameter alike (round to nearest)
        with gathered(model):
            weights = (lora.merged_weights(model, adapted_blocks=blocks) if adapted  # base + adapters, new tensors
                       else [(name, p.detach()) for name, p in model.named_parameters()])  # full, even if sharded
            cast = ((name, w.to(dtype)) for name, w in weights)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": cast})
        if getattr(model.config, "tie_word_embeddings", False) and not blocks:
            self.llm.llm_engine.apply_model(_tie_head)  # the reload leaves the head on the old embedding tensor
        self.adapted = weakref.ref(model) if adapted else None
        self._wake(("kv_cache",))
        self.llm.reset_prefix_cache()


def _launcher() -> dict:
    """vLLM's executor settings: in a process group of several ranks (torchrun), `external_launcher`, which joins the
    group and puts this rank's engine on `cuda:LOCAL_RANK`; in one process, its default."""
    return {"distributed_executor_backend": "external_launcher"} if dist.distributed() else {}


def _tie_head(engine_model: torch.nn.Module) -> None:
    """Point the engine's LM head at its (reloaded) input embedding again and rebuild its kernel's weights (the CPU
    build packs a copy for its GEMM)."""
    head = engine_model.lm_head
    head.weight = engine_model.model.embed_tokens.weight
    head.quant_method.process_weights_after_loading(head)


def _load_error(path: str, dtype: str, e: Exception, compile: bool = False) -> str:
    """One line: why vLLM could not serve the model at `path` (compiled with `compile`), and what to do."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [e.__class__.__name__]
    first = next((line for line in lines if "not supported" in line), lines[0])  # pydantic puts the cause 2nd
    first = first.split(". Supported architectures")[0][:300]
    if compile and ("Inductor" in e.__class__.__name__ or "Compiler" in first):
        return (f"rollout.engine=vllm: vLLM could not compile the model at {path} ({e.__class__.__name__}: "
                f"{first[:200]}); rollout.vllm_compile=false runs it eager (compiling needs a C++ compiler: gcc or "
                "clang)")
    if "Unsupported CPU attention" in first:
        return (f"rollout.engine=vllm: vLLM's CPU attention cannot run the model at {path} in {dtype} ({first}); "
                "its head size must be one the CPU kernels have (the tiny model: tiny.hidden_size=128, head "
                "size 32), or use rollout.engine=hf")
    if "KV cache" in first and "max seq len" in first:
        return (f"rollout.engine=vllm: the engine's KV cache is too small for one sequence of the model at {path} "
                f"({first[:200]}); raise rollout.vllm_kv_cache_gib")
    if "not supported" in first or "architecture" in first.lower():
        return (f"rollout.engine=vllm: vLLM cannot run the model at {path} ({first}); use rollout.engine=hf or a "
                "model architecture vLLM supports")
    return f"rollout.engine=vllm: vLLM could not load {path} ({e.__class__.__name__}: {first}); rollout.engine=hf " \
           "generates with the trainer's own model"
