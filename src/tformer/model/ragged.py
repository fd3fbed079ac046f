"""A ragged batch: the new tokens of several caches in one forward pass (vLLM's and llama.cpp's batch
of decoding rows and prompt chunks together).

    part 0: a pool of n rows, one new token each        tokens  d0 d1 d2       (decoding steps)
    part 1: a prompt, its next chunk of T tokens        tokens  p0 p1 p2 p3    (a prefill chunk)
                                                          ->   ids (n + T, 1): d0 d1 d2 p0 p1 p2 p3

`model.step(ids, RaggedCache(parts), positions=(N, 1), head=False)` treats every token as a row of
length 1: the embeddings, projections, feed-forward layers and norms (nearly all of the work) run once
over all N tokens, so the weights are read once for the decoding rows and the prompt chunk together.
Only attention tells the parts apart: each layer's RaggedLayer cuts Q, K and V back into the parts'
shapes, writes each part's keys and values into its own cache, and attends within the part, as the
part would alone (`attention.inference_attention`: same paths, same masks; `positions` gives each
token its own position for the embeddings and RoPE).

A part is a cache of `rows` sequences (a model.new_cache Cache, or anything with the same `layers`
protocol, as the server's slot pool) and `tokens` new tokens per row, with an optional HF-style
attention mask (rows, cached + tokens) of 1/0 over its keys. Inference only (no gradient), causal
self-attention only: decoders without a position bias (T5's relative bias depends on the part).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .attention import causal_attention, inference_attention
from .masks import self_attention_mask


@dataclass
class Part:
    cache: object                       # .layers: one KVCache-like per layer (update -> all keys); .length
    rows: int
    tokens: int                         # new tokens per row
    attention_mask: Tensor | None = None


class RaggedLayer:
    """One layer's view of every part: attend() in place of KVCache.update + attention."""

    ragged = True
    lineage = None

    def __init__(self, layers: list, parts: list[Part], masks: list[Tensor | None]):
        self.layers, self.parts, self.masks = layers, parts, masks

    def attend(self, q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Tensor:
        """q (N, H, 1, hd), k, v (N, H_kv, 1, hd), the parts' tokens in order -> (N, 1, H·hd)."""
        outs, start = [], 0
        for layer, part, mask in zip(self.layers, self.parts, self.masks):
            end = start + part.rows * part.tokens
            qp, kp, vp = (rows_of(t[start:end], part.rows, part.tokens) for t in (q, k, v))   # (rows, ·, T, hd)
            kp, vp = layer.update(kp, vp)                                           # the part's keys so far
            causal = mask is None and part.tokens > 1
            out = causal_attention(qp, kp, vp, scale) if part.attention_mask is None else None   # (a prompt chunk)
            if out is None:
                out = inference_attention(qp, kp, vp, mask, scale, causal)
            outs.append(out.reshape(end - start, 1, -1))
            start = end
        return torch.cat(outs) if len(outs) > 1 else outs[0]


def rows_of(x: Tensor, rows: int, tokens: int) -> Tensor:
    """(rows·T, H, 1, hd), token by token -> (rows, H, T, hd), each row's tokens in order."""
    _, h, _, hd = x.shape
    return x.view(rows, tokens, h, hd).transpose(1, 2)


class RaggedCache:
    """What step() reads for a ragged batch: `.layers` (a RaggedLayer per layer), no cross-attention.
    `length` is 0: every token's position comes from step's `positions`."""

    ragged = True
    cross = None
    length = 0

    def __init__(self, parts: list[Part], device=None):
        masks = [self_attention_mask(p.tokens, p.cache.length, p.attention_mask, causal=True, device=device)
                 for p in parts]                                                 # as step() builds each alone
        self.layers = [RaggedLayer(list(layers), parts, masks) for layers in zip(*(p.cache.layers for p in parts))]
