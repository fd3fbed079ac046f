"""`tformer train`: train a language model (default), classifier or translator.

    tformer train                                   # char-level GPT on the built-in hamlet, preset small
    tformer train --data my.txt --tokenizer bpe --vocab-size 2000 --time-budget 600
    tformer train --resume runs/lm-20250101-120000  # continue an interrupted run
    torchrun --nproc_per_node 2 -m tformer train --max-steps 1000   # DDP (gloo on CPU, nccl on GPU)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from tformer.cli import COMMANDS
from tformer.cli.args import dropout, fraction, nonneg_float, nonneg_int, positive_float, positive_int
from tformer.errors import ConfigError

# Flags that may change when a run is resumed; everything else comes from the saved run.
RESUMABLE = ("max_steps", "time_budget", "save_every", "eval_every", "log_every", "keep", "stop_at", "progress",
             "device", "skip_nonfinite")
ONCE = ("stop_at", "progress", "device")  # apply to one invocation only, never inherited by --resume


def tokenizer_choice(text: str) -> str:
    from pathlib import Path

    if text in ("char", "bpe", "wordpiece"):
        return text
    path = Path(text)
    if path.is_file() or (path / "tokenizer.json").is_file():
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither char, bpe nor wordpiece, nor a tokenizer.json file "
                                     "(or a directory with one)")


def register(sub) -> None:
    from tformer.train import TASKS, task_class

    p = sub.add_parser("train", help=COMMANDS["train"], description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--task", default="lm", choices=list(TASKS), help="what to learn (default: lm, a language model)")
    a("--data", default=None, help="built-in corpus name (lm: hamlet) or a file (.txt; .csv/.tsv/.jsonl for "
      "classify/translate); default: the task's built-in data")
    a("--preset", default=None, help="model shape from tformer.PRESETS (default for lm: small)")
    a("--tokenizer", type=tokenizer_choice, default=None, metavar="{char,bpe,wordpiece,FILE}",
      help="char: one token per character; bpe: byte-level BPE trained on the data; wordpiece: BERT-style uncased "
           "WordPiece trained on the data; or a tokenizer.json (or a directory with one) used as it is "
           "(default: char for lm, wordpiece for classify)")
    a("--vocab-size", type=positive_int, default=None,
      help="vocabulary size of a trained bpe/wordpiece tokenizer (default 2000; classify: 8000; translate: "
           "2000 for numbers-fr-en, 8000 otherwise)")
    a("--context", type=positive_int, default=None, help="tokens per training window (default: the preset's max_seq_len)")
    a("--dropout", type=dropout, default=None, help="dropout probability (default: the preset's)")
    a("--attn-dropout", type=dropout, default=None,
      help="dropout on attention weights (default: --dropout); 0 is cheaper to train")
    a("--errors", default="strict", choices=("strict", "replace"),
      help="bytes in --data that are not UTF-8: stop with an error naming the byte (default), or read them as U+FFFD")
    a("--val-fraction", type=fraction, default=0.1, help="share of the data held out for validation (default 0.1)")
    a("--init", default=None, metavar="DIR", help="start from the weights (and tokenizer) of this checkpoint")
    a("--out", default=None, metavar="DIR", help="run directory (default runs/<task>-<date>-<time>)")
    a("--resume", default=None, metavar="DIR", help="continue the run in DIR (a run or checkpoint directory)")
    a("--max-steps", type=positive_int, default=None, help="optimizer steps to train")
    a("--time-budget", type=positive_float, default=None, metavar="SECONDS",
      help="train for this long; the learning-rate schedule is laid over it (default 300 when no --max-steps)")
    a("--stop-at", type=positive_int, default=None, metavar="STEP",
      help="stop with a checkpoint after STEP, keeping the schedule of the full run (resume later)")
    a("--batch-size", type=positive_int, default=32, help="global batch: sequences per optimizer step (default 32)")
    a("--grad-accum", type=positive_int, default=1, help="micro-batches per step (default 1)")
    a("--lr", type=positive_float, default=1e-3, help="peak learning rate (default 1e-3)")
    a("--min-lr-ratio", type=nonneg_float, default=0.1, help="final lr as a share of --lr (default 0.1)")
    a("--warmup", type=nonneg_int, default=100, help="linear warm-up steps (default 100)")
    a("--weight-decay", type=nonneg_float, default=0.1, help="AdamW decoupled weight decay (default 0.1)")
    a("--grad-clip", type=nonneg_float, default=1.0, help="max gradient norm, 0 = off (default 1.0)")
    a("--skip-nonfinite", type=nonneg_int, default=0, metavar="N",
      help="skip up to N steps whose loss or gradient is NaN/inf (no update) before stopping; the default 0 stops "
           "at the first, keeping the last good checkpoint")
    a("--precision", default="bf16", choices=("fp32", "bf16"), help="bf16 autocast (default) or fp32")
    a("--eval-every", type=positive_int, default=250, help="validate (and print a sample) every N steps")
    a("--save-every", type=positive_int, default=1000, help="checkpoint every N steps (and at the end)")
    a("--keep", type=positive_int, default=3, help="checkpoints to keep (default 3)")
    a("--ema", type=nonneg_float, default=None, metavar="DECAY",
      help="validate an exponential moving average of the weights (e.g. 0.99: about the last 100 steps) "
           "instead of the weights themselves; with --keep-best that average is what best/ keeps; it smooths "
           "the noise of small-batch steps; step checkpoints keep the live weights (and the average in "
           "ema.safetensors) (default: 0 = off)")
    a("--keep-best", action=argparse.BooleanOptionalAction, default=None,
      help="also save the model of the best validation so far as RUN/best/, which `tformer.load(RUN)`, classify "
           "and eval then use (--resume still continues from the newest checkpoint); best = highest accuracy "
           "for classify, lowest val_loss otherwise (default: on for classify, off for the other tasks)")
    a("--log-every", type=positive_int, default=10, help="write train loss to metrics.jsonl every N steps")
    a("--seed", type=nonneg_int, default=0, help="random seed (data order, init, dropout)")
    a("--device", default="auto", choices=("auto", "cpu", "cuda"), help="default: cuda if available")
    a("--fsdp", action="store_true", help="shard the model with FSDP2 (under torchrun)")
    a("--compile", action="store_true", help="torch.compile the model (slow start, faster steps)")
    a("--no-progress", dest="progress", action="store_false", help="no progress bar")
    for name in TASKS:
        try:
            task_class(name).add_arguments(_Shared(p, p, name))
        except ConfigError:
            pass  # a task that is not installed adds no flags; choosing it reports why
    p.set_defaults(func=run, _parser=p)


class _Shared:
    """Hands a parser (or argument group) to a task's add_arguments. Two tasks may declare the
    same flag (e.g. --max-len for classify and translate): the first declaration is kept, and its
    help becomes both tasks' ("classify: ...; translate: ...")."""

    def __init__(self, target, parser, task: str):
        self.target, self.parser, self.task = target, parser, task

    def add_argument(self, *names, **kwargs):
        existing = next((self.parser._option_string_actions[n] for n in names
                         if n in self.parser._option_string_actions), None)
        if existing is not None:
            if kwargs.get("help"):
                existing.help = f"{existing.task}: {existing.help}; {self.task}: {kwargs['help']}"
            return None
        action = self.target.add_argument(*names, **kwargs)
        action.task = self.task
        return action

    def add_argument_group(self, *args, **kwargs):
        return _Shared(self.parser.add_argument_group(*args, **kwargs), self.parser, self.task)

    def __getattr__(self, name):
        return getattr(self.target, name)


