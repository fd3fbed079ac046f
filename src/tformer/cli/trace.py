"""`tformer trace`: print one input's path through the model, step by step, with shapes.

    tformer trace --model runs/shakespeare --text "To be"
    tformer trace --model runs/numbers --text "vingt et un" --target "twenty-one" --token 2 --head 1

Every step of the seeds appears in order — embeddings (B, T, D); Q, K, V per head (B, H, T, d_k);
scores S = QKᵀ/√d_k; mask; α = softmax(S); the weighted sum αV; concat; output projection W_O;
FFN; norm; residual — with its shape and the first numbers of the followed token's vectors.
"""

from __future__ import annotations

from tformer.cli import COMMANDS
from tformer.cli.args import nonneg_int, positive_int


def register(sub) -> None:
    p = sub.add_parser("trace", help=COMMANDS["trace"], description=COMMANDS["trace"])
    p.add_argument("--model", required=True, metavar="DIR",
                   help="checkpoint or run directory (its newest checkpoint), with its tokenizer.json")
    p.add_argument("--text", required=True, help="the input text (for an encoder-decoder: the source)")
    p.add_argument("--target", default=None,
                   help="encoder-decoder only: the target text the decoder reads (default: the model's own "
                        "greedy translation of --text)")
    p.add_argument("--token", type=int, default=None, metavar="I",
                   help="position of the token to follow; negative counts from the end (default: the last; "
                        "the first for a classifier, whose head reads it)")
    p.add_argument("--head", type=nonneg_int, default=0, metavar="H", help="attention head to show (default 0)")
    p.add_argument("--numbers", type=positive_int, default=4, metavar="N",
                   help="how many numbers of each vector to print (default %(default)s)")
    p.set_defaults(func=run)


def run(args) -> int:
    from tformer.checkpoints.format import load, load_source_tokenizer, load_tokenizer
    from tformer.errors import ConfigError
    from tformer.inspect.trace import prepare, trace

    if args.numbers < 1:
        raise ConfigError(f"--numbers {args.numbers} must be at least 1")
    tokenizer = load_tokenizer(args.model)
    model = load(args.model)
    inputs = prepare(model, tokenizer, args.text, args.target, source_tokenizer=load_source_tokenizer(args.model))
    print(trace(model, inputs, tokenizer, token=args.token, head=args.head, n_numbers=args.numbers))
    return 0
