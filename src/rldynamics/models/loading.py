"""Load any Hugging Face causal LM + tokenizer, and a critic built on the same backbone.

Design choices:

- Everything goes through ``from_pretrained`` so a hub name, a local directory, a tiny model from
  ``models.tiny`` and a trainer checkpoint all take one code path. ``"tiny"`` is resolved to a
  directory by ``resolve_model_path`` before loading; the loaders never build models themselves.
- Tokenizers are set up for batched RL generation: left padding, and pad = eos when the tokenizer
  has no pad token.
- A directory whose ``tokenizer_config.json`` declares the generic backend (``TokenizersBackend`` /
  ``PreTrainedTokenizerFast``) gets its ``tokenizer.json`` loaded verbatim. transformers 5 would
  otherwise rebuild a ``qwen2`` tokenizer with Qwen's hard-coded pipeline, which silently changes
  the ids of the tiny tokenizer and of checkpoints saved from it.
- The critic is ``ValueModel``: the base transformer (no LM head) plus a ``Linear(hidden, 1)`` head
  kept in float32 and zero-initialised, so a fresh critic predicts 0 everywhere, deterministically.
  It saves as ``save_pretrained`` output of the backbone plus ``value_head.safetensors``; loading
  never unpickles.
"""

from __future__ import annotations

import json
import math
import os
import socket
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from rldynamics.models.attention import attend_grouped
from rldynamics.models.gguf import ensure_gguf_model, is_gguf_source
from rldynamics.models.lora import ADAPTER_CONFIG
from rldynamics.models.precision import float32_region
from rldynamics.models.tiny import CHATML_TEMPLATE, ensure_tiny_model

DTYPES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": "auto",
}
VALUE_HEAD_FILE = "value_head.safetensors"
GENERIC_TOKENIZER_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def resolve_model_path(path: str, corpus_fn: Callable[[], Iterable[str]], cache_dir: str | Path | None = None) -> str:
    """Map ``"tiny"`` to the cached embedded model directory (building it if needed) and ``smollm2`` or a ``.gguf``
    file to its converted directory (``models.gguf``); return others unchanged."""
    if path == "tiny":
        return str(ensure_tiny_model(corpus_fn, cache_dir))
    if is_gguf_source(path):
        return str(ensure_gguf_model(path, cache_dir))
    return path


def parameter_count(directory: str | Path) -> int | None:
    """Parameters a model directory's safetensors files hold, read from their headers (no weights loaded); None where
    the directory has none."""
    files = sorted(Path(directory).glob("*.safetensors")) if Path(directory).is_dir() else []
    total = 0
    for file in files:
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))  # 8-byte length, then a JSON header
        total += sum(math.prod(entry["shape"]) for key, entry in header.items() if key != "__metadata__")
    return total if files else None


