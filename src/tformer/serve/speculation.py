"""Speculative decoding inside the batch, by prompt lookup (`tformer serve --prompt-lookup N`).

A running row whose text (prompt + reply) repeats its last N tokens (else fewer) drafts the up to K
tokens that followed them there (generation/drafts.py `lookup`, as `generate(prompt_lookup=N)`). The
scheduler feeds the drafts after the row's newest token, into the row's own pool slot (pool.run: a
part of the ragged batch), and the row then takes its own next token from each position in turn
while it equals the draft fed there:

    fed:     x   d1  d2  d3        (x: the row's newest token)
    choice:  t0  t1  t2  t3        t0 from x's logits; t1 only if t0 == d1; t2 only if t1 == d2; ...

Each choice is the row's plain one (its settings, penalties, grammar and generator, in the same
order), so its text, greedy or seeded, is the one it gets without drafts: a right draft only saves
the pass its token would have needed; the keys of wrong ones lie beyond the row's length, masked.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..generation.drafts import lookup
from .sequence import Sequence


def propose(running: list[Sequence], lengths: list[int], ngram: int, k: int, max_len: int,
            metrics=None) -> dict[int, list[int]]:
    """Row i -> its drafted tokens, for the rows that find their last n-gram earlier in their text (none
    when ngram is 0): at most k each, never past the row's max_tokens or the context (lengths[i]: the
    positions its slot holds)."""
    drafts = {}
    for i, seq in enumerate(running if ngram else ()):
        room = min(k, seq.s.max_tokens - len(seq.generated) - 1, max_len - 2 - lengths[i])
        if room > 0:
            d = lookup(torch.tensor(seq.prompt + seq.generated), ngram, room).tolist()
            if d:
                drafts[i] = d
    if metrics is not None and drafts:
        metrics.drafted.inc(sum(map(len, drafts.values())))
    return drafts


def take(seq: Sequence, logits: Tensor, drafted: list[int], metrics=None) -> int:
    """The row's tokens from its step's logits (1 + m, V), after its newest token and after each of its m
    drafts: its own choice at each position, going on while the choice equals the draft fed there (so
    every logit read follows the row's true text) -> how many tokens it took (positions now filled)."""
    for j in range(len(drafted) + 1):
        token = seq.choose(logits[j])
        if seq.push(token, logits[j], metrics) or j == len(drafted) or token != drafted[j]:
            if metrics is not None and j:
                metrics.accepted.inc(j)
            return j + 1
