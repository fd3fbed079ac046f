"""tformer: the Transformer family — attention, encoder, decoder, encoder-decoder — readable and fast."""

from .attention import Cache, KVCache, MultiHeadAttention, attention
from .checkpoint import load, save
from .config import PRESETS, ModelConfig, preset
from .errors import CheckpointError, ConfigError, DataError, TformerError
from .hf import from_hf, to_hf  # needs only torch + safetensors; transformers is never imported
from .models import Decoder, Encoder, EncoderClassifier, EncoderDecoder, EncoderTokenClassifier

__version__ = "0.1.0"

__all__ = [
    "ModelConfig", "PRESETS", "preset",
    "Encoder", "EncoderClassifier", "EncoderTokenClassifier", "Decoder", "EncoderDecoder",
    "MultiHeadAttention", "KVCache", "Cache", "attention",
    "save", "load", "from_hf", "to_hf",
    "TformerError", "ConfigError", "CheckpointError", "DataError",
]
