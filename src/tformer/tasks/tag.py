"""Token tagging (named-entity recognition) with an EncoderTokenClassifier: every word gets one
IOB2 label (O, B-TYPE, I-TYPE), on the built-in wnut16 tweets or a user's CoNLL file. Implements
the tformer.training.config.Task protocol.

Sub-word alignment: a sentence is tokenized word by word, and only the first piece of each word
carries its label; the other pieces (and [bos]/[eos]) are ignored by the loss, and at prediction
time a word takes the label predicted at its first piece.

    words     Ed        Miliband          's
    pieces    [CLS] ed  mil ##iba ##nd    ' s   [SEP]
    target    -     B   I   -     -       O -   -          (- = ignored)

Prediction and scoring (a word past --max-len is predicted O, and still counts; entity-level
scores) are evaluation.tag's, shared with `tformer tag` and `tformer eval`. Three splits of wnut16
(tformer.data.splits): test, a fixed random 10% of the tweets that training never looks at (wnut16 ships
only the shared task's training set, so its own dev / test sets are not at hand); validation, a random
--val-fraction of the rest drawn by --seed (validation F1, --keep-best); the rest trains; a tweet the data
repeats is on one side only. A user's CoNLL file is split in two as before (train, validation), unless
--test-fraction asks for a test split too. `meta()` records how to rebuild them and `TagTask.heldout`
rebuilds them, so `tformer eval --model RUN` scores the test sentences (or --split validation).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from ..data import corpora
from ..data.files import split_rows, step_generator
from ..data.splits import apart, three_way
from ..data.tokenizers import Tokenizer, make_tokenizer
from ..errors import ConfigError, DataError, warn
from ..evaluation import metrics
from ..evaluation.batching import pad
from ..evaluation.tag import predict_tags, score
from ..evaluation.words import encode_words, format_entities
from ..model.heads import EncoderTokenClassifier
from ..training.config import TrainOptions
from ..training.options import option, positive_int

# The default shape (when --preset is not given), vocabulary and length are classification's (the
# 2-layer, width-128 BERT): 2,400 tweets are too few for more.
from .classify import DEFAULT_MAX_LEN, DEFAULT_MODEL, DEFAULT_VOCAB
from .common import (
    arg,
    dropout_overrides,
    length_grouped_rows,
    load_pretrained_encoder,
    model_config,
    recorded,
    split_record,
    test_fraction_of,
)

IGNORE = -100  # the target of pieces that carry no label (F.cross_entropy's ignore_index)


def load_data(data: str | None, errors: str = "strict") -> corpora.TaggedSentences:
    """The built-in corpus by name, or the user's CoNLL file."""
    if data in (None, "wnut16"):
        return corpora.wnut16()
    return corpora.read_conll(data, errors)


