"""tformer: the Transformer family — attention, encoder, decoder, encoder-decoder — readable and fast.

The public names are loaded on first use (PEP 562), so `import tformer.model.config` loads the model
core at most, not checkpoints, Hugging Face conversion or the generation package with it.
"""

from __future__ import annotations

import importlib

# Loaded now, not lazily: `tformer.attention` is the function (the formula) and MultiHeadAttention the
# module; both are model core, and load the KV cache's module with them.
from .model.attention import MultiHeadAttention, attention
from .model.kv_cache import Cache, KVCache

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "ModelConfig": "model.config", "PRESETS": "model.config", "preset": "model.config",
    "Encoder": "model.models", "Decoder": "model.models", "EncoderDecoder": "model.models",
    "EncoderClassifier": "model.heads", "EncoderTokenClassifier": "model.heads",
    "save": "checkpoints.format", "load": "checkpoints.format",
    "from_hf": "checkpoints.hf", "to_hf": "checkpoints.hf",  # torch + safetensors; never imports transformers
    "from_gguf": "checkpoints.gguf", "to_gguf": "checkpoints.gguf",  # llama.cpp's format; the gguf package
    "TformerError": "errors", "ConfigError": "errors", "CheckpointError": "errors", "DataError": "errors",
}

__all__ = ["MultiHeadAttention", "KVCache", "Cache", "attention", *_EXPORTS]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tformer' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
