"""The server's KV cache: one pool of slots, allocated once, shared by the running requests.

    self-attention K (and V) of each layer: (max_batch, H_kv, max_len, hd)

        slot 0  [ row 0: 9 positions          | free ...... ]    lengths = [9, 4, 6]
        slot 1  [ row 1: 4    | free ...................... ]    n = 3 running rows,
        slot 2  [ row 2: 6          | free ................ ]    always in slots 0..n-1
        slot 3  [ free ..................................... ]

A decoding step feeds one token per row. `view(n)` is the Cache the model's step() reads: each
row's new key and value go to its own position lengths[i]; attention sees slots [:n] up to the
longest row, and `mask(n)` hides every row's tail beyond its own length. A row that finishes is
replaced by the last row (`move`: one copy per finish), so running rows stay compacted and a step
costs what its n rows need, not max_batch.

An encoder-decoder also keeps, per slot, the encoder output (`memory`, (max_batch, S_max, D)) and
its cross-attention K and V ((max_batch, H_kv, S_max, hd) per layer), computed once at admission;
`src_mask(n)` hides each row's source padding.
"""

from __future__ import annotations

import torch
from torch import Tensor


class SlotLayer:
    """One layer's self-attention cache over the pool (the KVCache protocol: update -> all keys)."""

    lineage = None                      # every row holds its own positions (attention.KVCache)

    def __init__(self, k: Tensor, v: Tensor):
        self.k, self.v = k, v
        self.rows = self.pos = None     # set by PoolCache for each step
        self.end = 0

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v: (n, H_kv, 1, hd), the new token of each row -> (n, H_kv, longest + 1, hd)."""
        self.k[self.rows, :, self.pos] = k[:, :, 0]                                # (n, H_kv, hd) each
        self.v[self.rows, :, self.pos] = v[:, :, 0]
        n = self.rows.numel()
        return self.k[:n, :, :self.end], self.v[:n, :, :self.end]


class SlotCross:
    """One layer's cross-attention K and V (the CrossKVCache protocol: k, v already set)."""

    def __init__(self, k: Tensor, v: Tensor):
        self.all_k, self.all_v = k, v
        self.k = self.v = None


class PoolCache:
    """What step() sees for the first n slots: `.layers`, `.cross`, `.length` as in attention.Cache."""

    def __init__(self, pool: "SlotPool", n: int):
        self.layers, self.cross = pool.layers, pool.cross
        rows, pos = torch.arange(n, device=pool.device), pool.positions(n)[:, 0]      # (n,) each
        for layer in self.layers:
            layer.rows, layer.pos, layer.end = rows, pos, pool.longest(n) + 1
        s = pool.longest_source(n)
        for c in self.cross or []:
            c.k, c.v = c.all_k[:n, :, :s], c.all_v[:n, :, :s]
        self.length = pool.longest(n)   # keys before this step: self_attention_mask's offset


class SlotPool:
    def __init__(self, model, max_batch: int, max_len: int):
        full = model.new_cache(max_batch, max_len)            # dtype and device as the model decodes
        self.layers = [SlotLayer(c.k, c.v) for c in full.layers]
        self.lengths = [0] * max_batch                          # positions filled, per slot
        self.max_batch, self.max_len = max_batch, max_len
        self.device = full.layers[0].k.device
        self.cross = self.memory = None
        self.src_lengths = [0] * max_batch
        if model.is_encoder_decoder:
            k = full.layers[0].k
            self.cross = [SlotCross(torch.zeros_like(k), torch.zeros_like(k)) for _ in full.layers]
            self.memory = torch.zeros(max_batch, max_len, model.cfg.d_model, dtype=k.dtype, device=self.device)

    def longest(self, n: int) -> int:
        return max(self.lengths[:n], default=0)

    def longest_source(self, n: int) -> int:
        return max(self.src_lengths[:n], default=0)

    def positions(self, n: int) -> Tensor:
        """(n, 1): where each row's next token goes."""
        return torch.tensor(self.lengths[:n], device=self.device)[:, None]

    def mask(self, n: int) -> Tensor:
        """(n, longest + 1) of 1/0: row i's keys are its own positions 0..lengths[i] (the new token included)."""
        keys = torch.arange(self.longest(n) + 1, device=self.device)
        return (keys[None, :] <= self.positions(n)).long()

    def src_mask(self, n: int) -> Tensor:
        """(n, longest source) of 1/0: row i's real source tokens."""
        keys = torch.arange(self.longest_source(n), device=self.device)
        return (keys[None, :] < torch.tensor(self.src_lengths[:n], device=self.device)[:, None]).long()

    def view(self, n: int) -> PoolCache:
        return PoolCache(self, n)

    def memory_view(self, n: int) -> Tensor:
        return self.memory[:n, :self.longest_source(n)]

    def advance(self, n: int) -> None:
        """After a step: every running row holds one more position."""
        for i in range(n):
            self.lengths[i] += 1

    def admit(self, slot: int, cache, memory: Tensor | None = None) -> None:
        """Copy one prefilled sequence (a batch-1 attention.Cache from model.new_cache, and for an
        encoder-decoder its memory (1, S, D)) into `slot`."""
        t = cache.length
        for layer, c in zip(self.layers, cache.layers):
            layer.k[slot, :, :t] = c.k[0, :, :t]
            layer.v[slot, :, :t] = c.v[0, :, :t]
        self.lengths[slot] = t
        if memory is not None:
            s = memory.size(1)
            self.memory[slot, :s] = memory[0]
            for pooled, c in zip(self.cross, cache.cross):
                pooled.all_k[slot, :, :s] = c.k[0]
                pooled.all_v[slot, :, :s] = c.v[0]
            self.src_lengths[slot] = s

    def move(self, src: int, dst: int) -> None:
        """Slot `src`'s contents into slot `dst` (the last running row fills a finished row's slot)."""
        t, s = self.lengths[src], self.src_lengths[src]
        for layer in self.layers:
            layer.k[dst, :, :t] = layer.k[src, :, :t]
            layer.v[dst, :, :t] = layer.v[src, :, :t]
        if self.cross is not None:
            self.memory[dst, :s] = self.memory[src, :s]
            for c in self.cross:
                c.all_k[dst, :, :s] = c.all_k[src, :, :s]
                c.all_v[dst, :, :s] = c.all_v[src, :, :s]
        self.lengths[dst], self.src_lengths[dst] = t, s
        self.lengths[src] = self.src_lengths[src] = 0

    def free(self, slot: int) -> None:
        self.lengths[slot] = self.src_lengths[slot] = 0
