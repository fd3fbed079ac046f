"""One forward pass per generation step, for either model family, with or without the KV cache.

    with cache:    step 0 (prefill) feeds the whole prompt; step n feeds only the newest token,
                   whose keys/values join the cache. Same forward either way.
    without cache: every step feeds the whole sequence so far (slow; the reference behaviour).

Left padding (Decoder): rows of a batch have prompts of different lengths, padded on the left so
that every row's next token is at the same column:

    row 0:  [pad pad  a   b ] c ...     attention_mask 0 0 1 1 | 1 ...
    row 1:  [ x   y   z   w ] v ...     attention_mask 1 1 1 1 | 1 ...

Pads are masked out as keys, and positions count real tokens only (cumsum(mask) - 1, as in HF),
so row 0 computes exactly what it would alone.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..model.linear import Linear
from .processors import greedy


class Stepper:
    """next_logits(seqs, cur_len) -> (N, V) logits for the token at column cur_len."""

    def __init__(self, model, n_rows: int, max_len: int, use_cache: bool, attention_mask: Tensor | None = None,
                 memory: Tensor | None = None, src_mask: Tensor | None = None):
        self.model, self.use_cache = model, use_cache
        self.memory, self.src_mask = memory, src_mask
        self.cache = model.new_cache(n_rows, max_len) if use_cache else None
        self.fed = 0                                   # columns already in the cache
        self.mask = self.positions = None
        if attention_mask is not None:
            # (N, max_len): the prompt's mask, then 1 for every generated column
            pad = attention_mask.new_ones(n_rows, max_len - attention_mask.size(1))
            self.mask = torch.cat([attention_mask, pad], dim=1)
            self.positions = (self.mask.long().cumsum(-1) - 1).clamp(min=0)

    def next_logits(self, seqs: Tensor, cur_len: int, head: bool = True) -> Tensor:
        """(N, V) logits for the token at column cur_len; head=False: the (N, D) hidden states."""
        start = self.fed if self.use_cache else 0
        ids = seqs[:, start:cur_len]                                             # (N, T_new)
        mask = self.mask[:, :cur_len] if self.mask is not None else None
        positions = self.positions[:, start:cur_len] if self.positions is not None else None
        out = self.model.step(ids, self.cache, mask, positions, self.memory, self.src_mask, head=head)
        self.fed = cur_len
        return out

    def next_greedy(self, seqs: Tensor, cur_len: int) -> Tensor:
        """(N,) greedy tokens for column cur_len: from the output layer's argmax where it can give
        one without all the logits (linear.Gemv.argmax: exact, half the bytes), else greedy(logits)."""
        return greedy_tokens(self.model, self.next_logits(seqs, cur_len, head=False))

    def reorder(self, index: Tensor) -> None:
        """Beam search: row i continues from row index[i]. Only self-attention caches move: the
        cross-attention K, V and the masks are identical for all beams of one input."""
        if self.cache is not None:
            for layer in self.cache.layers:
                layer.reorder(index)


def greedy_tokens(model, hidden: Tensor) -> Tensor:
    """(R, D) hidden states (model.step(..., head=False)) -> (R,) the argmax of their logits: the output
    layer's exact argmax where its plan gives one (Linear.argmax), else greedy(logits)."""
    head = model.lm_head
    tokens = head.argmax(hidden) if isinstance(head, Linear) else None
    return tokens if tokens is not None else greedy(head(hidden).float())
