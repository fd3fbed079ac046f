"""Positional encodings: how a Transformer, which sees a set of vectors, learns their order.

- sinusoidal (2017): PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(pos / 10000^(2i/D)),
  added to the token embeddings; fixed, no parameters.
- learned (GPT-2, BERT): a trainable table of max_seq_len rows, added to the token embeddings.
- rotary, RoPE (Llama): nothing is added; instead Q and K are rotated by a position-dependent
  angle per pair of dimensions, so QKᵀ depends on the *relative* offset of the two tokens.
- relative bias (T5): nothing is added to the tokens; each head adds a learned scalar b(bucket(j - i))
  to the score of query i and key j, with distances grouped into log-spaced buckets.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def sinusoidal_table(n_positions: int, dim: int, layout: str = "interleaved") -> Tensor:
    """(n_positions, dim) table of the 2017 formula.

    layout="interleaved" puts sin on even and cos on odd dimensions (the paper);
    layout="split" puts all sines in the first half and all cosines in the second (Marian, fairseq).
    """
    pos = torch.arange(n_positions, dtype=torch.float64)[:, None]               # (P, 1)
    inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (D/2,)
    angles = pos * inv_freq                                                      # (P, D/2)
    table = torch.empty(n_positions, dim, dtype=torch.float64)
    if layout == "interleaved":
        table[:, 0::2], table[:, 1::2] = angles.sin(), angles.cos()
    else:
        half = dim // 2
        table[:, :half], table[:, half:] = angles.sin(), angles.cos()
    return table.float()


class SinusoidalPositions(nn.Module):
    """Fixed sinusoidal position vectors, looked up by position index."""

    def __init__(self, n_positions: int, dim: int, layout: str = "interleaved"):
        super().__init__()
        # Not a parameter and not saved: it is a formula, recomputed at build time.
        self.register_buffer("table", sinusoidal_table(n_positions, dim, layout), persistent=False)

    def forward(self, positions: Tensor) -> Tensor:
        return F.embedding(positions, self.table)                                # (..., T, D)


class LearnedPositions(nn.Module):
    """A trainable vector per position. `offset` skips reserved rows (BART stores 2 extra)."""

    def __init__(self, n_positions: int, dim: int, offset: int = 0):
        super().__init__()
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(n_positions + offset, dim))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, positions: Tensor) -> Tensor:
        # F.embedding, not weight[...]: the same rows, but a much faster backward (and forward) on CPU
        return F.embedding(positions + self.offset, self.weight)                 # (..., T, D)


class RotaryEmbedding(nn.Module):
    """RoPE in the "rotate half" form used by Llama in Hugging Face: dimension i is paired with
    i + head_dim/2, and each pair is rotated by angle pos * theta^(-2i/head_dim):

        y = x cos + rotate_half(x) sin,   rotate_half(x) = [-x₂, x₁] = roll(x, hd/2) ⊙ [-1, 1]

    so the sign goes into a table (`signed_sin` = [-sin, sin]) and a step is a multiply, a roll and a
    multiply-add: three passes over x where [-x₂, x₁] took five, forward and backward alike. The tables
    are fp32; the rotation runs in x's dtype (bf16 under autocast or in a bf16 model), as HF's Llama
    casts its cos and sin to the queries' dtype."""

    def __init__(self, head_dim: int, max_positions: int, theta: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq  # (P, hd/2)
        self.register_buffer("cos", torch.cat([angles, angles], dim=-1).cos().float(), persistent=False)
        self.register_buffer("signed_sin", torch.cat([-angles, angles], dim=-1).sin().float(), persistent=False)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x: (B, H, T, hd); positions: (T,) or (B, T)."""
        cos, sin = self.cos[positions].to(x.dtype), self.signed_sin[positions].to(x.dtype)   # (T, hd), (B, T, hd)
        if cos.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]                               # (B, 1, T, hd)
        return torch.addcmul(x * cos, x.roll(x.size(-1) // 2, dims=-1), sin)


def relative_bucket(relative_position: Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> Tensor:
    """T5's bucket for each key-minus-query offset j - i (any shape of int64). Bidirectional (encoder):
    half the buckets for keys before the query, half for keys after. Causal (decoder): only keys at or
    before the query exist, so every bucket serves them. Within a direction's n buckets, distances
    0 .. n/2 - 1 get a bucket each, and larger ones share log-spaced buckets up to `max_distance`,
    beyond which all fall in the last:

        bucket(d) = d                                                       if d < n/2
                  = min(n - 1, n/2 + ⌊log(d / (n/2)) / log(max_distance / (n/2)) · (n - n/2)⌋)  otherwise
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets      # keys after the query: upper half
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp_min(0)
    exact = num_buckets // 2
    log_ratio = torch.log(distance.float().clamp_min(1) / exact) / math.log(max_distance / exact)
    far = (exact + (log_ratio * (num_buckets - exact)).long()).clamp_max(num_buckets - 1)
    return buckets + torch.where(distance < exact, distance, far)


class RelativePositionBias(nn.Module):
    """T5's relative position bias: one learned scalar per head and distance bucket, added to the
    attention scores. One table per stack, computed once per forward and shared by all its layers;
    bidirectional in the encoder, causal in the decoder; cross-attention has none."""

    def __init__(self, n_heads: int, num_buckets: int, max_distance: int, bidirectional: bool):
        super().__init__()
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional
        self.weight = nn.Parameter(torch.empty(num_buckets, n_heads))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, t_q: int, t_k: int, offset: int = 0) -> Tensor:
        """The bias of queries at positions offset .. offset + t_q - 1 (after `offset` cached ones)
        for keys at 0 .. t_k - 1: (1, H, T_q, T_k)."""
        device = self.weight.device
        query = torch.arange(offset, offset + t_q, device=device)[:, None]
        key = torch.arange(t_k, device=device)[None, :]
        buckets = relative_bucket(key - query, self.bidirectional, self.num_buckets, self.max_distance)  # (T_q, T_k)
        return F.embedding(buckets, self.weight).permute(2, 0, 1).unsqueeze(0)   # (1, H, T_q, T_k)
