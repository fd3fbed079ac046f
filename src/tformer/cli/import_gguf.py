"""`tformer import-gguf FILE.gguf DST`: a GGUF file (llama.cpp's gpt2 or llama) -> a tformer checkpoint.

    tformer import-gguf lm.gguf runs/lm-back                # then: tformer generate runs/lm-back ...
    tformer import-gguf model.gguf runs/model --force       # replace an existing DST

F32, F16, BF16 and Q8_0 tensors are read (dequantised to fp32); other quantisations are refused.
The byte-level BPE tokenizer becomes tokenizer.json, the chat template chat_template.jinja (with the
special tokens in tokenizer_config.json), where `tformer serve` finds them.
"""

from __future__ import annotations

import json
from pathlib import Path

from tformer.cli import COMMANDS
from tformer.cli.common import check_destination


def register(sub) -> None:
    p = sub.add_parser("import-gguf", help=COMMANDS["import-gguf"], description=COMMANDS["import-gguf"])
    p.add_argument("src", metavar="FILE.gguf", help="GGUF file (general.architecture gpt2 or llama)")
    p.add_argument("dst", metavar="DST", help="directory for the tformer checkpoint (created)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists and is not empty")
    p.set_defaults(func=run)


def run(args) -> int:
    from tformer.checkpoints.format import save
    from tformer.checkpoints.gguf import from_gguf
    from tformer.checkpoints.hf import hf_family
    from tformer.data.chat_template import TEMPLATE_FILE, TOKENIZER_CONFIG

    src, dst = Path(args.src), Path(args.dst)
    check_destination(src, dst, args.force)
    model, tokenizer, chat_template = from_gguf(src)
    arch = hf_family(model).MODEL_TYPE                   # the GGUF architecture has the HF family's name
    extra = {}
    if chat_template:
        names = {role: _token(tokenizer, getattr(model.cfg, f"{role}_token_id")) for role in ("bos", "eos")}
        extra = {TEMPLATE_FILE: chat_template.encode("utf-8"),
                 TOKENIZER_CONFIG: json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                               **{f"{r}_token": t for r, t in names.items() if t}},
                                              indent=2).encode("utf-8")}
    save(model, dst, tokenizer=tokenizer, extra_files=extra,
         meta={"source": "gguf", "gguf_architecture": arch, "gguf_file": str(src.resolve())})
    n = sum(p.numel() for p in model.parameters())
    parts = "".join(s for s, present in ((" + tokenizer.json", tokenizer), (" + chat template", chat_template))
                    if present)
    print(f"imported GGUF {arch} as {type(model).__name__} ({n / 1e6:.2f}M parameters){parts}: {dst}")
    return 0


def _token(tokenizer, token_id: int | None) -> str | None:
    return tokenizer.hf.id_to_token(token_id) if tokenizer is not None and token_id is not None else None
