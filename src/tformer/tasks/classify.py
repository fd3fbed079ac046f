"""Text classification with an EncoderClassifier (the BERT recipe of the seeds: the first token's
vector -> dropout -> linear -> softmax), on the built-in rotten-tomatoes sentiment data or a user's
CSV / TSV / JSONL file. Implements the tformer.training.config.Task protocol.

Every text becomes  [bos] tokens… [eos]  (for a BERT tokenizer bos/eos are [CLS]/[SEP]), cut to
--max-len tokens; prediction and scoring are evaluation.classify's, shared with `tformer classify`,
`tformer eval` and the server. Three splits (tformer.data.splits): the test split, a fixed random 10%
of rotten-tomatoes that training never looks at; validation, a random --val-fraction of the rest drawn
by --seed (validation loss, --keep-best); the rest trains; a text the data repeats is on one side only.
A user's file is split in two as before (train, validation), unless --test-fraction asks for a test
split too. `meta()` records how to rebuild them and `ClassifyTask.heldout` rebuilds them, so
`tformer eval --model RUN` scores the test texts (or --split validation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data import corpora
from ..data.files import step_generator
from ..data.splits import apart, three_way
from ..data.tokenizers import make_tokenizer
from ..errors import ConfigError, DataError, warn
from ..evaluation.batching import pad
from ..evaluation.classify import encode_texts, format_confusion, predict_proba, score
from ..model.heads import EncoderClassifier
from ..training.config import TrainOptions
from ..training.options import below_one, option, positive_int
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

# The default shape (when --preset is not given): the 2-layer, width-128 BERT of the HF
# reference; on 12k short sentences a bigger model only overfits sooner.
DEFAULT_MODEL = dict(d_model=128, n_heads=4, n_layers=2, d_ff=512, max_seq_len=128, dropout=0.1)
DEFAULT_VOCAB = 8000
DEFAULT_MAX_LEN = 128


def load_data(data: str | None, text_column: str = "text", label_column: str = "label",
              errors: str = "strict") -> corpora.LabelledTexts:
    """The built-in corpus by name, or the user's table."""
    if data in (None, "rotten-tomatoes"):
        return corpora.rotten_tomatoes()
    return corpora.read_labelled(data, text_column, label_column, errors)


def splits(data: corpora.LabelledTexts, val_fraction: float, test_fraction: float,
           seed: int) -> dict[str, list[int]]:
    """Indices of the train / validation / test rows (tformer.data.splits), each text on one side only;
    test_fraction 0: a seeded permutation's two (data.files.split_rows), no test."""
    rows = three_way(range(len(data.texts)), val_fraction, test_fraction, seed)
    return rows if test_fraction == 0 else apart(rows, data.texts.__getitem__)


def drop_tokens(seq: list[int], p: float, generator) -> list[int]:
    """`seq` without a random share p of its inner tokens (the first and last, [bos]/[eos], stay;
    a text is never emptied): word dropout, which makes a model lean on more than a few cue words."""
    inner = seq[1:-1]
    keep = (torch.rand(len(inner), generator=generator) >= p).tolist()
    if not any(keep):
        return seq
    return seq[:1] + [t for t, k in zip(inner, keep) if k] + seq[-1:]


@dataclass
class ClassifyOptions(TrainOptions):
    title = "classification (--task classify)"
    text_column: str = option("text", "column (CSV/TSV) or field (JSONL) with the text (default: text)")
    label_column: str = option("label", "column or field with the label (default: label)")
    pooling: str | None = option(
        None, "sentence vector for the head: the first token's (BERT; the default) or the mean of all tokens' (the "
        "default with --init of a sentence-transformers model, which was trained with mean pooling, so its first "
        "token carries no sentence meaning; and the recipe from scratch on rotten-tomatoes)",
        choices=("first", "mean"))
    token_dropout: float | None = option(
        None, "training augmentation: delete each token of a training text with this probability (default: 0.1 "
        "from scratch, 0 with --init); small data sets overfit less", type=below_one)
    max_len: int | None = option(
        None, f"tokens per text incl. [bos]/[eos]; longer texts are cut (default: {DEFAULT_MAX_LEN})",
        type=positive_int)
    freeze_embeddings: bool | None = option(
        None, "with --init: keep the pretrained embedding layer (token, position and segment tables, norm) fixed, "
        "so words seen in training do not drift away from words only met at test time", action="store_true")


