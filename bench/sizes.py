"""Model sizes the benchmarks run at: the embedded tiny model, a seeded random Qwen2 with its tokenizer, or the
real pretrained SmolLM2-135M-Instruct with its own tokenizer and chat template.

Random weights are fine for timing: the work per token depends on the shapes, not on the values (except how long
the replies are: a random model rarely stops before the token limit, SmolLM2 often does).
"""

from __future__ import annotations

from pathlib import Path

SIZES = {  # name -> (hidden, layers); (None, None) = the embedded tiny model of the default preset
    "tiny": (None, None),
    "h256": (256, 4),
    "h512": (512, 8),
    "smollm2": (None, None),  # SmolLM2-135M-Instruct: hidden 576, 30 layers, 49k vocabulary (models/gguf.py)
}


def model_dir(size: str, root: Path) -> str:
    """The weights of a size: the tiny model's cached directory, SmolLM2's converted directory (the one
    `model.path=smollm2` resolves to), or a fresh seeded Qwen2 saved under `root`."""
    from rldynamics.config import make_config
    from rldynamics.models.gguf import SMOLLM2, ensure_gguf_model
    from rldynamics.models.loading import load_model_and_tokenizer
    from rldynamics.models.tiny import build_tiny_model, save_tokenizer
    from rldynamics.train.setup import base_model_path

    if size not in SIZES:
        raise SystemExit(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    if size == SMOLLM2:
        try:
            return str(ensure_gguf_model(SMOLLM2))
        except (FileNotFoundError, ModuleNotFoundError) as err:
            raise SystemExit(f"size {size}: {err}") from None
    tiny = base_model_path(make_config())
    hidden, layers = SIZES[size]
    if hidden is None:
        return tiny
    _, tokenizer = load_model_and_tokenizer(tiny)
    model = build_tiny_model(tokenizer, hidden_size=hidden, num_layers=layers, num_heads=hidden // 64,
                             num_kv_heads=max(1, hidden // 128), intermediate_size=4 * hidden, seed=0)
    path = root / size
    model.save_pretrained(path)
    save_tokenizer(tokenizer, path)  # as every tiny checkpoint is saved (plain AutoTokenizer loads it)
    return str(path)
