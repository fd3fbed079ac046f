"""The server's KV cache for the running rows: one pool, grown and shrunk with what the rows hold.

    self-attention K (and V) of each layer: (rows, H_kv, time, hd), rows <= max_batch, time <= max_len

        slot 0  [ row 0: 9 positions          | free ]    lengths = [9, 4, 6]
        slot 1  [ row 1: 4    | free ................ ]    n = 3 running rows,
        slot 2  [ row 2: 6          | free .......... ]    always in slots 0..n-1
        slot 3  [ free ............................... ]    rows = 4 (a power of two), time = 64 x k

A decoding step feeds one token per row. `view(n)` is the Cache the model's step() reads: each
row's new key and value go to its own position lengths[i]; attention sees slots [:n] up to the
longest row (one strided view: no gather), and `mask(n)` hides every row's tail beyond its own
length (a row's drafted tokens, with --prompt-lookup, go into its own slot after it: `run(i, start)`,
and `advance` then counts the ones it took). A row that finishes is replaced by the last row (`move`:
one copy per finish), so running rows stay compacted and a step costs what its n rows need, not
max_batch.

Memory follows the rows: `reserve` grows the pool when a row joins or the longest row reaches the
end (rows to the next power of two, time to the longest + a quarter, in blocks of 64 positions),
`trim` shrinks it once it has held twice what the rows need for SHRINK_AFTER steps in a row (every
row gone: at once, to nothing), so steady traffic keeps one size. A resize copies the running rows'
filled positions once into new tensors and zeroes their new tail; free slots stay untouched until
`admit` writes one (fresh memory costs page faults: touched only where a row is). Growing by a
quarter makes that one copy per ~longest/4 steps. The bound is --max-batch x the context, the
fixed reservation of a pool that never changes size.

Keys and values are kept in the model's dtype, or in bf16 (`kv_dtype`, `tformer serve --kv-cache-dtype
bf16`: half the bytes to hold and to read a step; the decoding kernel widens them as it reads, other
paths convert a part's keys to the queries' dtype: attention.py).

An encoder-decoder also keeps, per slot, the encoder output (`memory`, (rows, S, D)) and its
cross-attention K and V ((rows, H_kv, S, hd) per layer), computed once at admission and sized
the same way by the longest source; `src_mask(n)` hides each row's source padding.
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 64              # the pool's time dimension is a multiple of this many positions
SHRINK_AFTER = 64       # steps the pool must be twice too large before it shrinks (not at every dip)


class SlotLayer:
    """One layer's self-attention cache over the pool (the KVCache protocol: update -> all keys)."""

    lineage = None                      # every row holds its own positions (attention.KVCache)
    ragged = False

    def __init__(self, k: Tensor, v: Tensor):
        self.k, self.v = k, v
        self.rows = self.pos = None     # set by PoolCache for each step
        self.end = 0

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v: (n, H_kv, 1, hd), the new token of each row -> (n, H_kv, longest + 1, hd)."""
        self.k[self.rows, :, self.pos] = k[:, :, 0].to(self.k.dtype)              # (n, H_kv, hd) each
        self.v[self.rows, :, self.pos] = v[:, :, 0].to(self.v.dtype)
        n = self.rows.numel()
        return self.k[:n, :, :self.end], self.v[:n, :, :self.end]


class SlotCross:
    """One layer's cross-attention K and V (the CrossKVCache protocol: k, v already set)."""

    def __init__(self, k: Tensor, v: Tensor):
        self.all_k, self.all_v = k, v
        self.k = self.v = None


class PoolCache:
    """What step() sees for the first n slots: `.layers`, `.cross`, `.length` as in attention.Cache."""

    ragged = False

    def __init__(self, pool: "SlotPool", n: int):
        self.layers, self.cross = pool.layers, pool.cross
        rows, pos = torch.arange(n, device=pool.device), pool.positions(n)[:, 0]      # (n,) each
        for layer in self.layers:
            layer.rows, layer.pos, layer.end = rows, pos, pool.longest(n) + 1
        s = pool.longest_source(n)
        for c in self.cross or []:
            c.k, c.v = c.all_k[:n, :, :s], c.all_v[:n, :, :s]
        self.length = pool.longest(n)   # keys before this step: self_attention_mask's offset


