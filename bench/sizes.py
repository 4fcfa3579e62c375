"""Model sizes the benchmarks run at: the embedded tiny model, or a seeded random Qwen2 with its tokenizer.

Random weights are fine for timing: the work per token depends on the shapes, not on the values.
"""

from __future__ import annotations

from pathlib import Path

SIZES = {  # name -> (hidden, layers); (None, None) = the embedded tiny model of the default preset
    "tiny": (None, None),
    "h256": (256, 4),
    "h512": (512, 8),
}


def model_dir(size: str, root: Path) -> str:
    """The weights of a size: the tiny model's cached directory, or a fresh seeded Qwen2 saved under `root`."""
    from rldynamics.config import make_config
    from rldynamics.models.loading import load_model_and_tokenizer
    from rldynamics.models.tiny import build_tiny_model, save_tokenizer
    from rldynamics.train.setup import base_model_path

    if size not in SIZES:
        raise SystemExit(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
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
