"""`tformer export-hf SRC DST`: a tformer checkpoint -> a Hugging Face model directory.

    tformer export-hf runs/minilm hf/minilm          # then: transformers.AutoModel.from_pretrained("hf/minilm")
    tformer export-hf runs/lm-20250101-120000 hf/lm  # a run directory: its newest checkpoint

The family follows from the model's config: decoder -> gpt2 or llama, encoder -> bert,
encoder-decoder -> marian or bart; a config no family represents exactly is refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tformer.cli import COMMANDS
from tformer.cli.common import check_destination


def register(sub) -> None:
    p = sub.add_parser("export-hf", help=COMMANDS["export-hf"], description=COMMANDS["export-hf"])
    p.add_argument("src", metavar="SRC", help="tformer checkpoint or run directory (its newest checkpoint)")
    p.add_argument("dst", metavar="DST", help="directory for the Hugging Face files (created)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists and is not empty")
    p.set_defaults(func=run)


class _CopyFile:
    """Saves the checkpoint's tokenizer.json byte for byte (to_hf calls .save(path))."""

    def __init__(self, path: Path):
        self.path = path

    def save(self, path: str) -> None:
        shutil.copyfile(self.path, path)


def run(args) -> int:
    from tformer.checkpoints.format import TOKENIZER, load, resolve
    from tformer.checkpoints.hf import hf_family, to_hf

    src, dst = Path(args.src), Path(args.dst)
    check_destination(src, dst, args.force)
    model = load(src)
    family = hf_family(model)                       # refuse before touching DST
    tokenizer_file = resolve(src) / TOKENIZER
    tokenizer = _CopyFile(tokenizer_file) if tokenizer_file.exists() else None
    to_hf(model, dst, tokenizer=tokenizer)
    extra = " + tokenizer.json" if tokenizer is not None else ""
    architecture = json.loads((dst / "config.json").read_text())["architectures"][0]  # a tagger: BertFor...
    print(f"exported {type(model).__name__} as {family.MODEL_TYPE} ({architecture}){extra}: {dst}")
    return 0
