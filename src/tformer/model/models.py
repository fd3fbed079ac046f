"""The three Transformer families of the seeds, built from the blocks in layers.py.

    Encoder (BERT):            tokens -> embeddings -> N x [self-attention, FFN] -> contextual vectors
    Decoder (GPT):             tokens -> embeddings -> N x [causal self-attention, FFN] -> logits over vocab
    EncoderDecoder (2017, T5): source -> Encoder -> memory; target -> N x [causal self-attn,
                               attention to memory, FFN] -> logits over vocab

An encoder with a task head on top (EncoderClassifier, EncoderTokenClassifier) is in heads.py.
Shapes: B batch, T (target) length, S source length, D d_model, V vocab size.
Models never pick a device or dtype: move them with .to(...) from outside.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ..errors import ConfigError
from .config import ModelConfig
from .embeddings import Embeddings
from .kv_cache import Cache, CrossKVCache, KVCache
from .layers import DecoderLayer, EncoderLayer, make_norm
from .linear import Linear
from .lm_loss import lm_loss
from .masks import Packing, combine, padded, padding_mask, self_attention_mask
from .positional import RelativePositionBias, RotaryEmbedding

if TYPE_CHECKING:
    from ..inference.fused import GPTStep


def default_positions(t: int, offset: int, device) -> Tensor:
    return torch.arange(offset, offset + t, device=device)


def _rotary(cfg: ModelConfig) -> RotaryEmbedding | None:
    return RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta) if cfg.positional == "rope" else None


def _relative_bias(cfg: ModelConfig, bidirectional: bool) -> RelativePositionBias | None:
    if cfg.positional != "relative":
        return None
    return RelativePositionBias(cfg.n_heads, cfg.relative_buckets, cfg.relative_max_distance, bidirectional)


def init_weights(model: nn.Module, n_layers: int, norm_position: str) -> None:
    """N(0, 0.02) weights, zero biases; before pre-norms (GPT-2) the projections into the residual stream /√(2·layers).
    Post-norm (BERT, Marian) normalises the stream after each sublayer: scaling only slowed learning (BENCHMARKS.md)."""
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() >= 2:
            residual = norm_position == "pre" and name.endswith(("out_proj.weight", "down.weight"))
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layers) if residual else 0.02)
    for m in model.modules():
        if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            nn.init.ones_(m.weight)


class Encoder(nn.Module):
    """BERT-style encoder: every token attends to every (non-padding) token.
    forward(input_ids (B, T), attention_mask (B, T) of 1/0) -> hidden states (B, T, D)."""

    kind = "encoder"               # what every caller asks instead of isinstance / hasattr
    is_encoder_decoder = False

    def __init__(self, cfg: ModelConfig, token_embedding: nn.Embedding | None = None):
        super().__init__()
        self.cfg = cfg
        rotary = _rotary(cfg)
        self.embed = Embeddings(cfg, token_embedding)
        self.layers = nn.ModuleList(EncoderLayer(cfg, rotary) for _ in range(cfg.n_layers))
        self.relative_bias = _relative_bias(cfg, bidirectional=True)
        self.norm = make_norm(cfg) if cfg.norm_position == "pre" else nn.Identity()
        if token_embedding is None:
            init_weights(self, cfg.n_layers, cfg.norm_position)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                return_attention: bool = False):
        positions = default_positions(input_ids.size(1), 0, input_ids.device)
        x = self.embed(input_ids, positions, token_type_ids)                    # (B, T, D)
        mask = self_attention_mask(input_ids.size(1), 0, attention_mask, causal=False, device=input_ids.device)
        bias = self.relative_bias(input_ids.size(1), input_ids.size(1)) if self.relative_bias is not None else None
        # Inference on the real tokens only (padding is wasted work; padded positions output 0); unpadded too where
        packing = None                              # tformer's kernel attends (PyTorch's flash kernel is slower)
        if not self.training and not return_attention and (padded(attention_mask) or self.relative_bias is None
                                                            and self.layers[0].attn.whole_texts(x)):
            packing = Packing(attention_mask if attention_mask is not None else torch.ones_like(input_ids))
            x = packing.pack(x)                                                  # (N real tokens, D)
        attentions = []
        for layer in self.layers:
            x, weights = layer(x, mask, positions, need_weights=return_attention, packing=packing,
                               position_bias=bias)
            attentions.append(weights)
        x = self.norm(x)
        if packing is not None:
            x = packing.unpack(x)                                                # (B, T, D)
        elif attention_mask is not None:
            x = x.masked_fill(~attention_mask.bool()[..., None], 0.0)           # the same 0s without packing
        return (x, attentions) if return_attention else x


class DecoderStack(nn.Module):
    """Embeddings -> N decoder layers (causal self-attention, optional cross-attention, FFN) -> final norm."""

    def __init__(self, cfg: ModelConfig, n_layers: int, cross: bool, token_embedding: nn.Embedding | None = None):
        super().__init__()
        rotary = _rotary(cfg)
        self.embed = Embeddings(cfg, token_embedding)
        self.layers = nn.ModuleList(DecoderLayer(cfg, cross, rotary) for _ in range(n_layers))
        self.relative_bias = _relative_bias(cfg, bidirectional=False)
        self.norm = make_norm(cfg) if cfg.norm_position == "pre" else nn.Identity()

    def forward(self, ids: Tensor, attention_mask: Tensor | None = None, positions: Tensor | None = None,
                cache: Cache | None = None, memory: Tensor | None = None, memory_mask: Tensor | None = None,
                return_attention: bool = False):
        """ids: (B, T) new tokens; attention_mask: (B, cached + T) of 1/0 or None; memory: (B, S, D)."""
        t, offset = ids.size(1), cache.length if cache is not None else 0
        if positions is None:
            positions = default_positions(t, offset, ids.device)
        x = self.embed(ids, positions)                                           # (B, T, D)
        mask = self_attention_mask(t, offset, attention_mask, causal=True, device=ids.device)
        # T5's bias uses the cache slots as positions (as transformers does), not `positions`
        bias = self.relative_bias(t, offset + t, offset) if self.relative_bias is not None else None
        if cache is not None and not cache.ragged and mask is bias is memory is None and not return_attention:
            step = self._fused_step()                  # a GPT's decoding step in one kernel call, where it fits
            y = step(x, cache.layers) if step is not None else None
            if y is not None:
                return self.norm(y), [None] * len(self.layers), [None] * len(self.layers)
        self_attn, cross_attn = [], []
        for i, layer in enumerate(self.layers):
            x, weights, cross_weights = layer(
                x, mask, positions,
                cache=cache.layers[i] if cache is not None else None,
                memory=memory, memory_mask=memory_mask,
                cross_cache=cache.cross[i] if cache is not None and cache.cross else None,
                need_weights=return_attention, position_bias=bias)
            self_attn.append(weights)
            cross_attn.append(cross_weights)
        return self.norm(x), self_attn, cross_attn

    def _fused_step(self) -> GPTStep | None:
        """inference.fused.GPTStep for these layers (made once; None where a layer does not fit). The
        fused step sits above the model (it is built from its layers), so it is imported here, on the
        first decoding step: the second of the two upward edges tests/test_architecture.py names."""
        if not hasattr(self, "fused"):
            from ..inference.fused import GPTStep
            self.fused = GPTStep.of(self.layers)
        return self.fused

    def new_cache(self, cfg: ModelConfig, batch_size: int, max_len: int, dtype, device, cross: bool) -> Cache:
        layers = [KVCache(batch_size, cfg.kv_heads, max_len, cfg.head_dim, dtype, device) for _ in self.layers]
        return Cache(layers, [CrossKVCache() for _ in self.layers] if cross else None)


def _floating(module: nn.Module) -> Tensor:
    """`module`'s first floating-point tensor: its weight, or an int8 table's scales (inference/int8_embedding.py)."""
    return next(t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point())


def _cache_dtype(param: Tensor, dtype):
    """The dtype K and V will have: the parameters' dtype, or the autocast dtype when autocast is on."""
    if dtype is not None:
        return dtype
    device_type = param.device.type
    if device_type in ("cpu", "cuda", "xpu", "mps") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return param.dtype                     # also for devices without autocast (meta: shape-only runs)


