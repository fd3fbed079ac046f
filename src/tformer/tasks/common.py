"""Pieces the tasks share: options and their defaults, length-grouped batches, model configs, --init loading.
Padding is evaluation.batching's (scoring pads the same way)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..data.splits import TEST_SEED
from ..errors import CheckpointError, ConfigError
from ..model.config import PRESETS, ModelConfig

BUILTIN_TEST_FRACTION = 0.1   # a built-in data set's test split; a user's file has none unless --test-fraction


def arg(opts, name: str, default: Any = None) -> Any:
    """opts.name, or `default` when that option was left unset (None: the task decides)."""
    value = getattr(opts, name)
    return default if value is None else value


def recorded(task: type, meta: dict[str, Any], key: str) -> Any:
    """How a run built its held-out split: meta["heldout"][key] as the task's meta() recorded it, else
    the task's own default (its default_data for "data", else its Options field's default)."""
    held = meta.get("heldout", {})
    if key in held:
        return held[key]
    return task.default_data if key == "data" else getattr(task.Options, key)


def test_fraction_of(opts, builtin: bool) -> float:
    """--test-fraction, else BUILTIN_TEST_FRACTION on built-in data and 0 (no test split) on a user's file."""
    return float(arg(opts, "test_fraction", BUILTIN_TEST_FRACTION if builtin else 0.0))


def split_record(val_fraction: float, test_fraction: float) -> dict[str, Any]:
    """What meta() records of a run's three splits (tformer.data.splits), so `tformer eval` can rebuild them."""
    return {"val_fraction": val_fraction, "test_fraction": test_fraction, "test_seed": TEST_SEED}


def eval_split(held: dict[str, Any], asked: str | None) -> str:
    """The split `tformer eval` scores of a run whose split_record() is in `held`: `asked` (validation or
    test), by default test where the run has one, else validation. A run recorded before test splits (no
    test_seed) has one held-out split, which also validated it: "held-out", for either but test."""
    if "test_seed" not in held:
        if asked == "test":
            raise ConfigError("this run was trained before tformer kept a test split apart: it has one held-out "
                              "split, which also validated it (score it with --split validation, or pass --data)")
        return "held-out"
    has_test = float(held.get("test_fraction", 0.0)) > 0.0
    if asked == "test" and not has_test:
        raise ConfigError("this run has no test split (--test-fraction 0, the default for a user's file): score "
                          "--split validation, or pass --data with a file of its own")
    return asked or ("test" if has_test else "validation")


def length_grouped_rows(order: list[int], batch_size: int, generator) -> list[int]:
    """`batch_size` rows drawn at random from a random window of 4 x batch_size neighbours in
    `order` (the training rows sorted by length): the rows of a batch have similar lengths, so
    little compute goes to padding, and every row can meet many different partners."""
    window = min(len(order), 4 * batch_size)
    start = int(torch.randint(0, len(order) - window + 1, (1,), generator=generator))
    picks = torch.randint(0, window, (batch_size,), generator=generator)
    return [order[start + int(i)] for i in picks]


def model_config(opts, kind: str, vocab_size: int, max_len: int, default: dict[str, Any], **fixed: Any) -> ModelConfig:
    """The preset named by --preset, or else the task's own default shape (`default`: sized for minutes
    of CPU training), with the vocabulary, kind and length of the task, and the dropout flags when given."""
    name = opts.preset
    if name is not None and name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    base = PRESETS[name] if name is not None else default
    settings = {**fixed, **base, "kind": kind, "vocab_size": vocab_size,
                "max_seq_len": max(max_len, base.get("max_seq_len", 0))}
    return ModelConfig(**{**settings, **dropout_overrides(opts)})


def dropout_overrides(opts) -> dict[str, float]:
    """--dropout and --attn-dropout, where given, as ModelConfig fields."""
    return {name: getattr(opts, name) for name in ("dropout", "attn_dropout") if getattr(opts, name) is not None}


def is_tformer_checkpoint(path: Path) -> bool:
    import json

    from ..checkpoints.layout import CONFIG, resolve

    try:
        config = json.loads((resolve(path) / CONFIG).read_text())
    except (CheckpointError, OSError, ValueError):
        return False
    return config.get("format") == "tformer"


def load_pretrained_encoder(init: str):
    """(Encoder, Tokenizer) from --init: a tformer checkpoint (an Encoder, or a classifier or tagger, whose
    encoder is taken) or a Hugging Face BERT directory (converted with tformer.from_hf). The tokenizer
    is the one saved with it: a pretrained encoder only understands its own token ids."""
    from ..checkpoints.adapter import merged
    from ..checkpoints.format import load, load_tokenizer
    from ..data.tokenizers import Tokenizer

    path = Path(init)
    if not path.exists():
        raise CheckpointError(f"--init {init}: no such directory")
    if is_tformer_checkpoint(path):
        model = merged(load(path), path)   # a LoRA run: base + adapter in one model
        tokenizer = load_tokenizer(path)
    else:
        if not (path / "config.json").is_file():
            raise CheckpointError(f"--init {init}: not a tformer checkpoint nor a Hugging Face directory "
                                  "(no config.json)")
        from ..checkpoints.hf import from_hf

        model = from_hf(path)
        if not (path / "tokenizer.json").is_file():
            raise CheckpointError(f"--init {init} has no tokenizer.json (the pretrained encoder needs its "
                                  "own tokenizer)")
        tokenizer = Tokenizer.from_file(path / "tokenizer.json")
    if model.kind in ("classifier", "tagger"):  # a fine-tuned encoder: start from its encoder
        model = model.encoder
    if model.kind != "encoder":
        raise CheckpointError(f"--init {init} holds a {type(model).__name__}; fine-tuning needs an encoder "
                              "(BERT family)")
    return model, tokenizer
