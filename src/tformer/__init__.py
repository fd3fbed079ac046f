"""tformer: the Transformer family — attention, encoder, decoder, encoder-decoder — readable and fast.

The public names are loaded on first use (PEP 562), so `import tformer.config` loads the model
core at most, not checkpoints, Hugging Face conversion or the generation package with it.
"""

from __future__ import annotations

import importlib

# Loaded now, not lazily: the submodule `tformer.attention` shares its name with the function, and
# this import is what makes `tformer.attention` the function (as it always was). It is model core,
# and loads the KV cache's module with it.
from .attention import MultiHeadAttention, attention
from .kv_cache import Cache, KVCache

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "ModelConfig": "config", "PRESETS": "config", "preset": "config",
    "Encoder": "models", "Decoder": "models", "EncoderDecoder": "models",
    "EncoderClassifier": "heads", "EncoderTokenClassifier": "heads",
    "save": "checkpoint", "load": "checkpoint",
    "from_hf": "hf", "to_hf": "hf",  # need only torch + safetensors; transformers is never imported
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
