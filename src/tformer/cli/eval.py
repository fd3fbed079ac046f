"""`tformer eval`: score a checkpoint on held-out data, by default the run's test split.

    tformer eval --model runs/hamlet                 # the test text (Hamlet's last 10%): loss, perplexity
    tformer eval --model runs/sentiment --json    # test texts: loss, accuracy, macro-F1 (+ confusion)
    tformer eval --model runs/numbers --num-beams 4   # test pairs: loss, BLEU, chrF, exact match
    tformer eval --model runs/ner --split validation  # validation sentences: loss, entity precision/recall/F1
    tformer eval --model runs/assistant               # --task sft: the loss over the trained (assistant) tokens
    tformer eval --model runs/preferred               # --task dpo: preference accuracy, mean rewards and margin
    tformer eval --model runs/prefer --data tformer-instruct   # an assistant on tformer-instruct's test split

Without --data the run's own split is rebuilt from what its checkpoint records (data, fractions,
seeds; tformer.data.splits): the test split by default, which training never looked at, or with
--split validation the split it validated on (and --keep-best chose on). A first line says which (on
stderr with --json; the figures keep their names, val_loss included, whatever the split). A run on a
user's file has no test split unless trained with --test-fraction: eval scores its validation split and
says so; a run from before test splits has one held-out split, which it also validated on: eval scores
that and says so. With --data: a text file
(language model), a CSV/TSV/JSONL table (classifier), a TSV/JSONL of pairs (translator), a CoNLL
file of `word label` lines (tagger), a JSONL of conversations (sft) or of preference pairs (dpo),
scored whole. A LoRA run is scored as base + adapter; a DPO run against its reference: the base with
the adapters off (LoRA), else the --init checkpoint the run records.
"""
# What to score is the task's to say (its `heldout`, found through the task registry); how to score
# it is the evaluation layer's, which `tformer classify/tag/translate` and the server share.

from __future__ import annotations

import argparse
import json
import math

from tformer.cli import COMMANDS
from tformer.cli.args import positive_int

# The task that trains each kind of model, and so says how its held-out split was built.
TASK_OF_KIND = {"decoder": "lm", "classifier": "classify", "tagger": "tag", "encoder-decoder": "translate"}
INSTRUCT = "tformer-instruct"   # --data: an assistant's figures on its test split (tformer.evaluation.instruct)
# Decoders fine-tuned on chat data: the task the checkpoint records (meta "task") says how to score them.
CHAT_TASKS = ("sft", "dpo")


def register(sub) -> None:
    p = sub.add_parser("eval", help=COMMANDS["eval"], description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR",
                   help="checkpoint or run directory (of a run: its best/ model when it has one, "
                        "else the newest checkpoint)")
    p.add_argument("--data", default=None, help="data to score (default: the run's held-out split)")
    p.add_argument("--json", action="store_true", help="print one JSON object (keys val_loss, perplexity, accuracy, "
                   "macro_f1, bleu, chrf, exact_match, precision, recall, f1, rewards/chosen, rewards/rejected, "
                   "rewards/margins: those that apply)")
    p.add_argument("--num-beams", type=positive_int, default=1, help="translation: beam width, 1 = greedy (default 1)")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N", help="score only the first N examples")
    p.add_argument("--split", choices=("validation", "test"), default=None,
                   help="which split of the run's data to score (default: test, where the run has one)")
    p.add_argument("--text-column", default=None, help="classification --data: the text column (default: the run's)")
    p.add_argument("--label-column", default=None, help="classification --data: the label column (default: the run's)")
    p.set_defaults(func=run)


