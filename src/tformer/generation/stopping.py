"""When to stop, and how to turn tokens into text as they arrive.

Stop sequences are checked after every new token against the *end* of each row's generated tokens.
Checking every suffix at every step is what makes overlapping matches work: for the stop sequence
`A B`, the stream `A A B` stops at `B` because after `B` the last two tokens are `A B`, whatever
came before. (Matching by advancing a pointer that resets on a mismatch would miss it.)

Stop strings are matched on decoded text, because one token may hold several characters and one
character (a multi-byte UTF-8 letter in byte-level BPE) may need several tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

REPLACEMENT = "\ufffd"  # what decoding an incomplete UTF-8 byte sequence produces


def sequence_hits(generated: Tensor, stops: list[Tensor]) -> Tensor:
    """generated: (N, L) new tokens so far; stops: 1-D id tensors. -> (N,) bool, True where the
    row ends with one of the stop sequences."""
    hit = torch.zeros(generated.size(0), dtype=torch.bool, device=generated.device)
    for stop in stops:
        m = stop.numel()
        if m <= generated.size(1):
            hit |= (generated[:, -m:] == stop).all(dim=-1)
    return hit


def string_hits(tokenizer, rows: list[list[int]], stops: list[str]) -> list[bool]:
    """Whether the decoded text of each row of generated tokens contains a stop string. Only the
    last tokens are decoded: a row still running never contained a stop string before this step,
    so a match must end in the newest token; every token holds at least one byte, so the stop
    string's UTF-8 bytes, plus 3 for a character cut at the window's start, bound the window."""
    window = max(len(s.encode("utf-8")) for s in stops) + 4
    texts = [tokenizer.decode(row[-window:]) for row in rows]
    return [any(s in text for s in stops) for text in texts]


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that is the start of a stop string: it must not be
    shown yet, because the next token may complete the stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class TextStream:
    """Turns one row's new tokens into text increments, safely:

    - only complete text is released: a token that ends inside a multi-byte UTF-8 character
      decodes to U+FFFD, so the text waits for the token that completes it;
    - text that may be the start of a stop string is held back until it is known not to be;
    - at a stop string the text ends, before it (or after it with include_stop=True).

    Decoding uses a sliding window (`prefix`, `read`): the tokens from `prefix` are decoded with
    and without the newest ones, and the difference is the new text. Decoding a little context
    keeps tokenizers whose decoding depends on the previous token (leading spaces) right, and
    costs O(1) per token instead of re-decoding everything.
    """

    def __init__(self, tokenizer, stop_strings: list[str] | tuple[str, ...] = (), include_stop: bool = False):
        self.tokenizer, self.include_stop = tokenizer, include_stop
        self.stops = [s for s in stop_strings if s]
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""            # complete text decoded so far
        self.emitted = 0          # characters of self.text already released
        self.stopped = False

    def push(self, ids: list[int]) -> str:
        """Add new token ids; return the text that can be shown now (maybe "")."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text, once generation has ended."""
        if not self.stopped:
            before = self.tokenizer.decode(self.ids[self.prefix:self.read])
            self.text += self.tokenizer.decode(self.ids[self.prefix:])[len(before):]
            self.prefix = self.read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        end = len(self.text) if final else len(self.text) - held_back(self.text, self.stops)
        found = [(i, s) for s in self.stops if (i := self.text.find(s, self.emitted)) >= 0]
        if found:
            i, s = min(found)
            end = i + len(s) if self.include_stop else i
            self.stopped = True
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out
