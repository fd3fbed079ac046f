"""Attention: softmax(QKᵀ/√d_k)V and multi-head attention (the KV cache: kv_cache.py).

Shape letters used below: B batch, H query heads, H_kv key/value heads (H_kv < H: grouped-query
attention), T_q query length, T_k key length, hd head size (d_model / H unless set), D = d_model.
Masks are bool, True = may attend (see masks.py), broadcastable to (B, H, T_q, T_k). A position
bias (T5's relative bias) is a float added to the scores, broadcastable to (B, H, T_q, T_k).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..devices import amx
from ..kernels import gemv
from .dropout import dropout
from .kv_cache import CrossKVCache, KVCache, follow_lineage
from .linear import Linear
from .masks import Packing, with_causal


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, dropout_p: float = 0.0,
              is_causal: bool = False, return_weights: bool = False, bias: Tensor | None = None,
              scale: float | None = None):
    """The reference path, written as the formula: for query i and key j

        s_ij = q_i · k_j / √d_k  (+ b_ij)  (score; `scale` replaces 1/√d_k, `bias` adds b_ij)
        α_ij = exp(s_ij) / Σ_j' exp(s_ij')   (softmax over keys; masked keys get s = -∞, so α = 0)
        o_i  = Σ_j α_ij v_j                 (weighted sum of values)

    q: (B, H, T_q, hd); k, v: (B, H_kv, T_k, hd). Returns o (B, H, T_q, hd), and α (B, H, T_q, T_k)
    when return_weights=True.
    """
    k, v = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
    scores = q @ k.transpose(-2, -1) * (scale if scale is not None else 1 / math.sqrt(q.size(-1)))  # (B, H, T_q, T_k)
    if bias is not None:
        scores = scores + bias
    if is_causal:
        mask = with_causal(mask, q.size(-2), k.size(-2), device=q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    weights = torch.nan_to_num(weights)              # a row with every key masked attends to nothing
    out = dropout(weights, dropout_p) @ v                                         # (B, H, T_q, hd)
    return (out, weights) if return_weights else out


def fused_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, dropout_p: float = 0.0,
                    is_causal: bool = False, bias: Tensor | None = None, scale: float | None = None) -> Tensor:
    """The same computation through PyTorch's fused kernels (flash / memory-efficient / math).
    They never materialise α, so they cannot return it. A bias goes in as a float mask."""
    if bias is not None:
        mask, is_causal = bias_mask(bias, mask, is_causal, q), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale, enable_gqa=k.size(1) != q.size(1))


def bias_mask(bias: Tensor, mask: Tensor | None, is_causal: bool, q: Tensor) -> Tensor:
    """The bool mask (and the causal one) folded into the additive bias: b where allowed, -inf elsewhere."""
    if is_causal:
        mask = with_causal(mask, q.size(-2), bias.size(-1), device=q.device)
    bias = bias.to(q.dtype)
    return bias if mask is None else torch.where(mask, bias, float("-inf"))


def unfused_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, dropout_p: float = 0.0,
                      is_causal: bool = False, bias: Tensor | None = None, scale: float | None = None) -> Tensor:
    """The formula in plain ops and in the input's dtype: the fast way to *train* in bf16 on a CPU,
    and to decode a batch on one (decoding_a_batch). PyTorch's CPU flash kernel has a slow backward
    pass; here one baddbmm computes the scaled scores plus the mask (0 or -inf) and the softmax and
    αV follow: faster than the flash kernel, forward + backward, in bf16 (BENCHMARKS.md, "What makes a
    CPU training step fast"). A query with every key masked gets NaN (the fused kernel: 0)."""
    k, v = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
    B, H, t_q, hd = q.shape
    t_k = k.size(-2)
    if bias is not None:
        additive = bias_mask(bias, mask, is_causal, q)                           # b where allowed, -inf elsewhere
    else:
        if is_causal:
            mask = with_causal(mask, t_q, t_k, device=q.device)
        additive = torch.zeros(mask.shape if mask is not None else (), dtype=q.dtype, device=q.device)
        if mask is not None:
            additive.masked_fill_(~mask, float("-inf"))                          # 0 where allowed, -inf elsewhere
    scores = torch.baddbmm(additive.expand(B, H, t_q, t_k).reshape(B * H, t_q, t_k), q.reshape(B * H, t_q, hd),
                           k.reshape(B * H, t_k, hd).transpose(1, 2),
                           alpha=scale if scale is not None else hd ** -0.5)     # (B·H, T_q, T_k)
    return (dropout(scores.softmax(dim=-1), dropout_p) @ v.reshape(B * H, t_k, hd)).view(B, H, t_q, hd)


def decoding_a_batch(q: Tensor, t: int) -> bool:
    """A decoding step (one new token per sequence: t == 1) with at least 256 (row, head, query) triples, where
    PyTorch's CPU flash kernel is slower than unfused_attention (Marian's beam search: 64 rows x 8 heads;
    cross-attention of 16 x 8 with 4 beams folded into the queries) while it is as fast or faster for fewer
    (GPT-2's 12 heads at batch 1 or 8; BENCHMARKS.md, "Kernels"). Such a query always has a key to attend to
    (itself, or its source), so the unfused path's NaN for a fully masked query cannot arise."""
    return t == 1 and q.size(-2) <= 16 and q.size(0) * q.size(1) * q.size(-2) >= 256


def decoding_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None,
                       lineage: Tensor | None = None) -> Tensor | None:
    """A decoding step on a CPU (one new query per row, no gradient) through tformer's kernel (gemv.attend):
    every (row, head) in one call, the beams of a source reading its keys in place (no fold_copies), a beam
    its ancestors' keys where they were written (`lineage`, KVCache), the heads written side by side -> (B, 1,
    H·hd). Faster than the batched products at Marian's beam search and than the flash kernel at GPT-2's batch
    1 (benchmarks/decode_attention.py; BENCHMARKS.md, "Kernels"); a bf16 model's queries widened for it (not
    with AMX: devices.amx). None where the kernel does not apply (the paths above then run)."""
    bf16 = q.dtype == torch.bfloat16 and not amx()
    if q.device.type != "cpu" or q.requires_grad or q.dtype != torch.float32 and not bf16 or q.size(-2) != 1:
        return None
    out = gemv.attend(q.float(), k, v, mask, scale if scale is not None else q.size(-1) ** -0.5, lineage)
    return out.to(q.dtype) if out is not None else None


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Tensor | None:
    """One sequence's new queries attending causally to its keys on a CPU in fp32 or bf16 without a gradient,
    through tformer's kernel (gemv.attend_causal): q (1, H, T, hd), T > 1, k and v (1, H_kv, L, hd), the last T
    positions the queries' own -> (1, T, H·hd). A prompt's prefill, or a server's prompt chunk after the ones
    before it: 1.6-3.3x PyTorch's flash kernel on 56-512 queries (benchmarks/causal_attention.py; BENCHMARKS.md,
    "Kernels"); bf16 queries not with AMX (devices.amx). None where the kernel does not apply."""
    if (q.device.type != "cpu" or q.requires_grad or q.size(0) != 1 or k.size(0) != 1 or q.size(-2) < 2
            or torch.compiler.is_compiling() or q.dtype == torch.bfloat16 and amx()):   # (compiled: PyTorch's)
        return None
    out = gemv.attend_causal(q[0].transpose(0, 1), k[0], v[0], scale if scale is not None else q.size(-1) ** -0.5)
    return None if out is None else out[None]


