"""ModelConfig: the few numbers and choices that define a Transformer, as plain JSON-able data."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

KINDS = ("encoder", "decoder", "encoder-decoder")
NORM_POSITIONS = ("pre", "post")
POSITIONALS = ("sinusoidal", "learned", "rope", "relative")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu", "swiglu", "geglu")
NORMS = ("layernorm", "rmsnorm")
SINUSOIDAL_LAYOUTS = ("interleaved", "split")


@dataclass
class ModelConfig:
    kind: str = "decoder"              # which family: encoder (BERT), decoder (GPT), encoder-decoder (2017, T5, BART)
    vocab_size: int = 256              # rows of the token embedding = columns of the output layer
    src_vocab_size: int | None = None  # encoder-decoder only: the source vocabulary when it differs from the
                                       # target's (its own encoder embedding); None = one shared vocabulary
    d_model: int = 128                 # D: width of every token vector; blocks keep (B, T, D) in and out
    n_heads: int = 4                   # heads run in parallel, each of size d_model / n_heads
    n_layers: int = 2                  # blocks in the encoder, or in the decoder of a decoder-only model
    n_decoder_layers: int | None = None  # encoder-decoder only: decoder depth (None = n_layers)
    n_decoder_heads: int | None = None   # encoder-decoder only: heads of the decoder's self- and cross-attention
                                         # (None = n_heads); BART/Marian checkpoints may differ per stack
    d_decoder_ff: int | None = None      # encoder-decoder only: the decoder's FFN width (None = d_ff)
    head_size: int | None = None       # size of each head (None = d_model / n_heads); T5 sets its own (d_kv)
    n_kv_heads: int | None = None      # grouped-query attention: K/V heads shared by groups of Q heads (None = n_heads)
    d_ff: int | None = None            # hidden width of the per-token FFN (None = 4 * d_model)
    max_seq_len: int = 256             # longest sequence: sizes learned position tables and the KV cache
    dropout: float = 0.0               # on embeddings, sublayer outputs and the classifier head
    attn_dropout: float | None = None  # on attention weights (None = dropout); 0 lets training use the fused kernel
    ffn_dropout: float = 0.0           # inside the FFN, after the activation (HF's activation_dropout)
    norm_position: str = "pre"         # "post" = 2017 Add & Norm after the residual; "pre" = modern, trains deeper
    positional: str = "learned"        # how order enters: "sinusoidal" (2017), "learned" (GPT-2/BERT), "rope" (Llama),
                                       # "relative" (T5: a learned bias per head and distance bucket on the scores)
    relative_buckets: int = 32         # positional="relative": distance buckets (half per direction in an encoder)
    relative_max_distance: int = 128   # positional="relative": distances beyond this share the last bucket
    activation: str = "gelu"           # FFN non-linearity; "swiglu" (Llama) and "geglu" (T5 v1.1, tanh GELU) are gated
    attention_scale: bool = True       # divide scores by √d_k; T5 does not (its initialisation absorbs the scale)
    norm: str = "layernorm"            # "rmsnorm": no mean subtraction, no bias (Llama)
    norm_eps: float = 1e-5             # HF checkpoints differ (BERT 1e-12, Llama 1e-6); kept exact for parity
    bias: bool = True                  # biases in linear layers and LayerNorm (Llama has none)
    tie_embeddings: bool = True        # output layer reuses the token embedding matrix (GPT-2, BERT, Marian, BART)
    rope_theta: float = 10000.0        # RoPE base frequency
    embed_scale: bool = False          # multiply token embeddings by sqrt(d_model), as the 2017 paper (and Marian) do
    embedding_norm: bool = False       # a norm right after the embeddings (BERT, BART)
    type_vocab_size: int = 0           # BERT's segment (token-type) embeddings; 0 = none
    position_offset: int = 0           # learned positions start at this row (BART reserves 2)
    sinusoidal_layout: str = "interleaved"  # sin/cos on even/odd dims (2017) or first/second half ("split", Marian)
    lm_head_bias: bool = False         # a bias on the output logits (Marian/BART's final_logits_bias)
    output_scale: bool = False         # encoder-decoder: scale the last hidden state by d_model^-0.5 before the
                                       # output layer (T5 v1.0, whose output layer is the tied embedding)
    pad_token_id: int | None = None    # generation pads finished rows with it; encoder-decoder uses it as decoder start
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    decoder_start_token_id: int | None = None  # first decoder input of an encoder-decoder (see decoder_start)

    def __post_init__(self) -> None:
        self.validate()

    # --- derived sizes -------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    @property
    def attention_dropout(self) -> float:
        return self.dropout if self.attn_dropout is None else self.attn_dropout

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def decoder_layers(self) -> int:
        return self.n_decoder_layers if self.n_decoder_layers is not None else self.n_layers

    def decoder_start(self) -> int:
        """The first decoder input of an encoder-decoder, for every caller (generate, trace, HF export):
        decoder_start_token_id, else bos_token_id (HF generate's fallback), else pad_token_id (T5's)."""
        for token in (self.decoder_start_token_id, self.bos_token_id, self.pad_token_id):
            if token is not None:
                return token
        raise ConfigError("the model config has no decoder start token (set decoder_start_token_id, "
                          "bos_token_id or pad_token_id in its config)")

    def stack_config(self, stack: str) -> "ModelConfig":
        """The config one stack is built from: an encoder-decoder's "decoder" gets its own heads, FFN
        width and depth (n_decoder_heads, d_decoder_ff, n_decoder_layers); anything else is self."""
        if stack != "decoder" or self.kind != "encoder-decoder":
            return self
        return dataclasses.replace(self, n_heads=self.n_decoder_heads or self.n_heads,
                                   d_ff=self.d_decoder_ff or self.d_ff,
                                   n_layers=self.decoder_layers, n_decoder_layers=None, n_decoder_heads=None,
                                   d_decoder_ff=None)

    # --- checks --------------------------------------------------------------------------
    def validate(self) -> None:
        def choice(name: str, allowed: tuple[str, ...]) -> None:
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"{name}={value!r} is not allowed; choose one of {', '.join(allowed)}")

        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")

        choice("kind", KINDS)
        choice("norm_position", NORM_POSITIONS)
        choice("positional", POSITIONALS)
        choice("activation", ACTIVATIONS)
        choice("norm", NORMS)
        choice("sinusoidal_layout", SINUSOIDAL_LAYOUTS)
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "max_seq_len", "relative_buckets",
                     "relative_max_distance"):
            positive(name)
        for name in ("src_vocab_size", "n_decoder_layers", "n_decoder_heads", "d_decoder_ff", "n_kv_heads", "d_ff",
                     "head_size"):
            if getattr(self, name) is not None:
                positive(name)
        for heads_field in ("n_heads", "n_decoder_heads"):
            heads = getattr(self, heads_field)
            if heads is None:
                continue
            if self.head_size is None and self.d_model % heads:
                raise ConfigError(
                    f"d_model={self.d_model} must be divisible by {heads_field}={heads} "
                    f"(each head gets d_model / n_heads dimensions, unless head_size is set)")
            if self.n_kv_heads is not None and heads % self.n_kv_heads:
                raise ConfigError(f"{heads_field}={heads} must be divisible by n_kv_heads={self.n_kv_heads}")
            head = self.head_size or self.d_model // heads
            if self.positional == "rope" and head % 2:
                raise ConfigError(f"positional='rope' needs an even head size, got {head} ({heads_field}={heads})")
        if self.positional == "relative" and self.relative_buckets < 4:
            raise ConfigError(f"relative_buckets={self.relative_buckets} must be at least 4 (half exact, half "
                              f"log-spaced, per direction)")
        if self.positional == "relative" and self.relative_max_distance <= self.relative_buckets // 2:
            raise ConfigError(f"relative_max_distance={self.relative_max_distance} must exceed relative_buckets / 2 "
                              f"(the distances with a bucket each; the log-spaced buckets cover the rest)")
        if self.positional == "sinusoidal" and self.d_model % 2:
            raise ConfigError(f"positional='sinusoidal' needs an even d_model, got {self.d_model}")
        for name in ("dropout", "attn_dropout", "ffn_dropout"):
            value = getattr(self, name)
            if not (name == "attn_dropout" and value is None) and (not is_number(value) or not 0.0 <= value < 1.0):
                raise ConfigError(f"{name}={value!r} must be a number in [0, 1)")
        for name in ("norm_eps", "rope_theta"):
            if not is_number(getattr(self, name)) or getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a positive number")
        for name in ("bias", "tie_embeddings", "embed_scale", "embedding_norm", "lm_head_bias", "attention_scale",
                     "output_scale"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be true or false")
        for name in ("n_decoder_layers", "n_decoder_heads", "d_decoder_ff", "src_vocab_size"):
            if getattr(self, name) is not None and self.kind != "encoder-decoder":
                raise ConfigError(f"{name} is only used when kind='encoder-decoder'")
        if self.output_scale and self.kind != "encoder-decoder":
            raise ConfigError("output_scale is only used when kind='encoder-decoder'")
        for name in ("type_vocab_size", "position_offset", "pad_token_id", "bos_token_id", "eos_token_id",
                     "decoder_start_token_id"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ConfigError(f"{name}={value!r} must be an integer >= 0")

    # --- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"a model config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(unknown)}")
        try:
            return cls(**data)
        except TypeError as e:
            raise ConfigError(f"invalid config: {e}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config is not valid JSON ({e})") from None
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Presets: plain data. `tiny` is for tests; the others have the shapes of well-known models.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=64, n_heads=4, n_layers=2, d_ff=256, max_seq_len=128),
    # The default for `tformer train`: sized for a few minutes of CPU training on Shakespeare.
    "small": dict(d_model=256, n_heads=4, n_layers=4, d_ff=1024, max_seq_len=128),
    # The demo's (`tformer train` on hamlet): a quarter of small's compute per token, so four times the
    # steps in a few minutes of an fp32 CPU; Llama-shaped (rotary positions, which learn order from less
    # data than a table; RMSNorm; SwiGLU at 2.75 x width; no biases), so `tformer export-hf` writes a Llama.
    "mini": dict(d_model=128, n_heads=4, n_layers=4, d_ff=352, max_seq_len=128, positional="rope", norm="rmsnorm",
                 activation="swiglu", bias=False),
    # The Bible translator's (`tformer train --task translate --data bible-en-es`): 3 + 3 layers of width 256,
    # the 2017 block (post-norm, sinusoidal positions added to embeddings x sqrt(d_model)) with a SwiGLU
    # feed-forward: per step it learns more than HF's Marian of the same size; rotary positions or pre-norm
    # made the same block learn less (BENCHMARKS.md, "At equal steps").
    "nmt-mini": dict(kind="encoder-decoder", d_model=256, n_heads=4, n_layers=3, n_decoder_layers=3, d_ff=704,
                     max_seq_len=256, norm_position="post", positional="sinusoidal", embed_scale=True,
                     activation="swiglu", dropout=0.0),
    "gpt2-small": dict(kind="decoder", vocab_size=50257, d_model=768, n_heads=12, n_layers=12, d_ff=3072,
                       max_seq_len=1024, norm_position="pre", positional="learned", activation="gelu_tanh"),
    "bert-base": dict(kind="encoder", vocab_size=30522, d_model=768, n_heads=12, n_layers=12, d_ff=3072,
                      max_seq_len=512, norm_position="post", positional="learned", activation="gelu",
                      norm_eps=1e-12, embedding_norm=True, type_vocab_size=2),
    "transformer-base": dict(kind="encoder-decoder", vocab_size=37000, d_model=512, n_heads=8, n_layers=6,
                             d_ff=2048, max_seq_len=512, dropout=0.1, norm_position="post",
                             positional="sinusoidal", activation="relu", embed_scale=True),
    # T5 (v1.0) and Flan-T5 / T5 v1.1 small: pre-RMS-norm, no biases, relative position bias, unscaled scores.
    "t5-small": dict(kind="encoder-decoder", vocab_size=32128, d_model=512, n_heads=8, head_size=64, n_layers=6,
                     d_ff=2048, max_seq_len=512, dropout=0.1, ffn_dropout=0.1, norm_position="pre",
                     positional="relative", activation="relu", norm="rmsnorm", norm_eps=1e-6, bias=False,
                     attention_scale=False, output_scale=True),
    "flan-t5-small": dict(kind="encoder-decoder", vocab_size=32128, d_model=512, n_heads=6, head_size=64,
                          n_layers=8, d_ff=1024, max_seq_len=512, dropout=0.1, ffn_dropout=0.1, norm_position="pre",
                          positional="relative", activation="geglu", norm="rmsnorm", norm_eps=1e-6, bias=False,
                          attention_scale=False, tie_embeddings=False),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A ModelConfig from a named preset, with fields overridden by keyword."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})
