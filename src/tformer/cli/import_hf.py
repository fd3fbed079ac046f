"""`tformer import-hf SRC DST`: a Hugging Face model directory -> a tformer checkpoint.

    tformer import-hf path/to/all-MiniLM-L6-v2 runs/minilm       # BERT -> Encoder (+ tokenizer.json)
    tformer import-hf path/to/gpt2 runs/gpt2 --force              # replace an existing DST
"""

from __future__ import annotations

import sys
from pathlib import Path

from tformer.cli import COMMANDS
from tformer.cli.common import check_destination


def register(sub) -> None:
    p = sub.add_parser("import-hf", help=COMMANDS["import-hf"], description=COMMANDS["import-hf"])
    p.add_argument("src", metavar="SRC", help="Hugging Face model directory (config.json + model.safetensors or "
                   "pytorch_model.bin; model_type gpt2, bert, marian, bart or llama)")
    p.add_argument("dst", metavar="DST", help="directory for the tformer checkpoint (created)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists and is not empty")
    p.set_defaults(func=run)


def run(args) -> int:
    from tformer.checkpoints.format import save
    from tformer.checkpoints.hf import convert_hf, load_hf_tokenizer, read_hf_config

    src, dst = Path(args.src), Path(args.dst)
    check_destination(src, dst, args.force)
    model, dropped = convert_hf(src)
    tokenizer = load_hf_tokenizer(src)
    model_type = read_hf_config(src)["model_type"]
    # the chat template (and the special tokens it writes) travel with the model, for `tformer serve`
    extra = {name: (src / name).read_bytes() for name in ("tokenizer_config.json", "chat_template.jinja")
             if (src / name).is_file()}
    save(model, dst, tokenizer=tokenizer, meta={"source": "huggingface", "hf_model_type": model_type,
                                                "hf_dir": str(src.resolve())}, extra_files=extra)
    for why in dict.fromkeys(dropped.values()):          # say what was left out, once per reason
        keys = [k for k, w in dropped.items() if w == why]
        print(f"note: not imported: {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''} ({why})",
              file=sys.stderr)
    n = sum(p.numel() for p in model.parameters())
    extra = " + tokenizer.json" if tokenizer is not None else ""
    print(f"imported {model_type} as {type(model).__name__} ({n / 1e6:.2f}M parameters){extra}: {dst}")
    return 0