def run(args) -> int:
    from tformer.checkpoints.format import load, load_tokenizer, read_config
    from tformer.errors import ConfigError
    from tformer.training.config import task_class

    if args.num_beams < 1 or (args.limit is not None and args.limit < 1):
        raise ConfigError("--num-beams and --limit must be at least 1")
    model = load(args.model)   # a LoRA checkpoint: its base + the adapter
    model.eval()
    scorers = {"classify": eval_classifier, "tag": eval_tagger, "translate": eval_translator,
               "lm": lambda *a: (eval_lm(*a), ""), "sft": eval_sft, "dpo": eval_dpo}
    if model.kind not in TASK_OF_KIND:
        raise ConfigError(f"{args.model} holds a bare {type(model).__name__}; eval scores a Decoder, "
                          "EncoderClassifier, EncoderTokenClassifier or EncoderDecoder")
    tokenizer = load_tokenizer(args.model)
    meta = read_config(args.model).get("meta", {})
    name = meta["task"] if model.kind == "decoder" and meta.get("task") in CHAT_TASKS else TASK_OF_KIND[model.kind]
    instructed = args.data == INSTRUCT and model.kind == "decoder"
    unused = [flag for flag, given, applies in (("--num-beams", args.num_beams != 1, name == "translate"),
                                                ("--text-column", args.text_column is not None, name == "classify"),
                                                ("--label-column", args.label_column is not None, name == "classify"))
              if given and (instructed or not applies)]
    if unused:   # an error, not quietly unused
        raise ConfigError(f"{' and '.join(unused)} cannot apply to {args.model}: it scores a {type(model).__name__}"
                          f"{' on tformer-instruct' if instructed else ''}")
    if instructed:
        result, extra = eval_instruct(model, tokenizer, args)
    else:
        result, extra = scorers[name](model, tokenizer, meta, args, task_class(name))
    if args.json:
        print(json.dumps(result))
    else:
        print("  ".join(f"{k} {v:.4f}" for k, v in result.items()))
        if extra:
            print(extra)
    return 0


def _limit(items, n):
    return items if n is None else items[:n]


def _split(meta, args, builtin=()) -> str | None:
    """The split of the run's data to score (tformer.tasks.common.eval_split); None: --data, scored whole."""
    from tformer.errors import ConfigError
    from tformer.tasks.common import eval_split

    if args.data is not None and args.data not in builtin:
        if args.split is not None:
            raise ConfigError("--split chooses a split of the run's own data; --data is scored whole")
        return None
    return eval_split(meta.get("heldout", meta), args.split)   # a language model records it at the top level


WHY = {"test": "never used in training",
       "validation": "the run validated on them; --keep-best chose its best checkpoint on them",
       "held-out": "this run is from before tformer kept a test split apart: its one held-out split, which it also "
                   "validated on (and --keep-best chose on), so the figures may flatter it"}


def _say(args, split: str | None, n: int, scored: int, noun: str) -> None:
    """The line that says what was scored: on stdout, or on stderr under --json (stdout: one JSON object)."""
    import sys

    count = f"{scored:,} {noun}" if scored == n else f"the first {scored:,} of {n:,} {noun}"
    line = f"data: {args.data} ({count}, whole)" if split is None else f"split: {split} ({count}, {WHY[split]})"
    print(line, file=sys.stderr if args.json else sys.stdout)


def eval_lm(model, tokenizer, meta, args, task) -> dict[str, float]:
    import torch

    from tformer.errors import ConfigError
    from tformer.evaluation.lm import mean_loss

    if args.data is None and "data" not in meta:
        raise ConfigError(f"{args.model} does not record its training data; pass --data")
    split = _split(meta, args)
    text = task.heldout(meta, args.data, split=split or "test")
    context = min(int(meta.get("context", model.cfg.max_seq_len)), model.cfg.max_seq_len)
    every = tokenizer.encode(text)
    ids = torch.tensor(_limit(every, args.limit), dtype=torch.long)
    if len(ids) < 2:
        raise ConfigError("the text to score has fewer than 2 tokens")
    _say(args, split, len(every), len(ids), "tokens")
    loss = mean_loss(model, ids, context)  # the same windows as validation during training
    return {"val_loss": loss, "perplexity": math.exp(min(loss, 50.0))}


