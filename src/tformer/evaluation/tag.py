"""Token tagging (named entities), prediction and scoring: what `tformer tag`, `tformer eval` and the
tagging task's validation share.

A word takes the label predicted at its first piece (evaluation.words); a word that falls past
max_len (or yields no piece at all) is predicted O, and still counts in the scores: a model is scored
on every word. Scores are entity-level (seqeval, conlleval rules): an entity counts when its type and
both ends are right.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..data import corpora
from ..data.tokenizers import Tokenizer
from ..errors import DataError
from ..model.heads import EncoderTokenClassifier
from . import metrics
from .batching import length_batches, pad
from .words import encode_words


@torch.no_grad()
def word_logits(model: EncoderTokenClassifier, tokenizer: Tokenizer, sentences: list[list[str]], max_len: int,
                batch_size: int = 64) -> list[tuple[Tensor, list[int]]]:
    """For each sentence: the label logits (K, num_labels) at the first pieces of the K words that
    have one, and which words those are."""
    seqs, firsts, _ = encode_words(tokenizer, sentences, max_len)
    device = next(model.parameters()).device
    out: list[tuple[Tensor, list[int]]] = [None] * len(seqs)  # type: ignore[list-item]
    for rows in length_batches([len(s) for s in seqs], batch_size):
        ids, mask = pad([seqs[i] for i in rows], tokenizer.pad_id if tokenizer.pad_id is not None else 0)
        logits = model(ids.to(device), mask.to(device)).float().cpu()          # (B, T, num_labels)
        for b, i in enumerate(rows):
            covered = [w for w, p in enumerate(firsts[i]) if p is not None]
            out[i] = (logits[b, [firsts[i][w] for w in covered]], covered)
    return out


def label_names(model: EncoderTokenClassifier) -> list[str]:
    return model.labels or [str(i) for i in range(model.num_labels)]


def decode(sentences: list[list[str]], per_sentence: list[tuple[Tensor, list[int]]],
           names: list[str]) -> list[list[str]]:
    """One label per word, the best at its first piece; words past max_len (or without a piece) get O."""
    out = []
    for words, (logits, covered) in zip(sentences, per_sentence):
        tags = ["O"] * len(words)
        for w, k in zip(covered, logits.argmax(-1).tolist()):
            tags[w] = names[k]
        out.append(tags)
    return out


def predict_tags(model: EncoderTokenClassifier, tokenizer: Tokenizer, sentences: list[list[str]], max_len: int,
                 batch_size: int = 64) -> list[list[str]]:
    return decode(sentences, word_logits(model, tokenizer, sentences, max_len, batch_size), label_names(model))


def score(model: EncoderTokenClassifier, tokenizer: Tokenizer, sentences: list[list[str]],
          labels: list[list[str]], max_len: int) -> dict[str, Any]:
    """Loss (over the words the model sees) and entity precision / recall / F1 (over every word)."""
    names = label_names(model)
    index = {name: i for i, name in enumerate(names)}
    per_sentence = word_logits(model, tokenizer, sentences, max_len)
    logits = torch.cat([lg for lg, _ in per_sentence])                           # (words seen, num_labels)
    gold = torch.tensor([index[labels[i][w]] for i, (_, covered) in enumerate(per_sentence) for w in covered])
    loss = F.cross_entropy(logits, gold).item() if len(gold) else float("nan")
    predicted = decode(sentences, per_sentence, names)
    return {"val_loss": loss, **metrics.entity_scores(predicted, labels), "predicted": predicted}


def check_labels(data: corpora.TaggedSentences, known: list[str], source: str) -> None:
    """Every label of `data` must be one the model was trained with: name the first line that isn't."""
    allowed = set(known)
    for sentence, lines in zip(data.labels, data.lines):
        for label, line in zip(sentence, lines):
            if label not in allowed:
                raise DataError(f"{source}:{line}: label {label!r} was not in the model's training data "
                                f"(it knows {', '.join(known)})")