class GenerationMixin:
    """model.generate(...) / model.stream(...), as in Hugging Face. They forward to
    tformer.generation, imported when first called: generation sits above the model core, which
    never loads it (an import from the model upward; tests/test_architecture.py names it)."""

    def generate(self, input_ids: Tensor, attention_mask: Tensor | None = None, **kwargs) -> Tensor:
        """See tformer.generation.generate (an EncoderDecoder's source mask may also be src_mask=)."""
        from ..generation import generate
        return generate(self, input_ids, attention_mask, **kwargs)

    def stream(self, input_ids: Tensor, attention_mask: Tensor | None = None, **kwargs):
        """Iterator over each step's new tokens (N,); see tformer.generation.stream."""
        from ..generation import stream
        return stream(self, input_ids, attention_mask, **kwargs)


class Decoder(GenerationMixin, nn.Module):
    """GPT-style decoder-only language model. forward(input_ids (B, T)) -> logits (B, T, V);
    the logits at the last position give the distribution of the next token. With labels= (B, T) (each
    position's next token, -100: none) the mean cross-entropy instead (lm_loss.py: no whole logits)."""

    kind = "decoder"
    is_encoder_decoder = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.stack = DecoderStack(cfg, cfg.n_layers, cross=False)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, bias=cfg.lm_head_bias)
        init_weights(self, cfg.n_layers, cfg.norm_position)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.stack.embed.token.weight

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, positions: Tensor | None = None,
                cache: Cache | None = None, return_attention: bool = False, labels: Tensor | None = None):
        hidden, attentions, _ = self.stack(input_ids, attention_mask, positions, cache,
                                           return_attention=return_attention)
        if labels is not None:
            return lm_loss(hidden, self.lm_head, labels)
        logits = self.lm_head(hidden)                                            # (B, T, V)
        return (logits, attentions) if return_attention else logits

    def step(self, ids: Tensor, cache: Cache | None = None, attention_mask: Tensor | None = None,
             positions: Tensor | None = None, memory: Tensor | None = None, src_mask: Tensor | None = None,
             all_logits: bool = False, head: bool = True) -> Tensor:
        """The one entry point for callers that decode (generation, the server, the tracer): feed the
        new tokens `ids` (B, T) at `positions` (B, T) or (T,) (default: after the cache's contents),
        with `attention_mask` (B, cached + T) of 1/0 over every key position (None: no padding), and
        get the next-token logits of the last position (B, V), or of every position (B, T, V) with
        all_logits=True. Their keys and values join `cache` (from new_cache). `memory` / `src_mask`
        are the encoder-decoder's and must be None here. head=False: the hidden states the output
        layer would read, (B, D) or (B, T, D) (greedy decoding applies `lm_head` itself: Linear.argmax)."""
        if memory is not None:
            raise ConfigError("a Decoder has no encoder: step() takes no memory")
        hidden = self.stack(ids, attention_mask, positions, cache)[0]            # (B, T, D)
        hidden = hidden if all_logits else hidden[:, -1]
        return self.lm_head(hidden) if head else hidden                          # (B, T, V) or (B, V)

    def new_cache(self, batch_size: int, max_len: int | None = None, dtype=None) -> Cache:
        """Preallocated KV cache for `batch_size` sequences of up to `max_len` positions."""
        param = _floating(self.stack.embed.token)   # not lm_head's: an int8-quantised output layer (quant.py)
        return self.stack.new_cache(self.cfg, batch_size, max_len or self.cfg.max_seq_len,
                                    _cache_dtype(param, dtype), param.device, cross=False)


