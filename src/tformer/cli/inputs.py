"""What the labelling commands (classify, translate) share: their inputs and their model."""

from __future__ import annotations

import sys


def read_inputs(texts: list[str], what: str = "text") -> list[str]:
    """The texts from the command line, else the lines of stdin; an empty one is an error (it would
    silently shift every later output line against its input)."""
    from tformer.errors import DataError

    if not texts:
        if sys.stdin.isatty():
            raise DataError(f"no input: give {what}s as arguments or pipe lines on stdin")
        texts = sys.stdin.read().splitlines()
        where = "line"
    else:
        where = "argument"
    for i, t in enumerate(texts, 1):
        if not t.strip():
            raise DataError(f"{where} {i} is empty (every input {what} must have some text)")
    if not texts:
        raise DataError("no input: stdin was empty")
    return texts


def load_task_model(path: str, cls: type, what: str, task: str):
    """(model, tokenizer, max_len, meta) of a checkpoint that must hold a `cls` (`what` in messages)."""
    from tformer.checkpoint import load, read_config
    from tformer.errors import CheckpointError
    from tformer.tokenizers import load_tokenizer

    model = load(path)
    if not isinstance(model, cls):
        raise CheckpointError(f"{path} holds a {type(model).__name__}, not {what} "
                              f"(train one with `tformer train --task {task}`)")
    tokenizer = load_tokenizer(path)
    meta = read_config(path).get("meta", {})
    max_len = min(int(meta.get("max_len", model.cfg.max_seq_len)), model.cfg.max_seq_len)
    return model, tokenizer, max_len, meta
