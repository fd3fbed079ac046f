"""What the SFT / DPO run tests share: the tiny decoder they start from and a JSONL writer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import tformer
from tformer.data.tokenizers import Tokenizer
from tformer.model.config import ModelConfig
from tformer.model.models import Decoder

TEXT = "what is one two three four five six seven eight nine plus? yes no maybe user assistant " * 20
NUMBERS = "one two three four five six seven eight nine".split()


def write_jsonl(path: Path, lines: list) -> Path:
    """One line per item: a string as it is (bad input for the error tests), anything else as JSON."""
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


def save_base(path: Path) -> Path:
    """A random 2-layer decoder with a 300-piece BPE tokenizer of TEXT, saved at `path`."""
    tok = Tokenizer.train_bpe(TEXT, 300)
    torch.manual_seed(0)
    cfg = ModelConfig(kind="decoder", vocab_size=tok.vocab_size, d_model=32, n_heads=4, n_layers=2, d_ff=64,
                      max_seq_len=64, positional="learned", pad_token_id=tok.pad_id, bos_token_id=tok.bos_id,
                      eos_token_id=tok.eos_id, dropout=0.0)
    tformer.save(Decoder(cfg).eval(), path, tokenizer=tok)
    return path