class SlotView:
    """`.layers` of one slot, as a batch-1 attention.Cache has them (k, v: (1, H_kv, time, hd))."""

    def __init__(self, layers: list[SlotLayer]):
        self.layers = layers


class SlotRun:
    """One layer's cache for a run of new tokens in one slot from position `start` on (the KVCache
    protocol: update writes them and returns the slot's keys up to the last one)."""

    lineage = None
    ragged = False

    def __init__(self, k: Tensor, v: Tensor, slot: int, start: int):
        self.k, self.v, self.slot, self.start = k, v, slot, start

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v: (1, H_kv, T, hd) -> the slot's (1, H_kv, start + T, hd)."""
        i, end = self.slot, self.start + k.size(2)
        self.k[i, :, self.start:end] = k[0]
        self.v[i, :, self.start:end] = v[0]
        return self.k[i:i + 1, :, :end], self.v[i:i + 1, :, :end]


class RunCache:
    """A batch-1 cache over slot i holding `length` positions: what step() reads for new tokens there."""

    def __init__(self, layers: list[SlotLayer], slot: int, length: int):
        self.layers = [SlotRun(layer.k, layer.v, slot, length) for layer in layers]
        self.length = length


def resized(t: Tensor, rows: int, time: int, dim: int, live: int, keep: int) -> Tensor:
    """A tensor like t with `rows` rows and `time` along `dim`: the live rows [:live] hold t's first
    `keep` positions, then zeros (a masked key is still read: it must be a finite number). The other
    rows are left unwritten (admit writes a slot whole), so fresh memory is touched only where used."""
    shape = list(t.shape)
    shape[0], shape[dim] = rows, time
    new = t.new_empty(shape)
    new[:live].narrow(dim, 0, keep).copy_(t[:live].narrow(dim, 0, keep))
    new[:live].narrow(dim, keep, time - keep).zero_()
    return new


def rows_for(n: int) -> int:
    return 0 if n == 0 else 1 << (n - 1).bit_length()                     # the next power of two


