"""`tformer export-gguf SRC OUT.gguf`: a decoder checkpoint -> one GGUF file for llama.cpp.

    tformer export-gguf runs/lm lm.gguf                  # f32; then: llama-cli -m lm.gguf
    tformer export-gguf runs/lm lm-q8.gguf --type q8_0   # 8-bit blocks, about a quarter of the size

A GPT-2-shaped decoder becomes llama.cpp's gpt2 architecture, a Llama-shaped one (rotary positions,
RMSNorm, SwiGLU) its llama; the checkpoint's byte-level BPE tokenizer and chat template go with it.
"""

from __future__ import annotations

from pathlib import Path

from tformer.cli import COMMANDS
from tformer.cli.common import check_file_destination


def register(sub) -> None:
    p = sub.add_parser("export-gguf", help=COMMANDS["export-gguf"], description=COMMANDS["export-gguf"])
    p.add_argument("src", metavar="SRC", help="tformer checkpoint or run directory (its newest checkpoint)")
    p.add_argument("out", metavar="OUT.gguf", help="the GGUF file to write")
    p.add_argument("--type", choices=("f32", "f16", "bf16", "q8_0"), default="f32",
                   help="tensor type of the matrices (norms and biases stay f32; default: f32)")
    p.add_argument("--no-tokenizer", action="store_true",
                   help="write the model alone, without the checkpoint's tokenizer (e.g. a char tokenizer)")
    p.add_argument("--force", action="store_true", help="replace OUT.gguf if it exists")
    p.set_defaults(func=run)


def run(args) -> int:
    from tformer.checkpoints.format import TOKENIZER, load, resolve
    from tformer.checkpoints.gguf import to_gguf
    from tformer.checkpoints.hf import hf_family
    from tformer.data.chat_template import chat_template_source
    from tformer.data.tokenizers import Tokenizer

    src, out = Path(args.src), Path(args.out)
    check_file_destination(src, out, args.force)
    model = load(src)
    ckpt = resolve(src)
    tokenizer = None if args.no_tokenizer or not (ckpt / TOKENIZER).is_file() else Tokenizer.from_file(ckpt / TOKENIZER)
    chat_template = chat_template_source(ckpt)
    to_gguf(model, out, tokenizer=tokenizer, chat_template=chat_template, type=args.type)
    arch = hf_family(model).MODEL_TYPE                   # the GGUF architecture has the HF family's name
    extra = "".join(s for s, present in ((" + tokenizer", tokenizer), (" + chat template", chat_template)) if present)
    print(f"exported {type(model).__name__} as GGUF {arch} ({args.type}){extra}: {out}")
    return 0