def explicit_args(args, parser) -> set[str]:
    return {k for k, v in vars(args).items() if not k.startswith("_") and v != parser.get_default(k)}


def settings(args) -> tuple[argparse.Namespace, str | None]:
    """The effective arguments: on --resume, the saved run's, updated with the flags given now."""
    if not args.resume:
        return args, None
    from tformer.runs import read_trainer_state, run_dir_of

    ckpt, state = read_trainer_state(args.resume)
    given = explicit_args(args, args._parser) - {"resume", "out"}
    clash = sorted(given - set(RESUMABLE) - {"debug", "command", "func"})
    if clash:
        raise ConfigError(f"--resume continues the saved run; these flags cannot change: "
                          f"{', '.join('--' + c.replace('_', '-') for c in clash)}")
    saved = {k: v for k, v in state.get("args", {}).items() if k not in ONCE}
    merged = argparse.Namespace(**{**vars(args), **saved, **{k: getattr(args, k) for k in given}})
    merged.out, merged.resume = str(run_dir_of(ckpt)), str(ckpt)
    return merged, str(ckpt)


def prepare(args):
    """(task, TrainConfig, resume checkpoint or None, arguments to save) from parsed `train` flags."""
    from tformer.train import TrainConfig, task_class

    args, resume = settings(args)
    if args.max_steps is None and args.time_budget is None:
        args.time_budget = 300.0
    if args.out is None:
        args.out = f"runs/{args.task}-{time.strftime('%Y%m%d-%H%M%S')}"
    cls = task_class(args.task)
    if args.preset is None:
        args.preset = getattr(cls, "default_preset", "small")
    if args.data is None:
        args.data = getattr(cls, "default_data", "hamlet")
    if args.tokenizer is None:
        args.tokenizer = getattr(cls, "default_tokenizer", "char")
    if args.vocab_size is None:  # None: the task picks per data set (translate)
        args.vocab_size = getattr(cls, "default_vocab_size", None)
    cfg = TrainConfig(out=args.out, max_steps=args.max_steps, time_budget=args.time_budget,
                      batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
                      min_lr_ratio=args.min_lr_ratio, warmup=args.warmup, weight_decay=args.weight_decay,
                      grad_clip=args.grad_clip, precision=args.precision, eval_every=args.eval_every,
                      save_every=args.save_every, keep=args.keep, log_every=args.log_every, seed=args.seed,
                      ema=args.ema if args.ema is not None else getattr(cls, "ema", 0.0),
                      keep_best=args.keep_best if args.keep_best is not None else getattr(cls, "keep_best", False),
                      device=args.device, fsdp=args.fsdp, compile=args.compile, stop_at=args.stop_at,
                      progress=args.progress, skip_nonfinite=getattr(args, "skip_nonfinite", 0))
    cfg.check()
    tokenizers = {}
    if resume:
        from tformer.tokenizers import load_source_tokenizer, load_tokenizer
        tokenizers["tokenizer"] = load_tokenizer(resume)
        source = load_source_tokenizer(resume)
        if source is not None:  # only a translator with separate vocabularies has one
            tokenizers["source_tokenizer"] = source
    task = cls(args, **tokenizers, init=None if resume else args.init)
    from tformer.limits import check_task
    check_task(task, cfg)  # a batch that cannot fit in memory: an error now, not an OOM kill later
    saved = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("func", "resume")}
    return task, cfg, resume, saved


def run(args) -> int:
    from tformer.train import fit

    task, cfg, resume, saved = prepare(args)
    result = fit(task, cfg, resume=resume, command=list(sys.argv), args=saved)
    if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 reports
        return 0
    best = result["best_val_loss"]
    print(f"{result['reason']}: step {result['step']}, {result['elapsed']:.0f} s"
          + (f", best val_loss {best:.4f}" if best is not None else ""))
    print(f"checkpoint: {result['checkpoint']}")
    if result.get("best") is not None:
        b = result["best"]
        print(f"best:       {result['best_checkpoint']} (step {b['step']}, {b['metric']} {b['value']:.4f}; "
              "what load/eval/classify use)")
    print(f"metrics:    {result['run_dir']}/metrics.jsonl   plot: {result['run_dir']}/loss.png")
    report = getattr(task, "report", None)  # a task's final held-out summary (classify: confusion matrix)
    if report is not None and result["reason"] != "interrupted":
        from tformer.checkpoint import load
        print(report(load(result["best_checkpoint"] or result["checkpoint"]), result["run_dir"]))
    return 130 if result["reason"] == "interrupted" else 0