def split(data: corpora.TaggedSentences, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Indices of the training and held-out sentences (a seeded permutation; the same for eval)."""
    return split_rows(list(range(len(data.words))), val_fraction, seed)


def splits(data: corpora.TaggedSentences, val_fraction: float, test_fraction: float,
           seed: int) -> dict[str, list[int]]:
    """Indices of the train / validation / test sentences (tformer.data.splits), each sentence's words on
    one side only; test_fraction 0: `split`'s two, no test."""
    rows = three_way(range(len(data.words)), val_fraction, test_fraction, seed)
    return rows if test_fraction == 0 else apart(rows, lambda i: tuple(data.words[i]))


def select(data: corpora.TaggedSentences, rows: list[int]) -> corpora.TaggedSentences:
    """The sentences `rows` of `data` (with their line numbers)."""
    return corpora.TaggedSentences([data.words[i] for i in rows], [data.labels[i] for i in rows], data.name,
                                   [data.lines[i] for i in rows])


def label_set(labels: list[list[str]]) -> list[str]:
    """The labels of the data, O first (id 0, as in Hugging Face's NER models), then sorted."""
    names = {t for sentence in labels for t in sentence}
    return sorted(names, key=lambda name: (name != "O", name))


def targets(first: list[int | None], label_ids: list[int], length: int) -> list[int]:
    """Per-position targets: the word's label at its first piece, IGNORE everywhere else."""
    out = [IGNORE] * length
    for position, label in zip(first, label_ids):
        if position is not None:
            out[position] = label
    return out


@dataclass
class TagOptions(TrainOptions):
    title = "token tagging (--task tag)"
    max_len: int | None = option(
        None, f"tokens per sentence incl. [bos]/[eos]; words past it are predicted O (default: {DEFAULT_MAX_LEN})",
        type=positive_int)


class TagTask:
    name = "tag"
    default_data = "wnut16"
    best_metric = ("val_f1", "max")

    @staticmethod
    def recipe(data: str, init: str | None, time_budget: float | None) -> dict[str, Any]:
        """2,400 sentences overfit within minutes: keep the best held-out F1 (RUN/best/). From scratch:
        DEFAULT_MODEL and a cased WordPiece trained on the data (`--tokenizer wordpiece` means cased
        here): capitals are the strongest cue for a name. Fine-tuning a pretrained encoder (--init): a
        small learning rate after a short warm-up (on wnut16's validation split, seed 0, from MiniLM, F1 at
        1,000 steps: lr 1e-4 0.469, 3e-4 0.456, the default 1e-3 0.382; BENCHMARKS.md, "Named-entity
        tagging")."""
        if init is not None:
            return {"keep_best": True, "lr": 1e-4, "warmup": 20}
        return {"keep_best": True, "tokenizer": "wordpiece", "vocab_size": DEFAULT_VOCAB}

    Options = TagOptions

    @classmethod
    def heldout(cls, meta: dict[str, Any], data: str | None = None, split: str = "test") -> corpora.TaggedSentences:
        """The sentences `tformer eval` scores: those of `data`, whole; else the run's `split` (test,
        validation; "held-out": the one held-out split of a run from before test splits), rebuilt from what
        `meta()` recorded (this task's defaults for what it did not)."""
        if data is not None:
            return load_data(data)
        whole = load_data(recorded(cls, meta, "data"))
        test = meta.get("heldout", {}).get("test_fraction", 0.0)   # not recorded: no test split
        rows = splits(whole, recorded(cls, meta, "val_fraction"), test, recorded(cls, meta, "seed"))
        return select(whole, rows["validation" if split == "held-out" else split])

    def __init__(self, opts: TagOptions, tokenizer=None, init: str | None = None):
        if importlib.util.find_spec("seqeval") is None:
            raise ConfigError("--task tag scores entities with seqeval, which is not installed (pip install seqeval)")
        self.opts = opts
        self.seed = arg(opts, "seed", 0)
        self.val_fraction = arg(opts, "val_fraction", 0.1)
        self.data_name = arg(opts, "data", "wnut16")
        self.test_fraction = test_fraction_of(opts, self.data_name in corpora.TAG_CORPORA)
        data = load_data(self.data_name, errors=arg(opts, "errors", "strict"))
        # Labels of every split: a type seen only in held-out sentences is still one to predict.
        self.label_names = label_set(data.labels)
        if len(self.label_names) < 2:
            raise DataError(f"{data.name} has only one label ({self.label_names[0]!r}); tagging needs two or more")
        label_id = {name: i for i, name in enumerate(self.label_names)}
        rows = splits(data, self.val_fraction, self.test_fraction, self.seed)
        train_idx, val_idx = rows["train"], rows["validation"]   # the test rows stay unread until `tformer eval`
        self.init = init if init is not None else arg(opts, "init")  # on --resume the CLI passes init=None
        self.pretrained = None
        if init is not None and tokenizer is None:
            self.pretrained, tokenizer = load_pretrained_encoder(init)
        if tokenizer is None:
            tokenizer = self._train_tokenizer([" ".join(data.words[i]) for i in train_idx])
        self.tokenizer = tokenizer
        if tokenizer.pad_id is None:
            raise DataError("the tokenizer has no padding token (<pad> or [PAD]); tagging pads batches")
        limit = self.pretrained.cfg.max_seq_len if self.pretrained is not None else None
        self.max_len = min(arg(opts, "max_len", DEFAULT_MAX_LEN), limit or 10**9)
        seqs, firsts, cut = encode_words(tokenizer, [data.words[i] for i in train_idx], self.max_len)
        if cut:
            warn(f"{cut} of {len(seqs)} training sentences are longer than --max-len {self.max_len} tokens and "
                 "were truncated")
        self.train_seqs = seqs
        self.train_targets = [targets(first, [label_id[t] for t in data.labels[i]], len(seq))
                              for seq, first, i in zip(seqs, firsts, train_idx)]
        self.by_length = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        self.val_words = [data.words[i] for i in val_idx]
        self.val_labels = [data.labels[i] for i in val_idx]

    def _train_tokenizer(self, texts: list[str]) -> Tokenizer:
        choice = arg(self.opts, "tokenizer", "wordpiece")
        vocab_size = arg(self.opts, "vocab_size", DEFAULT_VOCAB)
        if choice == "wordpiece":
            return Tokenizer.train_wordpiece(texts, vocab_size, lowercase=False)
        return make_tokenizer(choice, texts, vocab_size)

    # --- the Task protocol ------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        n = len(self.label_names)
        if self.init is not None:
            encoder = self.pretrained
            if encoder is None:  # resuming: the tokenizer came from the run, the weights from --init
                encoder, _ = load_pretrained_encoder(self.init)
            model = EncoderTokenClassifier(encoder.cfg.replace(**dropout_overrides(self.opts)), n, self.label_names)
            model.encoder.load_state_dict(encoder.state_dict())
            return model
        cfg = model_config(self.opts, "encoder", self.tokenizer.vocab_size, self.max_len, DEFAULT_MODEL,
                           pad_token_id=self.tokenizer.pad_id)
        return EncoderTokenClassifier(cfg, n, self.label_names)

    def batch(self, step: int, split: str = "train") -> dict[str, Tensor]:
        g = step_generator(self.seed, step)
        rows = length_grouped_rows(self.by_length, self.opts.batch_size, g)
        ids, mask = pad([self.train_seqs[i] for i in rows], self.tokenizer.pad_id)
        labels, _ = pad([self.train_targets[i] for i in rows], IGNORE)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def loss(self, model, batch: dict[str, Tensor]) -> Tensor:
        logits = model(batch["input_ids"], batch["attention_mask"])             # (B, T, num_labels)
        return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)

    def tokens(self, batch: dict[str, Tensor]) -> int:
        return int(batch["attention_mask"].sum())

    def evaluate(self, model) -> dict[str, float]:
        s = score(model, self.tokenizer, self.val_words, self.val_labels, self.max_len)
        return {"val_loss": s["val_loss"], "val_f1": s["f1"], "val_precision": s["precision"],
                "val_recall": s["recall"]}

    def sample(self, model) -> str:
        words = self.val_words[:2]
        return "  |  ".join(format_entities(w, t)
                            for w, t in zip(words, predict_tags(model, self.tokenizer, words, self.max_len)))

    def meta(self) -> dict[str, Any]:
        return {"labels": self.label_names, "max_len": self.max_len, "init": self.init,
                "heldout": {"data": self.data_name, **split_record(self.val_fraction, self.test_fraction),
                            "seed": self.seed}}

    def report(self, model, out_dir=None) -> str:
        """The final report on the validation split (the test split is `tformer eval`'s): entity precision /
        recall / F1, overall and per type."""
        s = score(model, self.tokenizer, self.val_words, self.val_labels, self.max_len)
        return (f"validation ({len(self.val_words)} sentences): entity precision {s['precision']:.4f}  "
                f"recall {s['recall']:.4f}  F1 {s['f1']:.4f}\n"
                + metrics.entity_report(s["predicted"], self.val_labels))