class ClassifyTask:
    name = "classify"
    default_data = "rotten-tomatoes"
    best_metric = ("val_accuracy", "max")
    Options = ClassifyOptions

    @staticmethod
    def recipe(data: str, init: str | None, time_budget: float | None) -> dict[str, Any]:
        """Small data sets overfit within minutes: keep the model of the best held-out accuracy
        (RUN/best/). From scratch: DEFAULT_MODEL on an uncased WordPiece vocabulary (11k sentences
        are too few to learn that "Great" = "great").
        On rotten-tomatoes, the recipes measured best there (BENCHMARKS.md, "Sentiment"): validate
        often, on a moving average of the weights; cut texts at 64 tokens (few are longer). From
        scratch: BERT's shipped uncased vocabulary (pieces learned from a large corpus), heavy dropout
        and word dropout, and the mean of the tokens' vectors for the head (on the validation splits of
        seeds 0-2 at 2,000 steps: 0.7755 against the first token's 0.7659, ahead at every seed).
        Fine-tuning a pretrained encoder (--init): a small learning rate after a short warm-up, and the
        pretrained embeddings kept fixed, so words met only at test time stay where pre-training put them."""
        scratch = {"tokenizer": "wordpiece", "vocab_size": DEFAULT_VOCAB} if init is None else {}
        if data != "rotten-tomatoes":
            return {"keep_best": True, **scratch}
        common = {"keep_best": True, "ema": 0.99, "eval_every": 50, "max_len": 64}
        if init is None:
            return {**common, "tokenizer": "bert-uncased", "dropout": 0.2, "token_dropout": 0.2, "pooling": "mean"}
        return {**common, "freeze_embeddings": True, "lr": 1.5e-4, "batch_size": 32, "warmup": 20}

    @classmethod
    def heldout(cls, meta: dict[str, Any], data: str | None = None, text_column: str | None = None,
                label_column: str | None = None, split: str = "test") -> tuple[list[str], list[str]]:
        """(texts, label names) that `tformer eval` scores: the rows of `data`, whole; else the run's `split`
        (test, validation; "held-out": the one held-out split of a run from before test splits), rebuilt
        from what `meta()` recorded (this task's defaults for what it did not). The columns given override
        the run's."""
        columns = (text_column or recorded(cls, meta, "text_column"),
                   label_column or recorded(cls, meta, "label_column"))
        if data is not None:
            whole = load_data(data, *columns)
            return whole.texts, whole.labels
        whole = load_data(recorded(cls, meta, "data"), *columns)
        test = meta.get("heldout", {}).get("test_fraction", 0.0)   # not recorded: no test split
        rows = splits(whole, recorded(cls, meta, "val_fraction"), test, recorded(cls, meta, "seed"))
        rows = rows["validation" if split == "held-out" else split]
        return [whole.texts[i] for i in rows], [whole.labels[i] for i in rows]

    def __init__(self, opts: ClassifyOptions, tokenizer=None, init: str | None = None):
        self.opts = opts
        self.seed = opts.seed
        self.val_fraction = opts.val_fraction
        self.data_name = arg(opts, "data", "rotten-tomatoes")
        self.test_fraction = test_fraction_of(opts, self.data_name in corpora.CLASSIFY_CORPORA)
        self.columns = (opts.text_column, opts.label_column)
        data = load_data(self.data_name, *self.columns, errors=opts.errors)
        self.label_names = sorted(set(data.labels))
        if len(self.label_names) < 2:
            raise DataError(f"{data.name} has only one label ({self.label_names[0]!r}); "
                            "classification needs two or more")
        label_id = {name: i for i, name in enumerate(self.label_names)}
        rows = splits(data, self.val_fraction, self.test_fraction, self.seed)
        train_idx, val_idx = rows["train"], rows["validation"]   # the test rows stay unread until `tformer eval`
        unseen = sorted(set(data.labels[i] for i in val_idx + rows["test"]) - set(data.labels[i] for i in train_idx))
        if unseen:
            raise DataError(f"label(s) {', '.join(map(repr, unseen))} occur only in the held-out split, never in "
                            "training (add more examples of them, or lower --val-fraction / --test-fraction)")
        self.init = init if init is not None else arg(opts, "init")  # on --resume the CLI passes init=None
        self.token_dropout = arg(opts, "token_dropout", 0.0 if self.init is not None else 0.1)
        if not 0.0 <= self.token_dropout < 1.0:
            raise ConfigError(f"--token-dropout {self.token_dropout} must be in [0, 1)")
        self.freeze_embeddings = bool(arg(opts, "freeze_embeddings", False))
        self.pooling = arg(opts, "pooling", "mean" if self.init is not None and _mean_pooled(self.init) else "first")
        self.pretrained = None
        if init is not None and tokenizer is None:
            self.pretrained, tokenizer = load_pretrained_encoder(init)
        if tokenizer is None:
            tokenizer = make_tokenizer(arg(opts, "tokenizer", "wordpiece"), [data.texts[i] for i in train_idx],
                                       arg(opts, "vocab_size", DEFAULT_VOCAB))
        self.tokenizer = tokenizer
        if tokenizer.pad_id is None:
            raise DataError("the tokenizer has no padding token (<pad> or [PAD]); classification pads batches")
        limit = self.pretrained.cfg.max_seq_len if self.pretrained is not None else None
        self.max_len = min(arg(opts, "max_len", DEFAULT_MAX_LEN), limit or 10**9)
        seqs, cut = encode_texts(tokenizer, data.texts, self.max_len)
        if cut:
            warn(f"{cut} of {len(seqs)} texts are longer than --max-len {self.max_len} tokens and were truncated")
        self.train_seqs = [seqs[i] for i in train_idx]
        self.train_labels = [label_id[data.labels[i]] for i in train_idx]
        self.by_length = sorted(range(len(self.train_seqs)), key=lambda i: len(self.train_seqs[i]))
        self.val_texts = [data.texts[i] for i in val_idx]
        self.val_labels = [label_id[data.labels[i]] for i in val_idx]

    # --- the Task protocol ------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        if self.init is not None:
            encoder = self.pretrained
            if encoder is None:  # resuming: the tokenizer came from the run, the weights from --init
                encoder, _ = load_pretrained_encoder(self.init)
            cfg = encoder.cfg
            cfg = cfg.replace(**dropout_overrides(self.opts))
            model = EncoderClassifier(cfg, len(self.label_names), self.label_names, self.pooling)
            model.encoder.load_state_dict(encoder.state_dict())
            model.encoder.embed.requires_grad_(not self.freeze_embeddings)  # frozen: the optimizer skips them
            return model
        cfg = model_config(self.opts, "encoder", self.tokenizer.vocab_size, self.max_len, DEFAULT_MODEL,
                           pad_token_id=self.tokenizer.pad_id)
        return EncoderClassifier(cfg, len(self.label_names), self.label_names, self.pooling)

    def batch(self, step: int, split: str = "train") -> dict[str, Tensor]:
        g = step_generator(self.seed, step)
        rows = length_grouped_rows(self.by_length, self.opts.batch_size, g)
        seqs = [self.train_seqs[i] for i in rows]
        if self.token_dropout:
            seqs = [drop_tokens(seq, self.token_dropout, g) for seq in seqs]
        ids, mask = pad(seqs, self.tokenizer.pad_id)
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([self.train_labels[i] for i in rows])}

    def loss(self, model, batch: dict[str, Tensor]) -> Tensor:
        logits = model(batch["input_ids"], batch["attention_mask"])
        return F.cross_entropy(logits.float(), batch["labels"])

    def tokens(self, batch: dict[str, Tensor]) -> int:
        return int(batch["attention_mask"].sum())

    def evaluate(self, model) -> dict[str, float]:
        s = score(model, self.tokenizer, self.val_texts, self.val_labels, self.max_len, self.label_names)
        return {"val_loss": s["val_loss"], "val_accuracy": s["accuracy"], "val_macro_f1": s["macro_f1"]}

    def sample(self, model) -> str:
        texts = self.val_texts[:2]
        probs = predict_proba(model, self.tokenizer, texts, self.max_len)
        return "  ".join(f"{_short(t)!r} -> {self.label_names[int(p.argmax())]} {float(p.max()):.2f}"
                         for t, p in zip(texts, probs))

    def meta(self) -> dict[str, Any]:
        return {"labels": self.label_names, "max_len": self.max_len, "init": self.init, "pooling": self.pooling,
                "token_dropout": self.token_dropout, "freeze_embeddings": self.freeze_embeddings,
                "heldout": {"data": self.data_name, **split_record(self.val_fraction, self.test_fraction),
                            "seed": self.seed, "text_column": self.columns[0], "label_column": self.columns[1]}}

    def report(self, model, out_dir=None) -> str:
        """The final report on the validation split (the test split is `tformer eval`'s): accuracy, macro-F1,
        the confusion matrix (and confusion.png)."""
        s = score(model, self.tokenizer, self.val_texts, self.val_labels, self.max_len, self.label_names)
        if out_dir is not None:
            write_confusion_png(s["confusion"], self.label_names, out_dir)
        return (f"validation ({len(self.val_labels)} texts): accuracy {s['accuracy']:.4f}  "
                f"macro-F1 {s['macro_f1']:.4f}\n" + format_confusion(s["confusion"], self.label_names))


def write_confusion_png(matrix, labels, out_dir) -> None:
    from pathlib import Path

    try:
        from ..inspect.viz import plot_confusion
    except ImportError:
        return
    plot_confusion(matrix, labels, Path(out_dir) / "confusion.png")


def _mean_pooled(init: str) -> bool:
    """Whether --init is a sentence-transformers model trained with mean pooling (1_Pooling/config.json)."""
    import json
    from pathlib import Path

    path = Path(init) / "1_Pooling" / "config.json"
    try:
        return bool(json.loads(path.read_text()).get("pooling_mode_mean_tokens"))
    except (OSError, ValueError):
        return False


def _short(text: str, n: int = 40) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"

