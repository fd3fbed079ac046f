"""Translation with an EncoderDecoder (the 2017 model): the encoder reads the source sentence once,
the decoder writes the target left to right, attending to the encoder's output in every layer.
Implements the tformer.training.config.Task protocol.

Data: `numbers-fr-en` (default; French number words -> English, generated on the fly: each step
draws fresh numbers, never a validation or test number; --heldout-numbers of each), `bible-en-es`
(held out: whole chapters, 10% for validation and another 10%, the same for every --seed, for test), or
a user's TSV (source<TAB>target) / JSONL ({"source", "target"}) file (held out: random pairs; two splits,
train and validation, unless --test-fraction asks for a test split too). tformer.data.splits draws the
splits; a source sentence the data repeats is on one side only. Validation is what training looks at
(validation loss and BLEU, --keep-best); test is what `tformer eval` reports.

Sequences (one shared BPE vocabulary for both languages, so the embedding is shared too; with
--separate-vocab one BPE vocabulary per language, the source read by the encoder's own embedding):
    source          s1 s2 … [eos]
    decoder input   [bos] t1 t2 …        (teacher forcing: the reference, shifted right)
    labels          t1 t2 … [eos]        (cross-entropy with label smoothing; padding ignored)

Translating and scoring are evaluation.translate's, shared with `tformer translate` and `tformer eval`;
`TranslateTask.heldout` rebuilds a run's test (or validation) pairs for `tformer eval`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from ..data import corpora
from ..data.files import split_rows, step_generator
from ..data.splits import apart, three_way
from ..errors import ConfigError, DataError, warn
from ..evaluation.translate import IGNORE, collate, encode_pairs, score, translate
from ..model.models import EncoderDecoder
from ..training.config import TrainOptions
from ..training.options import below_one, option, positive_int
from .common import arg, length_grouped_rows, model_config, recorded, split_record, test_fraction_of

BUILTIN = ("numbers-fr-en", "bible-en-es")  # the data sets held out by name (not a user's file)
# The default shape (when --preset is not given): 2 + 2 layers of width 128, the HF Marian reference's shape,
# in nmt-mini's block: the 2017 one (post-LayerNorm, sinusoidal positions on embeddings x sqrt(d_model)) with a
# SwiGLU feed-forward of the same parameters. On numbers-fr-en's validation numbers at 1,000 steps it reached
# a lower loss than the pre-LN block with learned positions and GELU (0.072 against 0.080, seeds 0-1) and
# half the wrong numbers (BENCHMARKS.md, "At equal steps").
DEFAULT_MODEL = dict(d_model=128, n_heads=4, n_layers=2, n_decoder_layers=2, d_ff=344, max_seq_len=256, dropout=0.1,
                     norm_position="post", positional="sinusoidal", embed_scale=True, activation="swiglu")


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


def load_splits(data: str, val_fraction: float, test_fraction: float, seed: int, heldout_numbers: int = 1000,
                errors: str = "strict") -> tuple[dict[str, Any], set[int] | None]:
    """({"train": (sources, targets), None for numbers; "validation", "test": (sources, targets), test empty
    without a test split}, the held-out numbers or None). test_fraction 0: `load_split`'s two splits."""
    if test_fraction == 0:
        train, val, numbers = load_split(data, val_fraction, seed, heldout_numbers, errors)
        return {"train": train, "validation": val, "test": ([], [])}, numbers
    if data == "numbers-fr-en":
        held = dict(zip(("validation", "test"), corpora.numbers_splits(heldout_numbers, seed)))
        pairs = {name: [number_pair(n) for n in ns] for name, ns in held.items()}
        return ({"train": None, **{name: ([p[0] for p in ps], [p[1] for p in ps]) for name, ps in pairs.items()}},
                set(held["validation"]) | set(held["test"]))
    pairs = corpora.bible_en_es() if data == "bible-en-es" else corpora.read_pairs(data, errors)
    if pairs.groups:   # whole chapters
        chapters = {name: set(gs) for name, gs in three_way(sorted(set(pairs.groups)), val_fraction, test_fraction,
                                                                seed).items()}
        rows = {name: [i for i, g in enumerate(pairs.groups) if g in gs] for name, gs in chapters.items()}
    else:
        rows = three_way(range(len(pairs.sources)), val_fraction, test_fraction, seed)
    rows = apart(rows, pairs.sources.__getitem__)
    pick = lambda idx: ([pairs.sources[i] for i in idx], [pairs.targets[i] for i in idx])  # noqa: E731
    return {name: pick(idx) for name, idx in rows.items()}, None


