"""`tformer tag`: label each word of texts with a trained tagger (named entities).

    tformer tag --model runs/ner "Ed Miliband flew to Paris on Monday"
    cat tweets.txt | tformer tag --model runs/ner --conll

One output line per input, in order: the words, each entity in brackets with its type,
e.g. `[Ed Miliband](person) flew to [Paris](geo-loc) on Monday`. With --conll: every word with
its label (`word<TAB>label`, the training format), a blank line after each input.
A text is cut into words at spaces, with punctuation split off (@names, #tags and URLs stay whole);
words past the model's context are labelled O, with a warning on stderr.
"""

from __future__ import annotations

import argparse

from tformer.cli import COMMANDS
from tformer.cli.args import positive_int


def register(sub) -> None:
    p = sub.add_parser("tag", help=COMMANDS["tag"], description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("texts", nargs="*", metavar="TEXT", help="texts to tag (default: one per line on stdin)")
    p.add_argument("--model", required=True, metavar="DIR",
                   help="a tagger checkpoint or run directory (of a run: its best/ model when it has one, "
                        "else the newest checkpoint)")
    p.add_argument("--conll", action="store_true", help="print `word<TAB>label` lines instead of bracketed entities")
    p.add_argument("--batch-size", type=positive_int, default=64, help="texts per forward pass (default 64)")
    p.set_defaults(func=run)


def run(args) -> int:
    from tformer.cli.common import load_task_model, read_inputs
    from tformer.errors import warn
    from tformer.evaluation.tag import predict_tags
    from tformer.evaluation.words import encode_words, format_entities, split_words

    texts = read_inputs(args.texts)
    model, tokenizer, max_len, _ = load_task_model(args.model, "tagger", "a tagger", "tag")
    sentences = [split_words(t) for t in texts]
    _, _, cut = encode_words(tokenizer, sentences, max_len)
    if cut:
        warn(f"{cut} input(s) longer than the model's {max_len} tokens: their last words are labelled O")
    for words, tags in zip(sentences, predict_tags(model.eval(), tokenizer, sentences, max_len, args.batch_size)):
        if args.conll:
            print("".join(f"{w}\t{t}\n" for w, t in zip(words, tags)))
        else:
            print(format_entities(words, tags))
    return 0
