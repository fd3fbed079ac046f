"""`tformer export-hf SRC DST`: a tformer checkpoint -> a Hugging Face model directory.

    tformer export-hf runs/minilm hf/minilm          # then: transformers.AutoModel.from_pretrained("hf/minilm")
    tformer export-hf runs/lm-20250101-120000 hf/lm  # a run directory: its newest checkpoint
    tformer export-hf runs/lora hf/lora-merged       # a LoRA run: base + adapter merged into one model
    tformer export-hf runs/lora hf/adapter --adapter # ... or the adapter alone in peft's format, for
                                                     # PeftModel.from_pretrained(<the base exported>, "hf/adapter")

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
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA run: write its adapter alone in peft's format (adapter_config.json + "
                        "adapter_model.safetensors) for the base exported with export-hf (default: the merged model)")
    p.set_defaults(func=run)


class _CopyFile:
    """Saves the checkpoint's tokenizer.json byte for byte (to_hf calls .save(path))."""

    def __init__(self, path: Path):
        self.path = path

    def save(self, path: str) -> None:
        shutil.copyfile(self.path, path)


def run(args) -> int:
    from tformer.checkpoints.adapter import base_dir, read_adapter_config
    from tformer.checkpoints.format import TOKENIZER, load, resolve
    from tformer.checkpoints.hf import hf_family, to_hf
    from tformer.checkpoints.hf.lora import to_peft
    from tformer.data.chat_template import TEMPLATE_FILE, TOKENIZER_CONFIG
    from tformer.errors import ConfigError
    from tformer.model.lora import lora_layers, merge, remove_lora

    src, dst = Path(args.src), Path(args.dst)
    check_destination(src, dst, args.force)

    model = load(src)
    family = hf_family(model)                       # refuse before touching DST
    if args.adapter:
        if not lora_layers(model):
            raise ConfigError(f"--adapter: {src} holds no LoRA adapter (export it without --adapter)")
        base = base_dir(resolve(src), read_adapter_config(resolve(src)))
        to_peft(model, dst, base_model_name_or_path=str(base.resolve()))
        print(f"exported the LoRA adapter in peft's format ({family.MODEL_TYPE}): {dst}")
        return 0
    if lora_layers(model):                          # base + adapter: W + s·B A, then plain layers
        remove_lora(merge(model))
    tokenizer_file = resolve(src) / TOKENIZER
    tokenizer = _CopyFile(tokenizer_file) if tokenizer_file.exists() else None
    # the chat template (tformer train --task sft writes one; import-hf copies the model's) goes along
    extra_files = {name: (resolve(src) / name).read_bytes() for name in (TOKENIZER_CONFIG, TEMPLATE_FILE)
                   if tokenizer is not None and (resolve(src) / name).is_file()}
    to_hf(model, dst, tokenizer=tokenizer, extra_files=extra_files)
    extra = " + tokenizer.json" if tokenizer is not None else ""
    extra += " + chat template" if TEMPLATE_FILE in extra_files else ""
    architecture = json.loads((dst / "config.json").read_text())["architectures"][0]  # a tagger: BertFor...
    print(f"exported {type(model).__name__} as {family.MODEL_TYPE} ({architecture}){extra}: {dst}")
    return 0
