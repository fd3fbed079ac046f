"""`tformer classify`: label texts with a trained classifier.

    tformer classify --model runs/sentiment "A gorgeous, witty film." "Dull and overlong."
    cat reviews.txt | tformer classify --model runs/sentiment

One output line per input, in order: the label (as named in the training data) and its probability,
separated by a tab. Texts longer than the model's context are cut, with a warning on stderr.
"""

from __future__ import annotations

import argparse

from tformer.cli import COMMANDS
from tformer.cli.args import positive_int
from tformer.cli.common import load_task_model, read_inputs


def register(sub) -> None:
    p = sub.add_parser("classify", help=COMMANDS["classify"], description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("texts", nargs="*", metavar="TEXT", help="texts to label (default: one per line on stdin)")
    p.add_argument("--model", required=True, metavar="DIR",
                   help="a classifier checkpoint or run directory (of a run: its best/ model when it has one, "
                        "else the newest checkpoint)")
    p.add_argument("--all", action="store_true", help="print every label's probability, not just the best")
    p.add_argument("--batch-size", type=positive_int, default=64, help="texts per forward pass (default 64)")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from tformer.errors import ConfigError, warn
    from tformer.evaluation.classify import encode_texts, predict_proba

    if args.batch_size < 1:
        raise ConfigError("--batch-size must be at least 1")
    texts = read_inputs(args.texts)
    model, tokenizer, max_len, meta = load_task_model(args.model, "classifier", "a classifier", "classify")
    labels = model.labels or meta.get("labels") or [str(i) for i in range(model.num_labels)]
    _, cut = encode_texts(tokenizer, texts, max_len)
    if cut:
        warn(f"{cut} input(s) longer than the model's {max_len} tokens were truncated")
    model.eval()
    probs = predict_proba(model, tokenizer, texts, max_len, args.batch_size)
    for p in probs:
        if args.all:
            print("\t".join(f"{labels[i]} {float(p[i]):.4f}" for i in torch.argsort(p, descending=True).tolist()))
        else:
            k = int(p.argmax())
            print(f"{labels[k]}\t{float(p[k]):.4f}")
    return 0
