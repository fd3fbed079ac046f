"""Translation with an EncoderDecoder (the 2017 model): the encoder reads the source sentence once,
the decoder writes the target left to right, attending to the encoder's output in every layer.
Implements the tformer.training.config.Task protocol.

Data: `numbers-fr-en` (default; French number words -> English, generated on the fly: each step
draws fresh numbers, never one of the held-out numbers), `bible-en-es` (held out: whole chapters),
or a user's TSV (source<TAB>target) / JSONL ({"source", "target"}) file (held out: random pairs).

Sequences (one shared BPE vocabulary for both languages, so the embedding is shared too; with
--separate-vocab one BPE vocabulary per language, the source read by the encoder's own embedding):
    source          s1 s2 … [eos]
    decoder input   [bos] t1 t2 …        (teacher forcing: the reference, shifted right)
    labels          t1 t2 … [eos]        (cross-entropy with label smoothing; padding ignored)
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data import corpora
from ..data.files import split_rows, step_generator
from ..errors import ConfigError, DataError
from ..evaluation import metrics
from ..model.models import EncoderDecoder
from ..training.config import TrainOptions
from ..training.options import below_one, option, positive_int
from .common import arg, length_batches, length_grouped_rows, model_config, pad, warn

IGNORE = -100
# The default shape (when --preset is not given): 2 + 2 layers of width 128, the HF Marian reference's
# shape; post-LN and sinusoidal positions as in the 2017 paper would also do, pre-LN trains faster.
DEFAULT_MODEL = dict(d_model=128, n_heads=4, n_layers=2, n_decoder_layers=2, d_ff=512, max_seq_len=256, dropout=0.1)


@lru_cache(maxsize=1 << 17)
def number_pair(n: int) -> tuple[str, str]:
    return corpora.number_pair(n)


def load_split(data: str, val_fraction: float, seed: int, heldout_numbers: int = 1000, errors: str = "strict"):
    """(training pairs or None for numbers, held-out pairs, held-out numbers set or None) for a data name."""
    if data == "numbers-fr-en":
        held = corpora.numbers_heldout(heldout_numbers, seed)
        pairs = [number_pair(n) for n in held]
        return None, ([p[0] for p in pairs], [p[1] for p in pairs]), set(held)
    pairs = corpora.bible_en_es() if data == "bible-en-es" else corpora.read_pairs(data, errors)
    if len(pairs.sources) < 2:
        raise DataError(f"{pairs.name} has {len(pairs.sources)} pair(s); need at least 2 (one to train, one to test)")
    if pairs.groups:
        test_groups = corpora.heldout_groups(pairs.groups, val_fraction, seed)
        test = [i for i, g in enumerate(pairs.groups) if g in test_groups]
        train = [i for i, g in enumerate(pairs.groups) if g not in test_groups]
    else:
        train, test = split_rows(list(range(len(pairs.sources))), val_fraction, seed)
    pick = lambda idx: ([pairs.sources[i] for i in idx], [pairs.targets[i] for i in idx])  # noqa: E731
    return pick(train), pick(test), None


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
    import math

    loss = teacher_forced_loss(model, tokenizer, sources, targets, max_len, source_tokenizer=source_tokenizer)
    n = len(sources) if limit is None else min(limit, len(sources))
    hyps = translate(model, tokenizer, sources[:n], num_beams, max_len, source_tokenizer=source_tokenizer)
    refs = targets[:n]
    return {"val_loss": loss, "perplexity": math.exp(min(loss, 50.0)), "bleu": metrics.bleu(hyps, refs),
            "chrf": metrics.chrf(hyps, refs), "exact_match": metrics.exact_match(hyps, refs), "hypotheses": hyps}


@dataclass
class TranslateOptions(TrainOptions):
    title = "translation (--task translate)"
    label_smoothing: float = option(0.1, "spread this much target probability over the vocabulary (default: 0.1, "
                                    "as in 2017)", type=below_one)
    heldout_numbers: int = option(1000, "numbers-fr-en: how many random numbers are held out, never trained on "
                                  "(default: 1000)", type=positive_int)
    eval_sentences: int = option(200, "held-out sentences translated (greedy) at each validation for BLEU/chrF/exact "
                                 "match; val_loss always uses all (default: 200)", type=positive_int)
    separate_vocab: bool = option(False, "train one BPE vocabulary per language instead of one shared (default: "
                                  "shared); --vocab-size then applies to each", action="store_true")
    max_len: int | None = option(None, "tokens per source / target sentence; longer ones are cut (default: the "
                                 "model's length)", type=positive_int)


class TranslateTask:
    name = "translate"
    default_data = "numbers-fr-en"
    Options = TranslateOptions

    @staticmethod
    def recipe(data: str, init: str | None, time_budget: float | None) -> dict[str, Any]:
        """DEFAULT_MODEL, with the BPE vocabulary size measured best for the data set. numbers-fr-en:
        batches of 64 at lr 2e-3 (exact match 0.998 in 10 minutes, BENCHMARKS.md), validated every 500
        steps. bible-en-es: preset nmt-mini without dropout (a 20-minute run sees the verses about
        three times), lr 5e-4 (measured best of 4e-3, 2e-3, 1e-3 and 5e-4: at 2e-3 the model had not
        started to use the source after 20 minutes; batches of 16 or 64 did worse than 32;
        BENCHMARKS.md), an average of the weights (EMA 0.995) kept as best/, validation on 100
        verses every 2,000 steps (each one costs about 30 s of the budget), and torch.compile (3,114
        steps in 20 minutes against 2,838: BLEU 21.4 / chrF 41.8 against 20.3 / 40.4)."""
        if data == "numbers-fr-en":
            return {"vocab_size": 2000, "batch_size": 64, "lr": 2e-3, "eval_every": 500}
        if data == "bible-en-es":
            return {"vocab_size": 8000, "preset": "nmt-mini", "lr": 5e-4, "ema": 0.995, "keep_best": True,
                    "eval_every": 2000, "eval_sentences": 100, "compile": True}   # no dropout: the preset has none
        return {"vocab_size": 8000}

    def __init__(self, opts: TranslateOptions, tokenizer=None, init: str | None = None, source_tokenizer=None):
        if init is not None:
            raise ConfigError("--init is not supported for --task translate (train from scratch, or --resume a run)")
        self.opts = opts
        self.seed = opts.seed
        self.val_fraction = opts.val_fraction
        self.data_name = str(arg(opts, "data", "numbers-fr-en"))
        self.label_smoothing = opts.label_smoothing
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"--label-smoothing {self.label_smoothing} must be in [0, 1)")
        self.eval_sentences = opts.eval_sentences
        self.heldout_numbers = opts.heldout_numbers
        self.batch_size = opts.batch_size
        train, self.val, self.heldout_set = load_split(self.data_name, self.val_fraction, self.seed,
                                                       self.heldout_numbers, opts.errors)
        self.separate_vocab = opts.separate_vocab
        if tokenizer is None:
            sources, targets = train if train is not None else self._number_texts(4000)
            vocab_size = arg(opts, "vocab_size", 8000)
            if self.separate_vocab:
                source_tokenizer = _train_tokenizer(sources, vocab_size)
                tokenizer = _train_tokenizer(targets, vocab_size)
            else:
                tokenizer = _train_tokenizer(sources + targets, vocab_size)
        if self.separate_vocab != (source_tokenizer is not None):
            raise ConfigError("--separate-vocab and the given tokenizers disagree (separate vocabularies need a "
                              "source and a target tokenizer; a shared one needs only one tokenizer)")
        self.tokenizer, self.source_tokenizer = tokenizer, source_tokenizer
        if None in (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id):
            raise DataError("the tokenizer needs <pad>, <bos> and <eos> tokens for translation")
        if source_tokenizer is not None and None in (source_tokenizer.pad_id, source_tokenizer.eos_id):
            raise DataError("the source tokenizer needs <pad> and <eos> tokens for translation")
        self.cfg = model_config(opts, "encoder-decoder", tokenizer.vocab_size, 0, DEFAULT_MODEL,
                                pad_token_id=tokenizer.pad_id, bos_token_id=tokenizer.bos_id,
                                eos_token_id=tokenizer.eos_id, decoder_start_token_id=tokenizer.bos_id,
                                src_vocab_size=source_tokenizer.vocab_size if source_tokenizer else None)
        self.max_len = min(arg(opts, "max_len", self.cfg.max_seq_len), self.cfg.max_seq_len)
        self.train_src = self.train_tgt = None
        if train is not None:
            self.train_src, self.train_tgt = encode_pairs(tokenizer, train[0], train[1], self.max_len, source_tokenizer)
            src, tgt = self.train_src, self.train_tgt
            self.by_length = sorted(range(len(src)), key=lambda i: len(src[i]) + len(tgt[i]))
            cut = sum(len(s) >= self.max_len for s in src) + sum(len(t) >= self.max_len for t in tgt)
            if cut:
                warn(f"{cut} training sentences are longer than {self.max_len} tokens and were cut")

    def _number_texts(self, n: int) -> tuple[list[str], list[str]]:
        """(French, English) texts of `n` training numbers, to train the tokenizer(s) on."""
        rng = random.Random(f"tokenizer-{self.seed}")
        pairs = [number_pair(corpora.sample_training_number(rng, self.heldout_set)) for _ in range(n)]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    # --- the Task protocol ------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        return EncoderDecoder(self.cfg)

    def batch(self, step: int, split: str = "train") -> dict[str, Tensor]:
        if self.train_src is None:  # numbers: fresh numbers each step, drawn by (seed, step)
            rng = random.Random(f"{self.seed}-{step}")
            pairs = [number_pair(corpora.sample_training_number(rng, self.heldout_set)) for _ in range(self.batch_size)]
            src, tgt = encode_pairs(self.tokenizer, [p[0] for p in pairs], [p[1] for p in pairs], self.max_len,
                                    self.source_tokenizer)
        else:
            rows = length_grouped_rows(self.by_length, self.batch_size, step_generator(self.seed, step))
            src, tgt = [self.train_src[i] for i in rows], [self.train_tgt[i] for i in rows]
        return collate(self.tokenizer, src, tgt, self.source_tokenizer)

    def loss(self, model, batch: dict[str, Tensor]) -> Tensor:
        logits = model(batch["src_ids"], batch["tgt_ids"], batch["src_mask"])    # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=IGNORE,
                               label_smoothing=self.label_smoothing)

    def tokens(self, batch: dict[str, Tensor]) -> int:
        return int(batch["src_mask"].sum()) + int((batch["labels"] != IGNORE).sum())

    def evaluate(self, model) -> dict[str, float]:
        s = score(model, self.tokenizer, *self.val, self.max_len, limit=self.eval_sentences,
                  source_tokenizer=self.source_tokenizer)
        return {"val_loss": s["val_loss"], "val_bleu": s["bleu"], "val_chrf": s["chrf"],
                "val_exact_match": s["exact_match"]}

    def sample(self, model) -> str:
        sources = self.val[0][:2]
        hyps = translate(model, self.tokenizer, sources, 1, self.max_len, source_tokenizer=self.source_tokenizer)
        return "\n".join(f"{s}  ->  {t}" for s, t in zip(sources, hyps))

    def meta(self) -> dict[str, Any]:
        return {"max_len": self.max_len, "label_smoothing": self.label_smoothing, "separate_vocab": self.separate_vocab,
                "heldout": {"data": self.data_name, "val_fraction": self.val_fraction, "seed": self.seed,
                            "heldout_numbers": self.heldout_numbers}}


def _train_tokenizer(texts: list[str], vocab_size: int):
    from ..data.tokenizers import Tokenizer

    return Tokenizer.train_bpe(texts, vocab_size)