def whole_text_attention(qkv: Tensor, packing: Packing, heads: int, kv_heads: int, head_dim: int,
                         scale: float | None) -> Tensor | None:
    """An encoder's self-attention on the real tokens of a batch (`packing`; padded or not), without a gradient,
    through tformer's kernel (gemv.attend_whole): each text's tokens attend to its own, read in place in
    the fused projection's output qkv (N, ·) -> (N, H·hd), with no padding put back and taken out. For
    texts of a few dozen tokens PyTorch's flash kernel and the padding around it took ~25% of MiniLM's time
    (BENCHMARKS.md, "Against CTranslate2 and ONNX Runtime"). None where the kernel does not apply."""
    if qkv.device.type != "cpu" or qkv.requires_grad:
        return None
    return gemv.attend_whole(qkv, packing.starts, heads, kv_heads, head_dim,
                             scale if scale is not None else head_dim ** -0.5)


def inference_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None,
                        is_causal: bool = False) -> Tensor:
    """softmax(QKᵀ/√d_k)V without a gradient, weights or bias, by the path MultiHeadAttention takes for
    these shapes (the decoding kernel, unfused_attention for a batch of decoding steps, else the fused
    kernel): q (B, H, T_q, hd), k, v (B, H_kv, T_k, hd) -> (B, T_q, H·hd), the heads side by side.
    For a ragged batch (ragged.py), whose parts each attend as they would alone."""
    out = decoding_attention(q, k, v, mask, scale)
    if out is not None:
        return out
    k, v = as_queries(q, k, v)
    t = q.size(-2)
    attend = unfused_attention if q.device.type == "cpu" and decoding_a_batch(q, t) else fused_attention
    out = attend(q, k, v, mask, is_causal=is_causal, scale=scale)                  # (B, H, T_q, hd)
    return out.transpose(1, 2).reshape(q.size(0), t, -1)