def time_for(need: int) -> int:
    return 0 if need == 0 else -(-(need + need // 4) // BLOCK) * BLOCK     # + a quarter, in blocks


class SlotPool:
    def __init__(self, model, max_batch: int, max_len: int, kv_dtype: torch.dtype | None = None):
        empty = model.new_cache(0, 0)                          # dtype and device as the model decodes
        dtype = empty.layers[0].k.dtype                         # the model's: the encoder output's below
        self.layers = [SlotLayer(c.k.to(kv_dtype or dtype), c.v.to(kv_dtype or dtype)) for c in empty.layers]
        self.lengths = [0] * max_batch                          # positions filled, per slot
        self.max_batch, self.max_len = max_batch, max_len
        self.device = empty.layers[0].k.device
        self.cross = self.memory = None
        self.src_lengths = [0] * max_batch
        if model.is_encoder_decoder:
            k = self.layers[0].k
            self.cross = [SlotCross(torch.zeros_like(k), torch.zeros_like(k)) for _ in empty.layers]
            self.memory = torch.zeros(0, 0, model.cfg.d_model, dtype=dtype, device=self.device)
        self.rows = self.time = self.src_time = 0               # what is allocated
        self.oversized = 0                                      # trims in a row that found it twice too large

    # --- memory -----------------------------------------------------------------------------
    def nbytes(self) -> int:
        tensors = [t for layer in self.layers for t in (layer.k, layer.v)]
        if self.cross is not None:
            tensors += [t for c in self.cross for t in (c.all_k, c.all_v)] + [self.memory]
        return sum(t.numel() * t.element_size() for t in tensors)

    def reserve(self, live: int, rows: int, time: int, src_time: int = 0) -> None:
        """Room for `rows` slots of `time` positions (and sources of src_time), `live` rows running now:
        grows, never shrinks."""
        if rows > self.rows or time > self.time or src_time > self.src_time:
            self._resize(live, max(self.rows, min(rows_for(rows), self.max_batch)),
                         self.time if time <= self.time else min(time_for(time), self.max_len),
                         self.src_time if src_time <= self.src_time else min(time_for(src_time), self.max_len))

    def trim(self, n: int) -> None:
        """After a step: shrink to what the n running rows need once the pool has held twice that for
        SHRINK_AFTER steps (hysteresis: no copies back and forth as rows come and go)."""
        if n == 0:
            if self.rows:
                self._resize(0, 0, 0, 0)
            return
        need = (min(rows_for(n), self.max_batch), min(time_for(self.longest(n) + 1), self.max_len),
                min(time_for(self.longest_source(n)), self.max_len))
        have = (self.rows, self.time, self.src_time)
        self.oversized = self.oversized + 1 if any(2 * w <= h and w < h for w, h in zip(need, have)) else 0
        if self.oversized >= SHRINK_AFTER:
            self._resize(n, *need)

    def _resize(self, live: int, rows: int, time: int, src_time: int) -> None:
        """New tensors holding the `live` rows' filled positions (no more: a copy costs what it moves); rows
        not allocated yet hold nothing (a draft model's pool grows when its rows first draft)."""
        live = min(live, self.rows)
        t, s = self.longest(live), self.longest_source(live)
        for layer in self.layers:
            layer.k = resized(layer.k, rows, time, 2, live, t)
            layer.v = resized(layer.v, rows, time, 2, live, t)
        if self.cross is not None:
            self.memory = resized(self.memory, rows, src_time, 1, live, s)
            for c in self.cross:
                c.all_k = resized(c.all_k, rows, src_time, 2, live, s)
                c.all_v = resized(c.all_v, rows, src_time, 2, live, s)
        self.rows, self.time, self.src_time = rows, time, src_time
        self.oversized = 0

    # --- what a step reads --------------------------------------------------------------------
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
        """The cache of a step of the first n rows (grown first if the longest row is at the end)."""
        self.reserve(n, n, self.longest(n) + 1)
        return PoolCache(self, n)

    def memory_view(self, n: int) -> Tensor:
        return self.memory[:n, :self.longest_source(n)]

    def run(self, i: int, start: int) -> RunCache:
        """Slot i's cache for tokens written from position `start` on (the drafted tokens a step checks
        after a row's newest one); reserve room for them first."""
        return RunCache(self.layers, i, start)

    def advance(self, n: int, filled: list[int] | None = None) -> None:
        """After a step: every running row holds one more position (or filled[i] more)."""
        for i in range(n):
            self.lengths[i] += 1 if filled is None else filled[i]

    # --- rows joining and leaving -------------------------------------------------------------
    def admit(self, slot: int, cache, memory: Tensor | None = None) -> None:
        """Copy one prefilled sequence (a batch-1 attention.Cache from model.new_cache, and for an
        encoder-decoder its memory (1, S, D)) into `slot`, the first free one; the rest of the slot
        is zeroed (read as masked keys: finite numbers, whatever the memory held before)."""
        t = cache.length
        self.reserve(slot, slot + 1, min(t + 1, self.max_len), memory.size(1) if memory is not None else 0)
        for layer, c in zip(self.layers, cache.layers):
            layer.k[slot, :, :t] = c.k[0, :, :t]
            layer.v[slot, :, :t] = c.v[0, :, :t]
            layer.k[slot, :, t:] = layer.v[slot, :, t:] = 0
        self.lengths[slot] = t
        if memory is not None:
            s = memory.size(1)
            self.memory[slot, :s], self.memory[slot, s:] = memory[0], 0
            for pooled, c in zip(self.cross, cache.cross):
                pooled.all_k[slot, :, :s], pooled.all_k[slot, :, s:] = c.k[0], 0
                pooled.all_v[slot, :, :s], pooled.all_v[slot, :, s:] = c.v[0], 0
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

    def slot(self, i: int) -> "SlotView":
        """Slot i's keys and values as a batch-1 cache's layers (views, no copy), for prefix.store."""
        return SlotView([SlotLayer(layer.k[i:i + 1], layer.v[i:i + 1]) for layer in self.layers])

    def free(self, slot: int) -> None:
        self.lengths[slot] = self.src_lengths[slot] = 0
