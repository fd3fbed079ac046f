"""Speculative decoding inside the batch: by prompt lookup (`tformer serve --prompt-lookup N`) or by a
draft model (`--draft-model RUN`).

Each running row drafts up to K tokens: `Lookup` copies the ones that followed the row's last N tokens
earlier in its text (generation/drafts.py `lookup`, as `generate(prompt_lookup=N)`); `DraftModel` runs a
small decoder with the model's tokenizer K greedy steps on every drafting row at once. The scheduler
feeds the drafts after the row's newest token, into the row's own pool slot (pool.run: a part of the
ragged batch), and the row then takes its own next token from each position in turn while it equals
the draft fed there:

    fed:     x   d1  d2  d3        (x: the row's newest token)
    choice:  t0  t1  t2  t3        t0 from x's logits; t1 only if t0 == d1; t2 only if t1 == d2; ...

Each choice is the row's plain one (its settings, penalties, grammar and generator, in the same
order), so its text, greedy or seeded, is the one it gets without drafts: a right draft only saves
the pass its token would have needed; the keys of wrong ones lie beyond the row's length, masked.

The draft model keeps its own slot pool, slot for slot with the model's (`move` and `free` follow the
scheduler's). A slot holds the row's text up to its newest token at most: what the draft fed beyond
that while drafting was either taken (then it is the text) or not (then it lies beyond, cut off). Each
round feeds every drafting row's unfed tokens (a new row: its whole text) and then its newest draft,
all rows in one ragged pass (model/ragged.py) per step.
"""

from __future__ import annotations

from itertools import accumulate

import torch
from torch import Tensor

from ..generation.drafts import lookup
from ..model.plans import plan_decoding
from ..model.ragged import Part, RaggedCache
from .pool import SlotPool
from .sequence import Sequence


def rooms(running: list[Sequence], lengths: list[int], k: int, max_len: int) -> list[int]:
    """How many tokens each row may draft: k, never past its max_tokens or the context (lengths[i]: the
    positions its slot holds)."""
    return [min(k, seq.s.max_tokens - len(seq.generated) - 1, max_len - 2 - lengths[i])
            for i, seq in enumerate(running)]


def counted(drafts: dict[int, list[int]], metrics) -> dict[int, list[int]]:
    if metrics is not None and drafts:
        metrics.drafted.inc(sum(map(len, drafts.values())))
    return drafts


class Lookup:
    """Drafts by prompt lookup (none when ngram is 0): nothing kept per slot."""

    def __init__(self, ngram: int, k: int):
        self.ngram, self.k = ngram, k

    def propose(self, running: list[Sequence], lengths: list[int], max_len: int, metrics=None) -> dict[int, list[int]]:
        """Row i -> its drafted tokens, for the rows that find their last n-gram earlier in their text."""
        drafts = {}
        for i, room in enumerate(rooms(running, lengths, self.k, max_len) if self.ngram else ()):
            if room > 0:
                d = lookup(torch.tensor(running[i].prompt + running[i].generated), self.ngram, room).tolist()
                if d:
                    drafts[i] = d
        return counted(drafts, metrics)

    def prepare(self) -> None:
        pass

    def move(self, src: int, dst: int) -> None:
        pass

    def free(self, slot: int) -> None:
        pass

    def trim(self, n: int) -> None:
        pass

    def nbytes(self) -> int:
        return 0


class DraftModel:
    """Drafts by a small decoder's greedy steps, its keys and values in a slot pool of its own."""

    def __init__(self, model, k: int, max_batch: int, max_len: int):
        self.model, self.k = model, k
        self.pool = SlotPool(model, max_batch, max_len)
        self.device = self.pool.device

    def propose(self, running: list[Sequence], lengths: list[int], max_len: int, metrics=None) -> dict[int, list[int]]:
        """Row i -> the draft's greedy tokens after its text, as many as rooms() allows."""
        room, pool = rooms(running, lengths, self.k, max_len), self.pool
        texts = {i: seq.prompt + seq.generated for i, seq in enumerate(running) if room[i] > 0}
        if not texts:
            return {}
        pool.reserve(len(running), len(running), max(len(text) + room[i] for i, text in texts.items()))
        feed, drafts = {}, {i: [] for i in texts}
        for i, text in texts.items():
            pool.lengths[i] = min(pool.lengths[i], len(text) - 1)     # what agrees with the row's text
            feed[i] = text[pool.lengths[i]:]                          # the rest of it, the newest token last
        while feed:
            parts, ids, positions = [], [], []
            for i, tokens in feed.items():
                start = pool.lengths[i]
                parts.append(Part(pool.run(i, start), 1, len(tokens)))
                ids += tokens
                positions += range(start, start + len(tokens))
                pool.lengths[i] += len(tokens)
            hidden = self.model.step(torch.tensor(ids, device=self.device)[:, None], RaggedCache(parts, self.device),
                                     positions=torch.tensor(positions, device=self.device)[:, None], head=False)
            ends = torch.tensor(list(accumulate(map(len, feed.values()))), device=self.device) - 1   # rows' last
            for i, token in zip(list(feed), self.model.lm_head(hidden[ends]).argmax(-1).tolist()):
                drafts[i].append(token)
            feed = {i: [drafts[i][-1]] for i in feed if len(drafts[i]) < room[i]}
        return counted(drafts, metrics)

    def prepare(self) -> None:
        """On the thread that runs the model: the draft's decoding plans (its rows: one per running row)."""
        plan_decoding(self.model, self.pool.max_batch)

    def move(self, src: int, dst: int) -> None:
        if src < self.pool.rows:
            self.pool.move(src, dst)
        else:                              # a row that has not drafted yet: its slot is not allocated, holds nothing
            self.pool.free(dst)

    def free(self, slot: int) -> None:
        self.pool.free(slot)

    def trim(self, n: int) -> None:
        self.pool.trim(n)

    def nbytes(self) -> int:
        return self.pool.nbytes()


def drafter(draft_model, ngram: int, k: int, max_batch: int, max_len: int) -> Lookup | DraftModel:
    """Where the scheduler's drafts come from: a draft model, else prompt lookup (none when ngram is 0)."""
    return DraftModel(draft_model, k, max_batch, max_len) if draft_model is not None else Lookup(ngram, k)


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