def as_queries(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """K and V in the queries' dtype: a server's bf16 KV cache (serve/pool.py) read by a path other than the
    decoding kernel, which widens them itself."""
    return (k, v) if k.dtype == q.dtype else (k.to(q.dtype), v.to(q.dtype))


def fold_copies(q: Tensor, copies: int) -> Tensor:
    """(B·c, H, T_q, hd) -> (B, H, c·T_q, hd): c consecutive rows that attend to the same keys and
    values (the beams of one source in cross-attention) become the query positions of one row, so K
    and V are computed, and read, once per source rather than once per beam."""
    if copies == 1:
        return q
    n, H, T, hd = q.shape
    return q.view(n // copies, copies, H, T, hd).transpose(1, 2).reshape(n // copies, H, copies * T, hd)


def unfold_copies(x: Tensor, copies: int) -> Tensor:
    """The inverse of fold_copies: (B, H, c·T_q, ·) -> (B·c, H, T_q, ·)."""
    if copies == 1:
        return x
    B, H, cT, d = x.shape
    return x.view(B, H, copies, cT // copies, d).transpose(1, 2).reshape(B * copies, H, cT // copies, d)


def _repeat_kv(x: Tensor, n_heads: int) -> Tensor:
    """(B, H_kv, T, hd) -> (B, H, T, hd): each K/V head serves H / H_kv query heads."""
    return x if x.size(1) == n_heads else x.repeat_interleave(n_heads // x.size(1), dim=1)


class MultiHeadAttention(nn.Module):
    """Q = X W_Q, K = C W_K, V = C W_V; H heads attend in parallel; heads are concatenated and mixed
    by the output projection W_O. Self-attention: C = X. Encoder-decoder (cross) attention: X is the
    decoder stream, C the encoder output.

    Self-attention projects Q, K, V with one fused matrix (one GEMM instead of three); cross-attention
    fuses K and V, which both come from C. `rotary` (RoPE) rotates Q and K when given. `head_dim`
    (default d_model / n_heads) may be set on its own (T5's d_kv); `scaled=False` drops the 1/√d_k.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, bias: bool = True,
                 dropout: float = 0.0, cross: bool = False, rotary: nn.Module | None = None,
                 head_dim: int | None = None, scaled: bool = True):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads or n_heads
        self.head_dim = head_dim or d_model // n_heads
        self.scale = None if scaled else 1.0                                     # None: the kernels' 1/√d_k
        self.cross, self.dropout, self.rotary = cross, dropout, rotary
        q_dim, kv_dim = n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        if cross:
            self.q_proj = Linear(d_model, q_dim, bias=bias)
            self.kv_proj = Linear(d_model, 2 * kv_dim, bias=bias)
        else:
            self.qkv_proj = Linear(d_model, q_dim + 2 * kv_dim, bias=bias)
        self.out_proj = Linear(q_dim, d_model, bias=bias)

    def forward(self, x: Tensor, context: Tensor | None = None, mask: Tensor | None = None,
                positions: Tensor | None = None, cache: KVCache | CrossKVCache | None = None,
                is_causal: bool = False, need_weights: bool = False, packing: Packing | None = None,
                position_bias: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """x: (B, T_q, D); context: (B, T_k, D) for cross-attention. Returns (out (B, T_q, D),
        α (B, H, T_q, T_k) or None). `is_causal` asks for the causal mask without building it.
        With `packing` (self-attention), x and the output hold only the real tokens: (N, D).
        `position_bias` (1, H, T_q, T_k) is added to the scores (T5's relative positions)."""
        B, T = packing.shape if packing is not None else x.shape[:2]
        lineage = None                                   # KVCache.lineage: which row holds each cached position
        if self.cross:
            q = self.split_heads(self.q_proj(x), self.n_heads)                  # (B, H, T_q, hd)
            if cache is not None and cache.k is not None:
                k, v = cache.k, cache.v
            else:
                k, v = self.kv_heads(self.kv_proj(context))
                if cache is not None:
                    cache.k, cache.v = k, v
            copies = B // k.size(0)          # beams / samples of one source share its K, V and mask
        else:
            qkv = self.qkv_proj(x)
            if packing is not None:
                out = None if need_weights or position_bias is not None or self.rotary is not None else \
                    whole_text_attention(qkv, packing, self.n_heads, self.n_kv_heads, self.head_dim, self.scale)
                if out is not None:
                    return self.out_proj(out), None
                qkv = packing.unpack(qkv)                                        # (N, ·) -> (B, T, ·)
            q, k, v = self.qkv_heads(qkv)
            if self.rotary is not None:
                q, k = self.rotary(q, positions), self.rotary(k, positions)
            if cache is not None and cache.ragged:                                # several caches' tokens: ragged.py
                return self.out_proj(cache.attend(q, k, v, self.scale)), None
            if cache is not None:
                k, v = cache.update(k, v)                                        # (B, H_kv, T_k, hd)
                lineage = cache.lineage[:, :k.size(2)] if cache.lineage is not None else None

        if not need_weights and position_bias is None and packing is None:
            out = decoding_attention(q, k, v, mask, self.scale, lineage)
            if out is None and is_causal and mask is None and lineage is None and not self.cross:
                out = causal_attention(q, k, v, self.scale)           # (is_causal, no mask: no cached positions)
            if out is not None:
                return self.out_proj(out), None
        k, v = as_queries(q, k, v)
        if lineage is not None:
            k, v = follow_lineage(k, v, lineage)
        if self.cross:
            q = fold_copies(q, copies)
        dropout_p = self.dropout if self.training else 0.0
        extra = dict(bias=position_bias, scale=self.scale)
        if need_weights:
            out, weights = attention(q, k, v, mask, dropout_p, is_causal, return_weights=True, **extra)
        elif q.device.type == "cpu" and (q.requires_grad and q.dtype in (torch.bfloat16, torch.float16)
                                         or not q.requires_grad and decoding_a_batch(q, T)):
            out, weights = unfused_attention(q, k, v, mask, dropout_p, is_causal, **extra), None
        else:
            out, weights = fused_attention(q, k, v, mask, dropout_p, is_causal, **extra), None
        if self.cross:
            out = unfold_copies(out, copies)
            weights = unfold_copies(weights, copies) if weights is not None else None
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)     # concat heads: (B, T_q, H*hd)
        if packing is not None:
            out = packing.pack(out)                                              # (B, T, ·) -> (N, ·)
        return self.out_proj(out), weights

    def whole_texts(self, x: Tensor) -> bool:
        """Whether whole_text_attention (tformer's kernel) can attend for this layer on inputs like x: self-attention
        without rotary positions, on a CPU where the kernel is built, fp32 or bf16, heads of a multiple of 16."""
        return (not self.cross and self.rotary is None and x.device.type == "cpu" and gemv.available()
                and x.dtype in (torch.float32, torch.bfloat16) and self.head_dim % 16 == 0
                and self.head_dim <= gemv.MAX_HEAD)

    def split_heads(self, x: Tensor, n: int) -> Tensor:
        """(B, T, n·hd) -> (B, n, T, hd): n heads of size hd."""
        B, T, _ = x.shape
        return x.view(B, T, n, self.head_dim).transpose(1, 2)                    # (B, n, T, hd)

    def qkv_heads(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention's fused projection (B, T, (H + 2·H_kv)·hd) -> Q (B, H, T, hd), K, V (B, H_kv, T, hd)."""
        kv_dim = self.n_kv_heads * self.head_dim
        q, k, v = qkv.split([self.n_heads * self.head_dim, kv_dim, kv_dim], dim=-1)
        return (self.split_heads(q, self.n_heads), self.split_heads(k, self.n_kv_heads),
                self.split_heads(v, self.n_kv_heads))

    def kv_heads(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-attention's fused K/V projection (B, T_k, 2·H_kv·hd) -> K, V (B, H_kv, T_k, hd)."""
        k, v = kv.chunk(2, dim=-1)
        return self.split_heads(k, self.n_kv_heads), self.split_heads(v, self.n_kv_heads)
