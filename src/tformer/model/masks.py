"""Attention masks. Convention everywhere inside tformer: a bool tensor, True = may attend.

Users pass Hugging Face style `attention_mask` (1 = real token, 0 = padding); `padding_mask`
turns it into this convention. Masks broadcast against scores of shape (B, H, T_q, T_k).

Causal mask for T = 4 (row = query i, column = key j; True where j <= i):

    j: 0 1 2 3
  i=0  1 0 0 0
  i=1  1 1 0 0
  i=2  1 1 1 0
  i=3  1 1 1 1
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_mask(t_q: int, t_k: int | None = None, device=None) -> Tensor:
    """(T_q, T_k) lower-triangular mask. With a cache, T_k > T_q: query i is position i + T_k - T_q."""
    t_k = t_q if t_k is None else t_k
    q_pos = torch.arange(t_k - t_q, t_k, device=device)[:, None]
    return torch.arange(t_k, device=device)[None, :] <= q_pos


def with_causal(mask: Tensor | None, t_q: int, t_k: int, device=None) -> Tensor:
    """`mask` AND the causal mask of the last t_q of t_k positions: what `is_causal=True` means."""
    causal = causal_mask(t_q, t_k, device=device)
    return causal if mask is None else mask & causal


def padding_mask(attention_mask: Tensor) -> Tensor:
    """HF (B, T_k) mask of 1/0 -> (B, 1, 1, T_k) bool, True on real tokens (the keys one may attend to)."""
    return attention_mask.bool()[:, None, None, :]


def combine(*masks: Tensor | None) -> Tensor | None:
    """AND of the given masks (None = no constraint). Rows with no allowed key are opened fully so
    softmax never sees a row of only -inf (that would give NaN); such rows belong to padding
    queries whose outputs are ignored anyway."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    mask = present[0]
    for m in present[1:]:
        mask = mask & m
    return mask | ~mask.any(dim=-1, keepdim=True)


def segment_mask(segments: Tensor) -> Tensor:
    """(B, T) segment ids of packed rows (conversations one after another; 0 = padding) -> (B, 1, T, T)
    bool, True where query and key are in the same segment: attention stays within each one.

        segments  1 1 2 2 2 0      (with the causal mask: one triangle per segment)
    """
    return (segments[:, :, None] == segments[:, None, :])[:, None]


def self_attention_mask(t: int, offset: int, attention_mask: Tensor | None, causal: bool,
                        device=None) -> Tensor | None:
    """Bool mask for self-attention over `offset` cached + `t` new positions, or None when the fused
    kernel needs none (no padding, and causal-from-position-0 or a single new token).
    `attention_mask`: HF's (B, offset + t) of 1/0, or a bool (B, 1, t, offset + t) mask of its own
    (packed rows: `segment_mask`), ANDed with the causal one."""
    if attention_mask is None and (not causal or offset == 0 or t == 1):
        return None
    causal_part = causal_mask(t, offset + t, device=device) if causal else None
    if attention_mask is None:
        pad = None
    else:
        pad = attention_mask if attention_mask.dim() == 4 else padding_mask(attention_mask)
    return combine(causal_part, pad)


def padded(attention_mask: Tensor | None) -> bool:
    """Whether an HF-style attention_mask marks any padding."""
    return attention_mask is not None and not bool(attention_mask.all())


class Packing:
    """The real tokens of a padded batch, for running the token-wise layers (projections, FFN,
    norms: most of an encoder's work) on them alone. Attention unpacks to (B, T, ·) rows, with
    zeros at the padding (masked as keys; outputs at padded queries are dropped), and repacks.

        (B, T, D)  --pack-->  (N, D), N = number of 1s in the HF attention_mask  --unpack--> (B, T, D)
    """

    def __init__(self, attention_mask: Tensor):
        self.shape = attention_mask.shape                                        # (B, T)
        self.index = attention_mask.flatten().nonzero().squeeze(1)               # (N,) positions of real tokens
        self.starts = F.pad(attention_mask.ne(0).sum(1).cumsum(0), (1, 0))       # (B + 1,): row b's are [starts[b],
                                                                                 # starts[b + 1]) of the N

    def pack(self, x: Tensor) -> Tensor:
        return x.flatten(0, 1).index_select(0, self.index)

    def unpack(self, x: Tensor) -> Tensor:
        full = x.new_zeros(self.shape[0] * self.shape[1], x.size(-1))
        return full.index_copy_(0, self.index, x).view(*self.shape, x.size(-1))