def eval_classifier(model, tokenizer, meta, args, task):
    from tformer.errors import DataError
    from tformer.evaluation.classify import format_confusion, score

    labels = model.labels or meta.get("labels")
    split = _split(meta, args)
    texts, names = task.heldout(meta, args.data, args.text_column, args.label_column, split=split or "test")
    _say(args, split, len(texts), len(_limit(texts, args.limit)), "texts")
    unknown = sorted(set(names) - set(labels))
    if unknown:
        raise DataError(f"label(s) {', '.join(map(repr, unknown))} were not in the model's training data "
                        f"(it knows {', '.join(map(repr, labels))})")
    texts, names = _limit(texts, args.limit), _limit(names, args.limit)
    index = {name: i for i, name in enumerate(labels)}
    max_len = min(int(meta.get("max_len", model.cfg.max_seq_len)), model.cfg.max_seq_len)
    s = score(model, tokenizer, texts, [index[n] for n in names], max_len, labels)
    return ({"val_loss": s["val_loss"], "accuracy": s["accuracy"], "macro_f1": s["macro_f1"]},
            format_confusion(s["confusion"], labels))


def eval_tagger(model, tokenizer, meta, args, task):
    from tformer.evaluation.metrics import entity_report
    from tformer.evaluation.tag import check_labels, label_names, score

    split = _split(meta, args)
    data = task.heldout(meta, args.data, split=split or "test")
    _say(args, split, len(data.words), len(_limit(data.words, args.limit)), "sentences")
    check_labels(data, label_names(model), args.data or data.name)
    words, labels = _limit(data.words, args.limit), _limit(data.labels, args.limit)
    max_len = min(int(meta.get("max_len", model.cfg.max_seq_len)), model.cfg.max_seq_len)
    s = score(model, tokenizer, words, labels, max_len)
    return {k: s[k] for k in ("val_loss", "precision", "recall", "f1")}, entity_report(s["predicted"], labels)


def eval_translator(model, tokenizer, meta, args, task):
    from tformer.checkpoints.format import load_source_tokenizer
    from tformer.evaluation.translate import score
    from tformer.inference.limits import check_generation

    max_len = min(int(meta.get("max_len", model.cfg.max_seq_len)), model.cfg.max_seq_len)
    check_generation(model.cfg, args.num_beams, max_len, fix="lower --num-beams")  # before any work
    from tformer.tasks.translate import BUILTIN

    split = _split(meta, args, builtin=BUILTIN)
    sources, targets = task.heldout(meta, args.data, split=split or "test")
    _say(args, split, len(sources), len(_limit(sources, args.limit)), "pairs")
    sources, targets = _limit(sources, args.limit), _limit(targets, args.limit)
    s = score(model, tokenizer, sources, targets, max_len, num_beams=args.num_beams,
              source_tokenizer=load_source_tokenizer(args.model))
    examples = "\n".join(f"{src}  ->  {hyp}   (reference: {ref})"
                         for src, hyp, ref in list(zip(sources, s["hypotheses"], targets))[:3])
    return ({k: s[k] for k in ("val_loss", "perplexity", "bleu", "chrf", "exact_match")}, examples)


def _chat_renderer(model_dir, tokenizer, train_on_prompt: bool = False):
    """The Renderer of a chat run: its tokenizer and the template its checkpoint carries."""
    from tformer.checkpoints.layout import resolve
    from tformer.data.chat import Renderer
    from tformer.data.chat_template import find_chat_template
    from tformer.errors import ConfigError

    try:
        template = find_chat_template(resolve(model_dir))
    except ValueError as e:
        raise ConfigError(f"{model_dir}: {e}") from None
    if template is None:
        raise ConfigError(f"{model_dir} has no chat template (chat_template.jinja); not an sft or dpo run")
    return Renderer(tokenizer, template, train_on_prompt)


