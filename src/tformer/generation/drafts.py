"""Where speculative decoding's proposals come from (speculative.py checks them).

    ModelDraft    a smaller decoder with the same vocabulary: k steps of its own, greedy or sampled from
                  its processed distribution q, with its own KV cache kept across rounds
    PromptLookup  no second model: the tokens that followed the last n-gram where it occurred before in
                  prompt + generated text (HF's prompt_lookup_num_tokens, vLLM's ngram speculator);
                  q is one-hot: the proposal is certain

Both write their proposals into the sequence buffer after the known tokens (seqs[:, cur:cur + m]),
where the model reads them, and return them with q (m, V), or None for a certain proposal.
`rewind(length)` forgets every position from `length` on: the tokens the model rejected.

`processed` / `probabilities` are the one place the settings turn logits into what is chosen from,
for the draft's q and the model's p alike (as plain sampling does: process_logits, then choose's guard).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .processors import process_logits
from .sampling import choose, screen
from .settings import Settings
from .stepper import Stepper


def processed(logits: Tensor, seen: Tensor | None, s: Settings) -> Tensor:
    """(R, V) float logits -> the processed ones plain decoding would choose from (penalty always;
    temperature, top-k, top-p, min-p when sampling). seen: (R, V) bool or None."""
    return process_logits(logits, seen, do_sample=not s.greedy, temperature=s.temperature, top_k=s.top_k,
                          top_p=s.top_p, min_p=s.min_p, repetition_penalty=s.repetition_penalty)


def probabilities(processed: Tensor, raw: Tensor) -> Tensor:
    """(R, V) processed logits -> the distribution plain sampling draws from, with sampling.choose's
    guard: NaN never drawn, +inf shares the draw, a row with nothing finite is certain of the argmax
    of its raw logits."""
    x, ok = screen(processed)
    probs = x.softmax(dim=-1)
    if not bool(ok.all()):
        certain = torch.zeros_like(probs).scatter_(-1, choose(raw, False)[:, None].to(probs.device), 1.0)
        probs = torch.where(ok[:, None], probs, certain)
    return probs


def seen_rows(seen: Tensor | None, tokens: Tensor) -> Tensor | None:
    """The repetition penalty's `seen` (1, V) for each of m + 1 positions: row i also has tokens[:i]."""
    if seen is None:
        return None
    rows = seen.expand(tokens.numel() + 1, -1).clone()                        # (m + 1, V)
    for i, t in enumerate(tokens.tolist()):
        rows[i + 1:, t] = True
    return rows


class ModelDraft:
    """Proposals from `model` (a decoder with the caller's vocabulary), one sequence of up to
    `max_len` tokens: its steps run as plain decoding's do (greedy: Stepper.next_greedy's argmax)."""

    def __init__(self, model, max_len: int):
        self.stepper = Stepper(model, 1, max_len, use_cache=True)

    def propose(self, seqs: Tensor, cur: int, k: int, s: Settings, seen: Tensor | None,
                generator: torch.Generator | None) -> tuple[Tensor, Tensor | None]:
        """k tokens after seqs[:, :cur], written to seqs[:, cur:cur + k]; -> (k,) and q (k, V), None when greedy."""
        plain_greedy = s.greedy and (s.repetition_penalty == 1.0 or seen is None)
        seen = seen.clone() if seen is not None else None
        qs = []
        for i in range(k):
            if plain_greedy:
                token = self.stepper.next_greedy(seqs, cur + i)                              # (1,)
            else:
                logits = self.stepper.next_logits(seqs, cur + i).float()                     # (1, V)
                x = processed(logits, seen, s)
                if s.greedy:
                    token = choose(x, False, raw=logits)
                else:
                    qs.append(probabilities(x, logits))
                    token = torch.multinomial(qs[-1], 1, generator=generator)[:, 0]
            seqs[:, cur + i] = token
            if seen is not None:
                seen[0, token] = True
        return seqs[0, cur:cur + k].clone(), torch.cat(qs) if qs else None

    def rewind(self, length: int) -> None:
        """Keep the cached positions before `length` (the rest held rejected or unchecked tokens)."""
        cache = self.stepper.cache
        cache.truncate(min(length, cache.length))
        self.stepper.fed = cache.length


class PromptLookup:
    """Proposals copied from the text itself: find the last `ngram` tokens (else fewer, down to one)
    earlier in seqs[:, :cur] and propose the k tokens after that occurrence: the latest one with k
    tokens after it, else the earliest (the longest copy)."""

    def __init__(self, ngram: int):
        self.ngram = ngram

    def propose(self, seqs: Tensor, cur: int, k: int, s: Settings, seen: Tensor | None,
                generator: torch.Generator | None) -> tuple[Tensor, None]:
        tokens = lookup(seqs[0, :cur], self.ngram, k)
        seqs[0, cur:cur + tokens.numel()] = tokens
        return tokens, None

    def rewind(self, length: int) -> None:
        """Nothing to forget: the text is read afresh every round."""


def lookup(row: Tensor, ngram: int, k: int) -> Tensor:
    """Prompt lookup's proposal for the text `row` (T,): up to k tokens that followed the last `ngram`
    tokens (else fewer, down to one) where they occurred before; empty when nothing matches."""
    cur = row.numel()
    for n in range(min(ngram, cur - 1), 0, -1):
        starts = (row[:cur - 1].unfold(0, n, 1) == row[cur - n:]).all(dim=1).nonzero()[:, 0]   # before the tail
        if starts.numel():
            full = starts[starts + n + k <= cur]
            begin = int(full[-1] if full.numel() else starts[0]) + n
            return row[begin:begin + k].clone()
    return row.new_empty(0)
