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
from torch.utils.checkpoint import checkpoint

from ..kernels import gemv
from .attention import MultiHeadAttention
from .config import ModelConfig
from .dropout import Dropout
from .kv_cache import CrossKVCache, KVCache
from .linear import Linear
from .masks import Packing


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm by tformer's kernel (kernels/rmsnorm.c): one pass forward, one backward, keeping x and each
    row's 1 / rms."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        y, r = gemv.rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, r)
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        x, weight, r = ctx.saved_tensors
        dx, dw = gemv.rms_norm_grad(x, weight, r, g)
        return dx, (dw if ctx.needs_input_grad[1] else None), None


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` (same parameters and state dict) that trains through tformer's kernel where it is built,
    on fp32 CPU tensors: PyTorch's CPU RMSNorm is a composite of five ops forward and more backward, ~3x
    LayerNorm's time (BENCHMARKS.md, "Demo"). Elsewhere (no kernel, other dtypes or devices, sharded weights,
    torch.compile, no gradients) PyTorch's."""

    def forward(self, x: Tensor) -> Tensor:
        if (torch.is_grad_enabled() and self.weight is not None and x.dtype == torch.float32 == self.weight.dtype
                and type(x) is Tensor and type(self.weight.data) is Tensor and x.device.type == "cpu"
                and len(self.normalized_shape) == 1 and x.numel() > 0 and not torch.compiler.is_compiling()
                and gemv.available()):
            eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
            return RMSNormFunction.apply(x, self.weight, eps)
        return super().forward(x)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


class GeluTanhFunction(torch.autograd.Function):
    """GELU (tanh's approximation) by tformer's kernel (kernels/gelu.c): one pass forward, one backward,
    keeping x, as PyTorch's does."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return gemv.gelu_tanh(x)

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return gemv.gelu_tanh_grad(x, g)


def gelu_tanh(x: Tensor) -> Tensor:
    """GPT-2's "gelu_new": F.gelu(x, approximate="tanh"), by tformer's kernel on fp32 CPU tensors where it is
    built (PyTorch's CPU tanh GELU takes ~3x its erf GELU's time, forward and backward: a GPT-2-small training
    step spends ~4% in it; BENCHMARKS.md, "LoRA"), else PyTorch's."""
    if (x.dtype == torch.float32 and x.device.type == "cpu" and type(x) is Tensor and x.numel() > 0
            and not torch.compiler.is_compiling() and gemv.available()):
        return GeluTanhFunction.apply(x)
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": gelu_tanh,   # GPT-2's "gelu_new"
    "relu": F.relu,
    "silu": F.silu,
}


# Gated FFNs: the activation applied to the gate. "geglu" is T5 v1.1's "gated-gelu" (tanh GELU).
GATED: dict[str, Callable[[Tensor], Tensor]] = {"swiglu": F.silu, "geglu": ACTIVATIONS["gelu_tanh"]}


class FeedForward(nn.Module):
    """The position-wise FFN, applied to every token independently: down(act(up(x))).
    SwiGLU (Llama) gates it: down(silu(gate(x)) * up(x)); gate and up share one fused matrix.
    GEGLU (T5 v1.1) is the same with GELU on the gate."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu", bias: bool = True, dropout: float = 0.0):
        super().__init__()
        self.gated, self.activation = activation in GATED, activation
        self.act = GATED[activation] if self.gated else ACTIVATIONS[activation]
        self.up = Linear(d_model, 2 * d_ff if self.gated else d_ff, bias=bias)
        self.down = Linear(d_ff, d_model, bias=bias)
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        if not self.gated:
            return self.down(self.dropout(self.up.activated(x, self.activation, self.act)))   # act(up(x))
        gate, h = self.up(x).chunk(2, dim=-1)                                    # (B, T, d_ff) each
        return self.down(self.dropout(self.act(gate) * h))


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
                              rotary=rotary, head_dim=cfg.head_dim, scaled=cfg.attention_scale)


class Block(nn.Module):
    """A layer of a stack. Once `checkpoint_activations` has set `checkpointed`, a training forward with
    gradients keeps only the layer's inputs and runs the layer again in the backward to get the rest
    (activation checkpointing, HF's "gradient checkpointing"): a layer's activations live one layer at a
    time, for about one more forward pass of compute. Dropout draws the same masks both times (the RNG
    state is replayed)."""

    checkpointed = False

    def __call__(self, *args, **kwargs):
        if self.checkpointed and self.training and torch.is_grad_enabled():
            return checkpoint(super().__call__, *args, use_reentrant=False, **kwargs)
        return super().__call__(*args, **kwargs)


def checkpoint_activations(model: nn.Module, on: bool = True) -> nn.Module:
    """Recompute every layer of `model` in the backward instead of keeping its activations (see `Block`)."""
    for module in model.modules():
        if isinstance(module, Block):
            module.checkpointed = on
    return model


class EncoderLayer(Block):
    """Self-attention over the whole sequence, then the FFN, each wrapped in a residual + norm."""

    def __init__(self, cfg: ModelConfig, rotary: nn.Module | None = None):
        super().__init__()
        self.attn = self_attention(cfg, rotary)
        self.attn_residual = residual(cfg)
        self.ffn = FeedForward(cfg.d_model, cfg.ffn_dim, cfg.activation, cfg.bias, cfg.ffn_dropout)
        self.ffn_residual = residual(cfg)

    def forward(self, x: Tensor, mask: Tensor | None = None, positions: Tensor | None = None,
                need_weights: bool = False, packing: Packing | None = None,
                position_bias: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """x: (B, T, D), or (N, D) real tokens only with `packing` (see masks.Packing)."""
        weights = None

        def attend(h: Tensor) -> Tensor:
            nonlocal weights
            h, weights = self.attn(h, mask=mask, positions=positions, need_weights=need_weights, packing=packing,
                                   position_bias=position_bias)
            return h

        x = self.attn_residual(x, attend)
        x = self.ffn_residual(x, self.ffn)
        return x, weights


class DecoderLayer(Block):
    """Masked (causal) self-attention, then — in an encoder-decoder — attention to the encoder
    output (Q from the decoder, K and V from the encoder), then the FFN; each with residual + norm."""

    def __init__(self, cfg: ModelConfig, cross: bool = False, rotary: nn.Module | None = None):
        super().__init__()
        self.attn = self_attention(cfg, rotary)
        self.attn_residual = residual(cfg)
        if cross:
            self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.bias,
                                                 cfg.attention_dropout, cross=True, head_dim=cfg.head_dim,
                                                 scaled=cfg.attention_scale)
            self.cross_residual = residual(cfg)
        else:
            self.cross_attn = None
        self.ffn = FeedForward(cfg.d_model, cfg.ffn_dim, cfg.activation, cfg.bias, cfg.ffn_dropout)
        self.ffn_residual = residual(cfg)

    def forward(self, x: Tensor, mask: Tensor | None = None, positions: Tensor | None = None,
                cache: KVCache | None = None, memory: Tensor | None = None, memory_mask: Tensor | None = None,
                cross_cache: CrossKVCache | None = None, need_weights: bool = False,
                position_bias: Tensor | None = None):
        """x: (B, T, D). `mask` None means plain causal attention (the fused kernel builds it).
        `position_bias` (1, H, T, cached + T): T5's relative bias, on self-attention only."""
        weights, cross_weights = None, None

        def attend(h: Tensor) -> Tensor:
            nonlocal weights
            # Without a cache the flag does not depend on T (at T = 1, one query and one key, causal and
            # full attention agree), so torch.compile sees a plain bool, not a symbolic `T > 1`, which
            # broke the graph at every attention layer and lengthened the compile (BENCHMARKS.md, "torch.compile").
            causal = mask is None and (cache is None or h.size(1) > 1)
            h, weights = self.attn(h, mask=mask, positions=positions, cache=cache, is_causal=causal,
                                   need_weights=need_weights, position_bias=position_bias)
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