class EncoderDecoder(GenerationMixin, nn.Module):
    """The 2017 translation model: the encoder reads the source once; every decoder layer attends to
    its output ("memory") while generating the target left to right. One token embedding is shared
    by encoder, decoder and (when tied) the output layer; with cfg.src_vocab_size the source has its
    own vocabulary and embedding (`src_embed`), and `shared` serves the target side only."""

    kind = "encoder-decoder"
    is_encoder_decoder = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.src_embed = nn.Embedding(cfg.src_vocab_size, cfg.d_model) if cfg.src_vocab_size else None
        self.encoder = Encoder(cfg, token_embedding=self.src_embed if self.src_embed is not None else self.shared)
        self.decoder = DecoderStack(cfg.stack_config("decoder"), cfg.decoder_layers, cross=True,
                                    token_embedding=self.shared)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, bias=cfg.lm_head_bias)
        self.output_scale = cfg.d_model ** -0.5 if cfg.output_scale else 1.0     # T5 v1.0 scales before its tied head
        init_weights(self, cfg.n_layers + cfg.decoder_layers, cfg.norm_position)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.shared.weight

    def encode(self, src_ids: Tensor, src_mask: Tensor | None = None, return_attention: bool = False):
        """(B, S) source ids -> memory (B, S, D)."""
        return self.encoder(src_ids, src_mask, return_attention=return_attention)

    def decode(self, tgt_ids: Tensor, memory: Tensor, src_mask: Tensor | None = None,
               tgt_mask: Tensor | None = None, positions: Tensor | None = None, cache: Cache | None = None,
               return_attention: bool = False):
        """(B, T) target ids so far + memory -> logits (B, T, V)."""
        memory_mask = combine(padding_mask(src_mask)) if src_mask is not None else None
        hidden, self_attn, cross_attn = self.decoder(tgt_ids, tgt_mask, positions, cache, memory, memory_mask,
                                                     return_attention=return_attention)
        logits = self.lm_head(hidden * self.output_scale)
        return (logits, self_attn, cross_attn) if return_attention else logits

    def forward(self, src_ids: Tensor, tgt_ids: Tensor, src_mask: Tensor | None = None,
                tgt_mask: Tensor | None = None, return_attention: bool = False):
        if not return_attention:
            return self.decode(tgt_ids, self.encode(src_ids, src_mask), src_mask, tgt_mask)
        memory, enc_attn = self.encode(src_ids, src_mask, return_attention=True)
        logits, dec_attn, cross_attn = self.decode(tgt_ids, memory, src_mask, tgt_mask, return_attention=True)
        return logits, {"encoder": enc_attn, "decoder": dec_attn, "cross": cross_attn}

    def step(self, ids: Tensor, cache: Cache | None = None, attention_mask: Tensor | None = None,
             positions: Tensor | None = None, memory: Tensor | None = None, src_mask: Tensor | None = None,
             all_logits: bool = False, head: bool = True) -> Tensor:
        """Decoder.step for the target side: `memory` (B, S, D) is encode()'s output and `src_mask`
        (B, S) of 1/0 its padding (None: none). The cross-attention keys and values are computed from
        `memory` at the first step and kept in `cache` (later steps may pass the same memory)."""
        if memory is None:
            raise ConfigError("an EncoderDecoder decodes from the encoder's output: pass memory=model.encode(src)")
        memory_mask = combine(padding_mask(src_mask)) if src_mask is not None else None
        hidden = self.decoder(ids, attention_mask, positions, cache, memory, memory_mask)[0] * self.output_scale
        hidden = hidden if all_logits else hidden[:, -1]
        return self.lm_head(hidden) if head else hidden

    def new_cache(self, batch_size: int, max_len: int | None = None, dtype=None) -> Cache:
        param = _floating(self.shared)              # not lm_head's: it may be int8-quantised (quant.py)
        return self.decoder.new_cache(self.cfg.stack_config("decoder"), batch_size, max_len or self.cfg.max_seq_len,
                                      _cache_dtype(param, dtype), param.device, cross=True)
