"""The KV cache: keys and values of the positions already processed, kept for the next decoding steps.

    KVCache       one self-attention layer's K, V: (B, H_kv, T_max, hd), filled left to right
    CrossKVCache  one encoder-decoder layer's cross-attention K, V, computed once per source
    Cache         all of one model's caches for one batch (model.new_cache)
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import gemv


class KVCache:
    """Preallocated keys and values of one self-attention layer, filled left to right.

        k, v: (B, H_kv, T_max, hd)
              slot:  0 1 2 ... length-1 | length ... T_max-1
                     [ cached keys      ] [ free            ]

    `update` writes the new positions at [length, length + T) and returns the filled part, so the
    same attention code serves the prompt (prefill, T = prompt length) and each new token (T = 1).

    Beam search continues row index[i] in row i after each step (`reorder`). Where tformer's decoding
    kernel reads the cache (fp32 on a CPU where it is built) nothing moves: `lineage` (B, T_max)
    records which row's slot holds each position of each row's sequence,

        lineage[i, :length] = lineage[index[i], :length]     (reorder)
        lineage[i, length]  = i                              (update: each row writes its own slot)

    and the kernel follows it (gemv.attend); other readers get the keys in row order from
    `follow_lineage`. Elsewhere the filled positions are copied into beam order at every step.
    """

    ragged = False                      # one cache for every row (ragged.RaggedLayer: several)

    def __init__(self, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int, dtype=None, device=None):
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0
        self.lineage: Tensor | None = None                      # (B, T_max) int32 once reordered in place
        self.spare: tuple[Tensor, Tensor] | None = None        # beam search's reorder writes here

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        start, end = self.length, self.length + k.size(2)
        if end > self.k.size(2):
            raise ValueError(f"KV cache is full: {end} positions needed, {self.k.size(2)} allocated")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        if self.lineage is not None:
            self.lineage[:, start:end] = self._own_rows()
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def _own_rows(self) -> Tensor:
        return torch.arange(self.k.size(0), dtype=torch.int32, device=self.k.device)[:, None]

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows `index` (beam search: continue the beams that survived). With the
        decoding kernel: in `lineage` only. Otherwise only the filled positions move, into a second
        pair of buffers kept for this (a fresh one each step would cost page faults: half of the time
        of the gather itself); the two pairs then swap."""
        n = self.length
        if index.size(0) != self.k.size(0):
            self.settle()
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)
            self.spare = None
            return
        if self.k.device.type == "cpu" and self.k.dtype == torch.float32 and gemv.available():
            if self.lineage is None:
                self.lineage = torch.empty(self.k.shape[:1] + self.k.shape[2:3], dtype=torch.int32)
                self.lineage[:, :n] = self._own_rows()
            self.lineage[:, :n] = self.lineage[:, :n].index_select(0, index)
            return
        if self.spare is None:
            self.spare = (torch.empty_like(self.k), torch.empty_like(self.v))
        k, v = self.spare
        torch.index_select(self.k[:, :, :n], 0, index, out=k[:, :, :n])
        torch.index_select(self.v[:, :, :n], 0, index, out=v[:, :, :n])
        self.spare, self.k, self.v = (self.k, self.v), k, v

    def settle(self) -> None:
        """Move the filled positions into row order and drop the lineage."""
        if self.lineage is not None:
            n = self.length
            lineage, self.lineage = self.lineage[:, :n], None
            self.k[:, :, :n], self.v[:, :, :n] = follow_lineage(self.k[:, :, :n], self.v[:, :, :n], lineage)


def follow_lineage(k: Tensor, v: Tensor, lineage: Tensor) -> tuple[Tensor, Tensor]:
    """Keys and values (B, H_kv, T, hd) as KVCache holds them, and its lineage (B, T) -> the same in
    row order: position j of row b from row lineage[b, j]."""
    index = lineage.long()[:, None, :, None].expand_as(k)
    return k.gather(0, index), v.gather(0, index)


class CrossKVCache:
    """Keys and values of encoder-decoder attention: computed from the encoder output once per
    sequence, then reused at every decoding step."""

    def __init__(self):
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def reorder(self, index: Tensor) -> None:
        if self.k is not None:
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)


class Cache:
    """All the caches of one model for one batch of sequences: a KVCache per decoder layer and, for
    an encoder-decoder, a CrossKVCache per layer. `length` = positions already processed."""

    ragged = False

    def __init__(self, layers: list[KVCache], cross: list[CrossKVCache] | None = None):
        self.layers, self.cross = layers, cross

    @property
    def length(self) -> int:
        return self.layers[0].length

    def reorder(self, index: Tensor) -> None:
        for c in self.layers + (self.cross or []):
            c.reorder(index)

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (speculative decoding: the drafted tokens the model
        rejected); the next update writes over their slots. Cross-attention K, V stay."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        for c in self.layers:
            c.length = length