def load_model_and_tokenizer(
    path: str, *, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False,
    chat_template: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a local directory or a hub name.

    Args:
        path: local directory or hub model id (``"tiny"`` must be resolved first, see ``resolve_model_path``).
        dtype: one of ``float32``, ``bfloat16``, ``float16``, ``auto`` (the checkpoint's dtype).
        device: torch device the model is moved to.
        trust_remote_code: forwarded to ``from_pretrained``.
        chat_template: ``None`` keeps the tokenizer's own template; ``"chatml"`` sets a plain ChatML template;
            anything else is the path of a Jinja template file.

    Returns:
        ``(model, tokenizer)``; the model is in eval mode (with grouped key/value heads under SDPA, attending with
        ``attention.GQA_SDPA``), the tokenizer pads on the left and has a pad token.

    Raises:
        ValueError: unknown ``dtype``. FileNotFoundError / OSError: the model cannot be found.
    """
    torch_dtype = _parse_dtype(dtype)
    _check_source(path)
    with _named_if_missing(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code, chat_template=chat_template)
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return attend_grouped(model.to(device)).eval(), tokenizer


def load_tokenizer(path: str, *, trust_remote_code: bool = False,
                   chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer `load_model_and_tokenizer` gives with the model (left padding, a pad token, `chat_template`
    applied), alone."""
    with _named_if_missing(path):
        tokenizer = _load_tokenizer(path, trust_remote_code=trust_remote_code)
    _prepare_tokenizer(tokenizer, path)
    if chat_template is not None:
        tokenizer.chat_template = _read_chat_template(chat_template)
    return tokenizer


def load_value_model(
    path: str, *, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False
) -> ValueModel:
    """Load a critic from ``path``: a causal-LM checkpoint (fresh zero head) or a saved ``ValueModel``.

    Args mirror ``load_model_and_tokenizer``. The value head is loaded from ``value_head.safetensors``
    when the directory has one, and stays float32 whatever ``dtype`` the backbone gets. A backbone with grouped
    key/value heads under SDPA attends with ``attention.GQA_SDPA``, as the actor does.
    """
    return ValueModel.from_pretrained(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code)


class ValueModel(nn.Module):
    """Critic: a base transformer and a scalar head, mapping token ids [N, T] to values [N, T]."""

    def __init__(self, backbone: PreTrainedModel, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1, dtype=torch.float32, device=backbone.device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @property
    def config(self) -> PretrainedConfig:
        """The backbone's config (hidden size, vocab, ...)."""
        return self.backbone.config

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return the value of every position: [N, T] float32 (pad positions hold garbage; mask them)."""
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        hidden = out.last_hidden_state  # [N, T, H]
        with float32_region(self):  # the head stays float32 under mixed precision
            return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).clone()  # [N, T] (not a view: FSDP2 hooks)

    def save_pretrained(self, save_directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write the backbone with ``save_pretrained`` (safetensors) and the head to ``value_head.safetensors``.

        ``state_dict``: the full weights to write (keys ``backbone.*``, ``head.*``), e.g. gathered from ranks; None
        writes the module's own."""
        save_directory = Path(save_directory)
        state = self.state_dict() if state_dict is None else state_dict
        backbone = {k[len("backbone."):]: v for k, v in state.items() if k.startswith("backbone.")}
        self.backbone.save_pretrained(save_directory, state_dict=backbone if state_dict is not None else None)
        head = {"weight": state["head.weight"].detach().cpu().contiguous(), "bias": state["head.bias"].detach().cpu()}
        save_file(head, str(save_directory / VALUE_HEAD_FILE), metadata={"hidden_size": str(self.head.in_features)})

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False
    ) -> ValueModel:
        """Load the backbone with ``AutoModel.from_pretrained`` and the head from safetensors if present."""
        torch_dtype = _parse_dtype(dtype)
        path = str(path)
        _check_source(path)
        backbone = attend_grouped(AutoModel.from_pretrained(path, dtype=torch_dtype,
                                                            trust_remote_code=trust_remote_code))
        model = cls(backbone, backbone.config.get_text_config().hidden_size)
        head_file = Path(path) / VALUE_HEAD_FILE
        if head_file.is_file():
            model.head.load_state_dict(load_file(str(head_file)))
        return model.to(device)


def _read_chat_template(spec: str) -> str:
    """``chatml`` or the text of a Jinja template file."""
    if spec == "chatml":
        return CHATML_TEMPLATE
    file = Path(spec).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"model.chat_template={spec!r}: no such template file (or use chatml)")
    return file.read_text()


def _parse_dtype(dtype: str) -> torch.dtype | str:
    """Map a dtype name to what ``from_pretrained`` takes; unknown names fail with the allowed list."""
    if dtype not in DTYPES:
        raise ValueError(f"model dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _looks_local(path: str) -> bool:
    """True for strings that can only mean a filesystem path (hub ids are ``name`` or ``org/name``)."""
    return os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1 or "\\" in path


def _check_source(path: str) -> None:
    """Fail early and clearly when ``path`` is meant as a local directory and does not exist, or is a hub id that is
    not in the local cache while the hub cannot be reached (``_hub_unreachable``): ``from_pretrained`` would retry the
    network for about 45 s before failing."""
    if path == "tiny":
        raise ValueError("model path 'tiny' must be resolved to a directory first: use resolve_model_path()")
    local = Path(path).expanduser()
    if (local / ADAPTER_CONFIG).is_file() and not (local / "config.json").is_file():
        raise ValueError(f"model {path!r} is a LoRA adapter, not a whole model: evaluate or probe its checkpoint "
                         "(runs/<run>/checkpoints/step_<N>), or use the merged model a LoRA run writes with "
                         "checkpoint.save_merged=true (<checkpoint>/actor_merged)")
    if local.is_file():
        raise ValueError(f"model {path!r} is a file, not a model directory, a checkpoint or a "
                         ".gguf file; give a directory saved with save_pretrained, "
                         "runs/<run>/checkpoints/step_<N> (rldyn eval) or a .gguf file")
    if local.exists():
        return
    if _looks_local(path):
        raise FileNotFoundError(_not_found_message(path))
    if not _in_hub_cache(path):
        why = _hub_unreachable()
        if why:
            looked = Path(path).expanduser().resolve()
            raise OSError(f"cannot load model {path!r}: no local directory {str(looked)!r}, and the hub id is not in "
                          f"the local cache ({_hub_cache()}) while {why}; download it where there is network access "
                          f"(huggingface-cli download {path}) and copy the cache here, or use model.path=tiny for the "
                          "embedded model, or a directory saved with save_pretrained.")


def _in_hub_cache(repo_id: str) -> bool:
    """True when the local Hugging Face cache holds ``repo_id``'s config.json (no network call)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id (huggingface_hub's HFValidationError)
        return False


def _hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the hub cannot be reached, or None when it may be: offline mode (``HF_HUB_OFFLINE=1``, checked without any
    network call), else one TCP connection to the hub's endpoint within ``timeout`` seconds. Behind an HTTP(S) proxy
    the direct connection says nothing, so the hub is then assumed reachable."""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return "offline mode is on (HF_HUB_OFFLINE=1), so the hub is not asked"
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return None
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError as e:
        return (f"the hub ({url.hostname}:{port}) cannot be reached from here ({e.__class__.__name__}: {e}); "
                "offline? then set HF_HUB_OFFLINE=1")
    return None


@contextmanager
def _named_if_missing(path: str):
    """An OSError raised in the block for a `path` that does not exist locally says what to do
    (`_not_found_message`); one for a local directory passes as it is."""
    try:
        yield
    except OSError as err:
        if Path(path).expanduser().exists():
            raise
        raise OSError(_not_found_message(path) + f" Underlying error: {err}") from err


def _not_found_message(path: str) -> str:
    """Explain what was looked for: the local directory, then the hub (which needs network access)."""
    looked = Path(path).expanduser().resolve()
    return (
        f"cannot load model {path!r}: no local directory {str(looked)!r}, and it was not found as a "
        "Hugging Face hub id in the local cache (downloads from the hub need network access; "
        "use model.path=tiny for the embedded model, or a directory saved with save_pretrained)."
    )


def _load_tokenizer(path: str, *, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    """Load the tokenizer, verbatim from ``tokenizer.json`` when the directory declares the generic backend."""
    config_file = Path(path).expanduser() / "tokenizer_config.json"
    if config_file.is_file():
        declared = json.loads(config_file.read_text()).get("tokenizer_class")
        if declared in GENERIC_TOKENIZER_CLASSES:
            return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def _prepare_tokenizer(tokenizer: PreTrainedTokenizerBase, path: str) -> None:
    """Left padding for batched generation; pad = eos when the tokenizer defines no pad token."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {path!r} has neither a pad nor an eos token; cannot pad batches")
        tokenizer.pad_token = tokenizer.eos_token