@dataclass
class TranslateOptions(TrainOptions):
    title = "translation (--task translate)"
    label_smoothing: float = option(0.1, "spread this much target probability over the vocabulary (default: 0.1, "
                                    "as in 2017)", type=below_one)
    heldout_numbers: int = option(1000, "numbers-fr-en: how many random numbers are held out for validation, and "
                                  "as many for test, never trained on (default: 1000)", type=positive_int)
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
        batches of 64 at lr 2e-3 (BENCHMARKS.md, "Numbers fr -> en"), validated every 500 steps.
        bible-en-es: preset nmt-mini without dropout (a 20-minute run sees the verses about three
        times), lr 5e-4 (measured best of 4e-3, 2e-3, 1e-3 and 5e-4: at 2e-3 the model had not started
        to use the source after 20 minutes; batches of 16 or 64 did worse than 32; BENCHMARKS.md, "Bible
        en -> es"), an average of the weights (EMA 0.995) kept as best/, validation on 100 verses every
        2,000 steps (each validation takes a slice of the time budget), and torch.compile (more steps in
        the same 20 minutes, and better scores: BENCHMARKS.md, "torch.compile")."""
        if data == "numbers-fr-en":
            return {"vocab_size": 2000, "batch_size": 64, "lr": 2e-3, "eval_every": 500}
        if data == "bible-en-es":
            return {"vocab_size": 8000, "preset": "nmt-mini", "lr": 5e-4, "ema": 0.995, "keep_best": True,
                    "eval_every": 2000, "eval_sentences": 100, "compile": True}   # no dropout: the preset has none
        return {"vocab_size": 8000}

    @classmethod
    def heldout(cls, meta: dict[str, Any], data: str | None = None, split: str = "test") -> tuple[list[str], list[str]]:
        """(sources, targets) that `tformer eval` scores: the pairs of a user's file `data`, whole; else the
        run's `split` (test, validation; "held-out": the one held-out split of a run from before test splits)
        of the run's data set (or of the built-in `data` named), rebuilt from what `meta()` recorded (this
        task's defaults for what it did not)."""
        if data is not None and data not in BUILTIN:
            pairs = corpora.read_pairs(data)
            return pairs.sources, pairs.targets
        test = meta.get("heldout", {}).get("test_fraction", 0.0)   # not recorded: no test split
        held, _ = load_splits(data or recorded(cls, meta, "data"), recorded(cls, meta, "val_fraction"), test,
                              recorded(cls, meta, "seed"), recorded(cls, meta, "heldout_numbers"))
        return held["validation" if split == "held-out" else split]

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
        self.test_fraction = test_fraction_of(opts, self.data_name in BUILTIN)
        held, self.heldout_set = load_splits(self.data_name, self.val_fraction, self.test_fraction, self.seed,
                                             self.heldout_numbers, opts.errors)
        train, self.val = held["train"], held["validation"]   # the test pairs stay unread until `tformer eval`
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
                "heldout": {"data": self.data_name, **split_record(self.val_fraction, self.test_fraction),
                            "seed": self.seed, "heldout_numbers": self.heldout_numbers}}


def _train_tokenizer(texts: list[str], vocab_size: int):
    from ..data.tokenizers import Tokenizer

    return Tokenizer.train_bpe(texts, vocab_size)
