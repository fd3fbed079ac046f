"""The pieces of a Transformer block: norms, the feed-forward network, residual connections, and
the encoder and decoder layers built from them. Every block maps (B, T, D) -> (B, T, D).

Where the norm sits is chosen when the block is built (`PreNorm` or `PostNorm`), not in forward:

    post-LN (2017):   x = LayerNorm(x + Sublayer(x))
    pre-LN (modern):  x = x + Sublayer(LayerNorm(x))      (+ one final norm after the last block)
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import CrossKVCache, KVCache, MultiHeadAttention
from .masks import Packing
from .config import ModelConfig
from .dropout import Dropout


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),   # GPT-2's "gelu_new"
    "relu": F.relu,
    "silu": F.silu,
}


class FeedForward(nn.Module):
    """The position-wise FFN, applied to every token independently: down(act(up(x))).
    SwiGLU (Llama) gates it: down(silu(gate(x)) * up(x)); gate and up share one fused matrix."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu", bias: bool = True, dropout: float = 0.0):
        super().__init__()
        self.gated = activation == "swiglu"
        self.act = F.silu if self.gated else ACTIVATIONS[activation]
        self.up = nn.Linear(d_model, 2 * d_ff if self.gated else d_ff, bias=bias)
        self.down = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.up(x)                                                           # (B, T, d_ff or 2*d_ff)
        if self.gated:
            gate, h = h.chunk(2, dim=-1)
            h = self.act(gate) * h
        else:
            h = self.act(h)
        return self.down(self.dropout(h))


class PreNorm(nn.Module):
    """Residual connection, norm first: x + dropout(f(norm(x)))."""

    def __init__(self, norm: nn.Module, dropout: float):
        super().__init__()
        self.norm, self.dropout = norm, Dropout(dropout)

    def forward(self, x: Tensor, f: Callable[[Tensor], Tensor]) -> Tensor:
        return x + self.dropout(f(self.norm(x)))


class PostNorm(nn.Module):
    """Residual connection, then norm ("Add & Norm" of 2017): norm(x + dropout(f(x)))."""

    def __init__(self, norm: nn.Module, dropout: float):
        super().__init__()
        self.norm, self.dropout = norm, Dropout(dropout)

    def forward(self, x: Tensor, f: Callable[[Tensor], Tensor]) -> Tensor:
        return self.norm(x + self.dropout(f(x)))


def residual(cfg: ModelConfig) -> nn.Module:
    return (PreNorm if cfg.norm_position == "pre" else PostNorm)(make_norm(cfg), cfg.dropout)


def self_attention(cfg: ModelConfig, rotary: nn.Module | None = None) -> MultiHeadAttention:
    return MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.bias, cfg.attention_dropout,
                              rotary=rotary)


class EncoderLayer(nn.Module):
    """Self-attention over the whole sequence, then the FFN, each wrapped in a residual + norm."""

    def __init__(self, cfg: ModelConfig, rotary: nn.Module | None = None):
        super().__init__()
        self.attn = self_attention(cfg, rotary)
        self.attn_residual = residual(cfg)
        self.ffn = FeedForward(cfg.d_model, cfg.ffn_dim, cfg.activation, cfg.bias, cfg.ffn_dropout)
        self.ffn_residual = residual(cfg)

    def forward(self, x: Tensor, mask: Tensor | None = None, positions: Tensor | None = None,
                need_weights: bool = False, packing: Packing | None = None) -> tuple[Tensor, Tensor | None]:
        """x: (B, T, D), or (N, D) real tokens only with `packing` (see masks.Packing)."""
        weights = None

        def attend(h: Tensor) -> Tensor:
            nonlocal weights
            h, weights = self.attn(h, mask=mask, positions=positions, need_weights=need_weights, packing=packing)
            return h

        x = self.attn_residual(x, attend)
        x = self.ffn_residual(x, self.ffn)
        return x, weights


class DecoderLayer(nn.Module):
    """Masked (causal) self-attention, then — in an encoder-decoder — attention to the encoder
    output (Q from the decoder, K and V from the encoder), then the FFN; each with residual + norm."""

    def __init__(self, cfg: ModelConfig, cross: bool = False, rotary: nn.Module | None = None):
        super().__init__()
        self.attn = self_attention(cfg, rotary)
        self.attn_residual = residual(cfg)
        if cross:
            self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.bias,
                                                 cfg.attention_dropout, cross=True)
            self.cross_residual = residual(cfg)
        else:
            self.cross_attn = None
        self.ffn = FeedForward(cfg.d_model, cfg.ffn_dim, cfg.activation, cfg.bias, cfg.ffn_dropout)
        self.ffn_residual = residual(cfg)

    def forward(self, x: Tensor, mask: Tensor | None = None, positions: Tensor | None = None,
                cache: KVCache | None = None, memory: Tensor | None = None, memory_mask: Tensor | None = None,
                cross_cache: CrossKVCache | None = None, need_weights: bool = False):
        """x: (B, T, D). `mask` None means plain causal attention (the fused kernel builds it)."""
        weights, cross_weights = None, None

        def attend(h: Tensor) -> Tensor:
            nonlocal weights
            h, weights = self.attn(h, mask=mask, positions=positions, cache=cache,
                                   is_causal=mask is None and h.size(1) > 1, need_weights=need_weights)
            return h

        def attend_memory(h: Tensor) -> Tensor:
            nonlocal cross_weights
            h, cross_weights = self.cross_attn(h, memory, mask=memory_mask, cache=cross_cache,
                                               need_weights=need_weights)
            return h

        x = self.attn_residual(x, attend)
        if self.cross_attn is not None:
            x = self.cross_residual(x, attend_memory)
        x = self.ffn_residual(x, self.ffn)
        return x, weights, cross_weights


def column_major(weight: nn.Parameter) -> None:
    """Store a linear layer's (out, in) weight column-major: as the contiguous (in, out) matrix seen
    transposed (the layout of HF GPT-2's Conv1D). Same values and shape; but a one-token forward on
    a CPU (a matrix-vector product) then reads the weights ~1.3x (layers) to ~1.9x (a 50k-word output
    layer) faster in fp32 (BENCHMARKS.md, "Performance"). load_state_dict and .to() keep the layout."""
    if weight.is_contiguous():
        weight.data = weight.data.t().contiguous().t()


def decode_layout(model: nn.Module) -> None:
    """Before generating on a CPU: fp32 linear weights column-major (see column_major), bf16 ones
    row-major, which oneDNN's bf16 matrix-vector product reads ~9% faster. Values do not change;
    an fp32 model built by tformer is already laid out, so this usually does nothing."""
    for m in model.modules():
        w = m.weight if isinstance(m, nn.Linear) else None
        if w is None or w.device.type != "cpu" or w.dim() != 2 or min(w.shape) == 1:
            continue
        if w.dtype == torch.float32:
            column_major(w)
        elif not w.is_contiguous():
            w.data = w.data.contiguous()