def _chat_split(meta, args) -> tuple[str | None, str | None]:
    """(the `data` an sft / dpo task's heldout takes, the split): a run on tformer-instruct has its test split
    (what heldout gives for data=tformer-instruct); on a user's file, only its validation split (data=None)."""
    from tformer.errors import ConfigError

    if args.data is not None:
        if args.split is not None:
            raise ConfigError("--split chooses a split of the run's own data; --data is scored whole")
        return args.data, None
    split = args.split or ("test" if meta.get("data") == INSTRUCT else "validation")
    if split == "test" and meta.get("data") != INSTRUCT:
        raise ConfigError("this run has no test split (its file is split in two: train, validation): score "
                          "--split validation, or pass --data with a file of its own")
    return (INSTRUCT if split == "test" else None), split


def eval_sft(model, tokenizer, meta, args, task):
    from tformer.tasks.sft import fitting, trained_loss

    data, split = _chat_split(meta, args)
    examples = task.heldout(meta, data)
    _say(args, split, len(examples), len(_limit(examples, args.limit)), "examples")
    examples = _limit(examples, args.limit)
    renderer = _chat_renderer(args.model, tokenizer, meta.get("train_on_prompt", False))
    context = min(int(meta.get("context", model.cfg.max_seq_len)), model.cfg.max_seq_len)
    rendered = fitting([renderer(e) for e in examples], context, args.data or meta["data"], "held-out")
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    loss = trained_loss(model, [[r] for r in rendered], pad_id)   # one row each: packing does not change it
    return {"val_loss": loss, "perplexity": math.exp(min(loss, 50.0))}, ""


def eval_dpo(model, tokenizer, meta, args, task):
    from tformer.checkpoints.format import load
    from tformer.errors import ConfigError
    from tformer.model.lora import lora_layers
    from tformer.tasks.dpo import render_pairs, score_pairs

    frozen = None
    if not lora_layers(model):   # a LoRA run's reference is its base: the model with the adapters off
        if "init" not in meta:
            raise ConfigError(f"{args.model} does not record its reference model (the run's --init); "
                              "train it again with this version of tformer")
        frozen = load(meta["init"])
    data, split = _chat_split(meta, args)
    pairs = task.heldout(meta, data)
    _say(args, split, len(pairs), len(_limit(pairs, args.limit)), "pairs")
    pairs = _limit(pairs, args.limit)
    context = min(int(meta.get("context", model.cfg.max_seq_len)), model.cfg.max_seq_len)
    rendered = render_pairs(_chat_renderer(args.model, tokenizer), pairs, context, args.data or meta["data"],
                            "held-out")
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    s = score_pairs(model, frozen, rendered, pad_id, float(meta["dpo_beta"]))
    return {"val_loss": s["val_loss"], "accuracy": s["val_accuracy"],
            **{k: s[f"val_{k}"] for k in ("rewards/chosen", "rewards/rejected", "rewards/margins")}}, ""


def eval_instruct(model, tokenizer, args):
    """tformer-instruct's test split (or --split validation, where recipes are chosen): replies generated and
    scored (routing, numbers, sentiment), and the reference reply's log-probability against the wrong one's;
    per task below the headline figures."""
    from tformer.data import instruct
    from tformer.evaluation.instruct import score

    split = args.split or "test"
    every = instruct.items(split)
    items = _limit(every, args.limit)
    _say(args, split, len(every), len(items), "items")
    figures = score(model, tokenizer, _chat_renderer(args.model, tokenizer).template, items)
    headline = ("routing", "numbers_exact_match", "sentiment_accuracy", "preference_accuracy")
    tasks = sorted({item.task for item in items})
    rows = [f"{'task':<10} {'items':>5} {'routing':>8} {'exact':>6} {'preference':>10}"]
    rows += [f"{t:<10} {sum(i.task == t for i in items):>5} {figures[f'routing/{t}']:>8.3f} "
             f"{figures[f'exact/{t}']:>6.3f} {figures[f'preference/{t}']:>10.3f}" for t in tasks]
    return ({k: figures[k] for k in headline if k in figures},
            f"tformer-instruct, {split} split ({len(items)} items, never trained on):\n" + "\n".join(rows))
