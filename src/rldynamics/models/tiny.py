"""The embedded default model (``model.path=tiny``): a byte-level BPE tokenizer and a small Qwen2.

Design choices:

- Nothing is downloaded. The tokenizer is trained with the ``tokenizers`` library on a corpus the
  caller supplies (the environments' texts), and the model is a randomly initialised
  ``Qwen2ForCausalLM``, so the whole stack (chat template, generation, ``from_pretrained``) is the
  same code path a hub model takes.
- Byte-level BPE with the full 256-byte initial alphabet: every string encodes without UNK and
  decodes back exactly. Pre-tokenisation isolates every digit, every symbol and every capital letter
  that does not start a word, so a grid cell (``#``, ``_``, ``O``, ``X``, ``√``, ``P``, ``S``) and a
  coordinate digit each cost one token and a grid row tokenises cell by cell.
- ``<|endoftext|>`` (pad), ``<|im_start|>`` and ``<|im_end|>`` (eos of a chat turn) are special;
  ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` and ``||`` are added *non-special* single
  tokens, so they survive ``decode(..., skip_special_tokens=True)`` and reward parsing sees them.
- Everything is deterministic: the same corpus gives the same vocabulary and merges (BPE ties are
  broken by token order, not hash order), and a seed gives the same weights: parameters are drawn
  from a local ``torch.Generator`` (not the global RNG, which is left as it was).
- ``ensure_tiny_model`` caches the built model under a key of (builder version, model kwargs,
  corpus hash) and publishes it with one atomic directory rename, so concurrent runs either see a
  complete directory or none.
- The saved tokenizer gives the same ids through bare ``AutoTokenizer.from_pretrained``. transformers 5
  maps ``model_type=qwen2`` to ``Qwen2Tokenizer``, which would replace the saved pre-tokeniser with Qwen's
  regex and add NFC normalisation (other ids, broken round-trips); the tokenizer config's ``auto_map``
  (``TINY_AUTO_MAP``) skips that mapping, and ``save_tokenizer`` writes the small class it names
  (``tokenization_rldyn_tiny.py``) beside it, for loads with ``trust_remote_code=True``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

# Bump when the tokenizer or model construction changes: old cache entries are then ignored.
BUILDER_VERSION = "tiny-v3"

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
ADDED_TOKENS = ["<think>", "</think>", "<answer>", "</answer>", "||"]

# GPT-2-like split, except: a coordinate pair "(r, c)" of single digits is one piece (BPE then learns one
# token per grid cell, so a cell's position is a single embedding), a capital letter only joins the
# lower-case letters after it (so "OX" in a grid is two pieces but "Player" is one), and other digits
# and symbols are always single pieces.
PRETOKENIZE_PATTERN = (
    r" ?\(\p{N}, \p{N}\)"
    r"|'(?:[sdmt]|ll|ve|re)"
    r"| ?\p{Lu}?[\p{Ll}\p{Lm}\p{Lo}\p{Lt}]+"
    r"| ?\p{L}"
    r"| ?\p{N}"
    r"| ?[^\s\p{L}\p{N}]"
    r"|\s+(?!\S)|\s+"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MARKER_FILE = "rldyn_tiny.json"

# transformers 5 rebuilds a qwen2 checkpoint's tokenizer as Qwen2Tokenizer (Qwen's pre-tokeniser) unless the
# tokenizer config has an `auto_map` entry for AutoTokenizer (models/auto/tokenization_auto.py): then it loads the
# declared TokenizersBackend from tokenizer.json as saved (or, with trust_remote_code, the class named here).
TOKENIZER_CODE = Path(__file__).with_name("tokenization_rldyn_tiny.py")
TINY_AUTO_MAP = {"AutoTokenizer": [None, f"{TOKENIZER_CODE.stem}.RldynTinyTokenizer"]}


def build_tiny_tokenizer(corpus: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a deterministic byte-level BPE tokenizer on ``corpus`` and wrap it for ``transformers``.

    Args:
        corpus: training texts; any iterable of strings (may be empty: the tokenizer is then bytes only).
        vocab_size: target size of the BPE vocabulary including the 3 special tokens; the 5 added
            tokens come on top, so ``len(tokenizer)`` is at most ``vocab_size + 5``.

    Returns:
        A fast tokenizer with eos ``<|im_end|>``, pad ``<|endoftext|>``, left padding and a ChatML
        chat template.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} (bytes + special), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START],
        padding_side="left",
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
        auto_map=TINY_AUTO_MAP,
    )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    max_position_embeddings: int = 2048,
    tie_embeddings: bool = True,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """Build a randomly initialised small Qwen2 causal LM whose vocabulary matches ``tokenizer``.

    Embeddings are tied to the LM head unless ``tie_embeddings=False``. Initialisation is seeded inside a
    forked RNG, so the same arguments give bit-identical weights and the caller's global torch RNG is left as
    it was.
    """
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_embeddings,
        bos_token_id=pad_id,  # as in Qwen2: no separate BOS, <|endoftext|> fills the role
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # transformers' own init draws from the global RNG; undo it
        model = Qwen2ForCausalLM(config)
    _init_weights(model, seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = pad_id
    return model.eval()


def _init_weights(model: Qwen2ForCausalLM, seed: int) -> None:
    """Re-initialise every parameter from a local generator, in ``named_parameters`` order.

    Same scheme as transformers' Qwen2 init (matrices ~ N(0, initializer_range), biases 0, norms 1,
    pad embedding row 0), but independent of the global RNG, so concurrent threads cannot perturb it.
    """
    generator = torch.Generator().manual_seed(seed)
    std = model.config.initializer_range
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied lm_head is the embedding: visited once
            if param.dim() >= 2:
                param.normal_(0.0, std, generator=generator)
            elif "norm" in name:
                param.fill_(1.0)
            else:
                param.zero_()
        pad_id = model.config.pad_token_id
        if pad_id is not None:
            model.get_input_embeddings().weight[pad_id].zero_()


def corpus_hash(corpus: Iterable[str]) -> str:
    """SHA-256 of the corpus texts, length-prefixed so that text boundaries count."""
    digest = hashlib.sha256()
    for text in corpus:
        data = text.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def default_cache_dir() -> Path:
    """``$RLDYN_CACHE`` if set, else ``~/.cache/rldynamics``."""
    env = os.environ.get("RLDYN_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "rldynamics"


def ensure_tiny_model(
    corpus_fn: Callable[[], Iterable[str]],
    cache_dir: str | Path | None = None,
    *,
    vocab_size: int = 512,
    **model_kwargs: int,
) -> Path:
    """Return the directory of the tiny model for this corpus, building and caching it if needed.

    Args:
        corpus_fn: returns the tokenizer's training texts; it is called every time (its hash is part
            of the cache key), so it should be cheap.
        cache_dir: cache root; defaults to ``default_cache_dir()``. Entries go to ``<root>/tiny/<key>``.
        vocab_size: passed to ``build_tiny_tokenizer``.
        **model_kwargs: passed to ``build_tiny_model`` (``hidden_size``, ``num_layers``, ``seed``, ...).

    Returns:
        A directory holding ``save_pretrained`` output of both tokenizer and model (safetensors),
        loadable with ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained``.
    """
    corpus = list(corpus_fn())
    spec = {"builder": BUILDER_VERSION, "vocab_size": vocab_size, "model": model_kwargs, "corpus": corpus_hash(corpus)}
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / "tiny" / key
    if (final / MARKER_FILE).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=final.parent))
    try:
        tokenizer = build_tiny_tokenizer(corpus, vocab_size=vocab_size)
        build_tiny_model(tokenizer, **model_kwargs).save_pretrained(tmp)
        save_tokenizer(tokenizer, tmp)
        (tmp / MARKER_FILE).write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def save_tokenizer(tokenizer, directory: str | Path) -> None:
    """``tokenizer.save_pretrained(directory)``, plus the class file that a tiny tokenizer's ``auto_map`` names."""
    tokenizer.save_pretrained(directory)
    if tokenizer.init_kwargs.get("auto_map") == TINY_AUTO_MAP:
        shutil.copyfile(TOKENIZER_CODE, Path(directory) / TOKENIZER_CODE.name)


def is_tiny_model(path: str | Path) -> bool:
    """Whether `path` is the embedded tiny model: `tiny`, or a directory saved from it (the built
    model, its warm start, a checkpoint's actor or LoRA adapter), known by the tokenizer class its
    tokenizer config names (`TINY_AUTO_MAP`, which `save_tokenizer` writes into each)."""
    if str(path) == "tiny":
        return True
    file = Path(path).expanduser() / "tokenizer_config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    tokenizer = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
    return tokenizer == TINY_AUTO_MAP["AutoTokenizer"]


def _publish(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final`` atomically; if a concurrent builder got there first, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError as err:
        if not (final / MARKER_FILE).is_file():
            raise FileExistsError(f"{final} exists but is not a complete tiny-model cache entry; remove it") from err
