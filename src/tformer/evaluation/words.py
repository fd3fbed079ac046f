"""Words and their sub-word pieces, for token tagging: which piece carries a word's label (the
first), how `tformer tag` cuts a text into words, and how tagged words group into entities.

    words:   Ed        Miliband              flew
    pieces:  [bos] ed  mil  ##iba  ##nd      flew   [eos]
    label:   -     B   I    -      -         O      -         (-: the piece carries no label)
"""

from __future__ import annotations

import re

from ..data.tokenizers import Tokenizer, check_text

# How `tformer tag` cuts a text into words: runs that start with a letter, digit, @ or # and end with
# a letter, digit or / (so "Paris," is "Paris" + ",", while @names, #tags and URLs stay whole), and
# runs of other punctuation.
WORD = re.compile(r"[\w@#]\S*[\w/]|[\w@#]|[^\w\s]+")


def split_words(text: str) -> list[str]:
    return WORD.findall(text)


def encode_words(tokenizer: Tokenizer, sentences: list[list[str]],
                 max_len: int) -> tuple[list[list[int]], list[list[int | None]], int]:
    """[bos] + the words' pieces + [eos], cut to max_len, and for each word the position of its first
    piece (None: the word has no piece, or it was cut off). Returns also how many sentences were cut."""
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    room = max_len - len(bos) - len(eos)
    seqs, firsts, cut = [], [], 0
    try:
        encodings = tokenizer.hf.encode_batch(sentences, is_pretokenized=True, add_special_tokens=False)
    except TypeError:  # text that is not UTF-8 (stdin, arguments): say which byte
        for words in sentences:
            check_text(" ".join(words))
        raise
    for words, enc in zip(sentences, encodings):
        word_ids = enc.word_ids[:room]
        cut += len(enc.ids) > room
        first: list[int | None] = [None] * len(words)
        for j, w in enumerate(word_ids):
            if w is not None and (j == 0 or word_ids[j - 1] != w):
                first[w] = len(bos) + j
        seqs.append(bos + enc.ids[:room] + eos)
        firsts.append(first)
    return seqs, firsts, cut


def entity_spans(tags: list[str]) -> list[tuple[int, int, str]]:
    """(start, end, type) of each entity, end exclusive, by the conlleval rules that seqeval's default
    mode follows: an entity starts at B-X, or at an I-X that does not continue an X."""
    spans: list[tuple[int, int, str]] = []
    for i, tag in enumerate(tags):
        kind, _, type_ = tag.partition("-")
        continues = kind == "I" and spans and spans[-1][1] == i and spans[-1][2] == type_
        if continues:
            spans[-1] = (spans[-1][0], i + 1, type_)
        elif kind in ("B", "I"):
            spans.append((i, i + 1, type_))
    return spans


def format_entities(words: list[str], tags: list[str]) -> str:
    """The words with each entity bracketed and typed: "[Ed Miliband](person) 's odds"."""
    starts = {start: (end, type_) for start, end, type_ in entity_spans(tags)}
    out, i = [], 0
    while i < len(words):
        if i in starts:
            end, type_ = starts[i]
            out.append(f"[{' '.join(words[i:end])}]({type_})")
            i = end
        else:
            out.append(words[i])
            i += 1
    return " ".join(out)
