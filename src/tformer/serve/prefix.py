"""The prefix cache: the keys and values of prompts already prefilled, in blocks of 16 tokens, so a
prompt that starts like an earlier one copies them instead of computing them again.

    prompt   [ b0 (16 tokens) | b1 | b2 | ... | bk | the rest (< 16) ]
    key(b0) = sha256(salt)           -> key(b0, tokens of b0)
    key(bi) = sha256(key(bi-1), tokens of bi)          (vLLM's chain: a block is known by its whole prefix)

    store: key -> one block's K and V, (layers, 2, H_kv, 16, hd), read-only, least recently used first out

A block's keys and values depend on every token before it (attention mixes them in), so a block is
found by the hash of its tokens *and* of its parent's key: two prompts share block i only if they
agree on all tokens up to the end of block i. `restore` walks a new prompt's chain from the start and
copies the longest run of stored blocks into the prompt's own prefill cache (never the last prompt
token: its logits are needed, so at least one token is computed); `store` adds the prompt's full
blocks once they are prefilled. sha256 rather than Python's hash: a collision would give a request
another prompt's keys, silently. The salt keeps apart prompts whose keys differ for the same tokens
(another adapter over the same base).

Shared read-only, copied out: running rows never point into the store, so a block can be evicted at
any moment (no reference counts) and the decoding step still reads one contiguous pool (pool.py).
The store is bounded in bytes (--prefix-cache-mb); a hit chain is touched leaf first, so its first
block is the most recent and eviction takes chains from their ends (a block without its parent
could never be reached).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch
from torch import Tensor

TOKENS = 16             # tokens per block (vLLM's default block size)


class PrefixCache:
    """Blocks of prefilled keys and values, found by their prefix, at most max_bytes of them."""

    def __init__(self, max_bytes: int, tokens: int = TOKENS):
        self.max_bytes, self.tokens = max_bytes, tokens
        self.blocks: OrderedDict[bytes, Tensor] = OrderedDict()      # least recently used first
        self.block_bytes = 0                                          # known at the first block

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.block_bytes

    def __contains__(self, key: bytes) -> bool:
        return key in self.blocks

    def keys(self, prompt: list[int], salt: str = "") -> list[bytes]:
        """The chain of keys of the prompt's full blocks."""
        parent, keys = hashlib.sha256(salt.encode()).digest(), []
        for start in range(0, len(prompt) - self.tokens + 1, self.tokens):
            parent = hashlib.sha256(parent + array("q", prompt[start:start + self.tokens]).tobytes()).digest()
            keys.append(parent)
        return keys

    def restore(self, prompt: list[int], keys: list[bytes], cache) -> int:
        """Copy the longest stored chain of the prompt's blocks into `cache` (a batch-1 attention.Cache,
        empty) and set its length; returns the positions restored (< len(prompt))."""
        chain = []
        for key in keys:
            block = self.blocks.get(key)
            if block is None:
                break
            chain.append(block)
        t = min(len(chain) * self.tokens, len(prompt) - 1)
        if t == 0:
            return 0
        self._touch(keys[:len(chain)])
        kv = torch.cat(chain, dim=3)                                   # (layers, 2, H_kv, blocks·16, hd)
        for i, layer in enumerate(cache.layers):
            layer.k[0, :, :t] = kv[i, 0, :, :t]
            layer.v[0, :, :t] = kv[i, 1, :, :t]
            layer.length = t
        return t

    def store(self, keys: list[bytes], cache, filled: int) -> None:
        """Add the blocks of `keys` that lie within the first `filled` positions of `cache` and are not
        stored yet (as many as the bound allows: never evicting this prompt's own chain)."""
        full = min(filled // self.tokens, len(keys))
        if self.block_bytes == 0:
            k = cache.layers[0].k
            self.block_bytes = 2 * len(cache.layers) * k.size(1) * self.tokens * k.size(3) * k.element_size()
        room = self.max_bytes // self.block_bytes
        for b in range(min(full, room)):
            if keys[b] in self.blocks:
                continue
            if len(self.blocks) >= room:
                self.blocks.popitem(last=False)
            s = slice(b * self.tokens, (b + 1) * self.tokens)
            k = cache.layers[0].k
            block = k.new_empty((len(cache.layers), 2, k.size(1), self.tokens, k.size(3)))
            for i, layer in enumerate(cache.layers):
                block[i, 0], block[i, 1] = layer.k[0, :, s], layer.v[0, :, s]
            self.blocks[keys[b]] = block
        self._touch(keys[:min(full, room)])

    def _touch(self, chain: list[bytes]) -> None:
        """Mark a chain used, its first block last: the most recent, evicted after its descendants."""
        for key in reversed(chain):
            if key in self.blocks:
                self.blocks.move_to_end(key)
