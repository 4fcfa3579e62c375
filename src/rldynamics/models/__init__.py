"""Models: load any Hugging Face causal LM + tokenizer, a critic on the same backbone, and the embedded tiny model.

``model.path=tiny`` is resolved by ``resolve_model_path`` to a cached directory built by ``ensure_tiny_model``;
from there on the tiny model loads exactly like a hub checkpoint.
"""

from rldynamics.models.loading import (
    ValueModel,
    load_model_and_tokenizer,
    load_value_model,
    resolve_model_path,
)
from rldynamics.models.tiny import build_tiny_model, build_tiny_tokenizer, ensure_tiny_model

__all__ = [
    "ValueModel",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "ensure_tiny_model",
    "load_model_and_tokenizer",
    "load_value_model",
    "resolve_model_path",
]
