"""Text classification, prediction and scoring: what `tformer classify`, `tformer eval`, the server
and the classification task's validation share.

Every text becomes  [bos] tokens… [eos]  (for a BERT tokenizer bos/eos are [CLS]/[SEP]), cut to
max_len tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..model.heads import EncoderClassifier
from . import metrics
from .batching import length_batches, pad


def encode_texts(tokenizer, texts: list[str], max_len: int) -> tuple[list[list[int]], int]:
    """[bos] + ids + [eos], the middle cut so the whole fits max_len. Returns the lists and how many
    texts were cut."""
    special = [i for i in (tokenizer.bos_id, tokenizer.eos_id) if i is not None]
    room = max_len - len(special)
    out, cut = [], 0
    for ids in tokenizer.encode_batch(texts):
        if len(ids) > room:
            ids, cut = ids[:room], cut + 1
        start = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
        end = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        out.append(start + ids + end)
    return out, cut


@torch.no_grad()
def predict_proba(model: EncoderClassifier, tokenizer, texts: list[str], max_len: int,
                  batch_size: int = 64) -> Tensor:
    """Label probabilities (N, num_labels) for `texts`, in order."""
    seqs, _ = encode_texts(tokenizer, texts, max_len)
    device = next(model.parameters()).device
    probs = torch.empty(len(seqs), model.num_labels)
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    for rows in length_batches([len(s) for s in seqs], batch_size):
        ids, mask = pad([seqs[i] for i in rows], pad_id)
        logits = model(ids.to(device), mask.to(device))
        probs[rows] = logits.float().softmax(-1).cpu()
    return probs


def score(model: EncoderClassifier, tokenizer, texts: list[str], labels: list[int], max_len: int,
          label_names: list[str]) -> dict[str, Any]:
    """Loss, accuracy, macro-F1 and confusion matrix of `model` on `texts` with reference `labels`."""
    probs = predict_proba(model, tokenizer, texts, max_len)
    target = torch.tensor(labels)
    loss = F.nll_loss(probs.clamp_min(1e-12).log(), target).item()
    predicted = probs.argmax(-1).tolist()
    return {"val_loss": loss, "accuracy": metrics.accuracy(predicted, labels),
            "macro_f1": metrics.macro_f1(predicted, labels, len(label_names)),
            "confusion": metrics.confusion_matrix(predicted, labels, len(label_names)), "labels": label_names}


def format_confusion(matrix: list[list[int]], labels: list[str]) -> str:
    """The confusion matrix as a small text table (rows: true label, columns: predicted)."""
    width = max(8, *(len(name) + 1 for name in labels))
    lines = ["true \\ predicted".ljust(width + 8) + "".join(name.rjust(width) for name in labels)]
    for name, row in zip(labels, matrix):
        lines.append(name.ljust(width + 8) + "".join(str(n).rjust(width) for n in row))
    return "\n".join(lines)
