"""`tformer translate`: translate lines with a trained encoder-decoder.

    tformer translate --model runs/numbers "quatre-vingt-dix-sept"
    tformer translate --model runs/numbers --num-beams 4 < sentences.txt

One output line per input, in order.
"""

from __future__ import annotations

import argparse

from tformer.cli import COMMANDS
from tformer.cli.args import positive_int
from tformer.cli.common import load_task_model, read_inputs


def register(sub) -> None:
    p = sub.add_parser("translate", help=COMMANDS["translate"], description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("texts", nargs="*", metavar="TEXT", help="sentences to translate (default: one per line on stdin)")
    p.add_argument("--model", required=True, metavar="DIR", help="an encoder-decoder checkpoint or run directory")
    p.add_argument("--num-beams", type=positive_int, default=4, help="beam search width; 1 = greedy (default 4)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="sentences per batch (default 32)")
    p.set_defaults(func=run)


def run(args) -> int:
    from tformer.checkpoints.format import load_source_tokenizer
    from tformer.errors import ConfigError, warn
    from tformer.evaluation.translate import encode_pairs, translate

    if args.num_beams < 1 or args.batch_size < 1:
        raise ConfigError("--num-beams and --batch-size must be at least 1")
    texts = read_inputs(args.texts, "sentence")
    model, tokenizer, max_len, _ = load_task_model(args.model, "encoder-decoder", "an encoder-decoder", "translate")
    source_tokenizer = load_source_tokenizer(args.model)  # None: one vocabulary for both languages
    src, _ = encode_pairs(tokenizer, texts, None, max_len + 1, source_tokenizer)
    cut = sum(len(s) > max_len for s in src)
    if cut:
        warn(f"{cut} input(s) longer than the model's {max_len} tokens were truncated")
    from tformer.inference.limits import check_generation
    check_generation(model.cfg, min(args.batch_size, len(texts)) * args.num_beams, max_len,
                     fix="lower --num-beams or --batch-size")
    for line in translate(model, tokenizer, texts, args.num_beams, max_len, args.batch_size, source_tokenizer):
        print(line, flush=False)
    return 0
