"""Translation, prediction and scoring: what `tformer translate`, `tformer eval` and the translation
task's validation share.

    source          s1 s2 … [eos]
    decoder input   [bos] t1 t2 …        (teacher forcing: the reference, shifted right)
    labels          t1 t2 … [eos]        (padding: IGNORE)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..model.models import EncoderDecoder
from . import metrics
from .batching import length_batches, pad

IGNORE = -100  # the label of padding (F.cross_entropy's ignore_index)


def encode_pairs(tokenizer, sources: list[str], targets: list[str] | None, max_len: int, source_tokenizer=None):
    """Token lists: sources (… [eos]) and, if given, targets (without specials), each cut to fit.
    `source_tokenizer` encodes the sources when the languages have separate vocabularies."""
    src_tok = source_tokenizer or tokenizer
    src = [ids[:max_len - 1] + [src_tok.eos_id] for ids in src_tok.encode_batch(sources)]
    tgt = [ids[:max_len - 1] for ids in tokenizer.encode_batch(targets)] if targets is not None else None
    return src, tgt


def collate(tokenizer, src: list[list[int]], tgt: list[list[int]], source_tokenizer=None) -> dict[str, Tensor]:
    src_ids, src_mask = pad(src, (source_tokenizer or tokenizer).pad_id)
    tgt_ids, _ = pad([[tokenizer.bos_id] + t for t in tgt], tokenizer.pad_id)
    labels, label_mask = pad([t + [tokenizer.eos_id] for t in tgt], tokenizer.pad_id)
    labels[label_mask == 0] = IGNORE
    return {"src_ids": src_ids, "src_mask": src_mask, "tgt_ids": tgt_ids, "labels": labels}


def translate(model: EncoderDecoder, tokenizer, texts: list[str], num_beams: int = 1, max_len: int = 256,
              batch_size: int = 64, source_tokenizer=None) -> list[str]:
    """Translations of `texts`, in order: greedy (num_beams=1) or beam search. `tokenizer` writes the
    target; `source_tokenizer`, when the source has its own vocabulary, reads `texts`."""
    src, _ = encode_pairs(tokenizer, texts, None, max_len, source_tokenizer)
    device = next(model.parameters()).device
    out: list[str] = [""] * len(texts)
    was_training = model.training
    model.eval()
    for rows in length_batches([len(s) for s in src], batch_size):
        ids, mask = pad([src[i] for i in rows], (source_tokenizer or tokenizer).pad_id)
        limit = min(model.cfg.max_seq_len - 1, 2 * ids.size(1) + 10)  # targets are rarely twice the source
        gen = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=limit,
                             num_beams=num_beams, do_sample=False, eos_token_id=tokenizer.eos_id,
                             pad_token_id=tokenizer.pad_id)
        for r, seq in zip(rows, gen[:, 1:].tolist()):                           # drop the decoder start token
            if tokenizer.eos_id in seq:
                seq = seq[:seq.index(tokenizer.eos_id)]
            out[r] = tokenizer.decode(seq).strip()
    model.train(was_training)
    return out


@torch.no_grad()
def teacher_forced_loss(model: EncoderDecoder, tokenizer, sources, targets, max_len: int, batch_size: int = 64,
                        source_tokenizer=None) -> float:
    """Mean cross-entropy per target token (incl. [eos]) with the reference as decoder input."""
    src, tgt = encode_pairs(tokenizer, sources, targets, max_len, source_tokenizer)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for rows in length_batches([len(s) + len(t) for s, t in zip(src, tgt)], batch_size):
        batch = collate(tokenizer, [src[i] for i in rows], [tgt[i] for i in rows], source_tokenizer)
        b = {k: v.to(device) for k, v in batch.items()}
        logits = model(b["src_ids"], b["tgt_ids"], b["src_mask"]).float()
        total += F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=IGNORE,
                                 reduction="sum").item()
        count += int((b["labels"] != IGNORE).sum())
    return total / count


def score(model, tokenizer, sources, targets, max_len: int, num_beams: int = 1, limit: int | None = None,
          source_tokenizer=None) -> dict:
    """val_loss on all pairs; BLEU, chrF and exact match of generated translations of the first
    `limit` pairs (all when None). Returns the hypotheses too."""
    loss = teacher_forced_loss(model, tokenizer, sources, targets, max_len, source_tokenizer=source_tokenizer)
    n = len(sources) if limit is None else min(limit, len(sources))
    hyps = translate(model, tokenizer, sources[:n], num_beams, max_len, source_tokenizer=source_tokenizer)
    refs = targets[:n]
    return {"val_loss": loss, "perplexity": math.exp(min(loss, 50.0)), "bleu": metrics.bleu(hyps, refs),
            "chrf": metrics.chrf(hyps, refs), "exact_match": metrics.exact_match(hyps, refs), "hypotheses": hyps}
