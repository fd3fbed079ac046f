"""`tformer train`: train a language model (default), classifier or translator.

    tformer train                                   # char-level GPT on the built-in hamlet, preset small
    tformer train --data my.txt --tokenizer bpe --vocab-size 2000 --time-budget 600
    tformer train --resume runs/lm-20250101-120000  # continue an interrupted run
    torchrun --nproc_per_node 2 -m tformer train --max-steps 1000   # DDP (gloo on CPU, nccl on GPU)

Defaults: each task brings its best measured recipe for the data set (model shape, tokenizer, learning
rate, batch, regularisation, evaluation cadence, keep-best). The run prints what the recipe chose
("defaults for --task lm on hamlet: --preset mini --lr 0.004 ..."); any flag given overrides it, and
the "(default ...)" below is what applies when neither sets an option.
"""

from __future__ import annotations

import argparse
import os
import sys

from tformer.cli import COMMANDS
from tformer.errors import ConfigError
from tformer.training.options import add_flags


def register(sub) -> None:
    from tformer.training.config import TASKS, TrainConfig, TrainOptions, task_class

    p = sub.add_parser("train", help=COMMANDS["train"], description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, TrainOptions, skip=TrainConfig)  # what to train on: --task, --data, --preset ...
    add_flags(p, TrainConfig)                     # how: --out, --max-steps, --lr ...
    for name in TASKS:
        try:
            options = task_class(name).Options
        except ConfigError:
            continue  # a task that is not installed adds no flags; choosing it reports why
        add_flags(_Shared(p, p, name).add_argument_group(options.title), options, skip=TrainOptions)
    # Every option flag defaults to None, "not given": tformer.training.session fills it (on --resume from the
    # saved run; else from the task's recipe for the data and time budget, else from the option field's default).
    p.set_defaults(func=run, _parser=p, **{dest: None for dest in _option_dests(p)})


def _option_dests(parser) -> list[str]:
    return [a.dest for a in parser._actions if a.option_strings and a.dest not in ("help",)]


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


def options(args) -> dict:
    """The parsed option flags (None: not given), as tformer.training.session takes them."""
    return {dest: getattr(args, dest) for dest in _option_dests(args._parser)}


def prepare(args):
    """The run of parsed `train` flags (tformer.training.session.prepare: resume merging, default budget
    and run directory, the task's recipe): a Plan, (task, TrainConfig, resume checkpoint or None,
    arguments to save, what the task's recipe chose)."""
    from tformer.training.session import prepare as plan

    return plan(**options(args))


def run(args) -> int:
    from tformer.training.config import describe_recipe

    plan = prepare(args)
    task = plan.task
    if plan.chosen and os.environ.get("RANK", "0") == "0":
        print(f"defaults for --task {task.name} on {plan.args['data']}: {describe_recipe(plan.chosen)}  "
              "(the task's recipe; any flag overrides it)", flush=True)
    result = plan.fit(command=list(sys.argv))
    if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 reports
        return 0
    from tformer.checkpoints.layout import METRICS, PLOT

    best = result.best_val_loss
    print(f"{result.reason}: step {result.step}, {result.elapsed:.0f} s"
          + (f", best val_loss {best:.4f}" if best is not None else ""))
    print(f"checkpoint: {result.checkpoint}")
    if result.best is not None:
        b = result.best
        print(f"best:       {result.best_checkpoint} (step {b['step']}, {b['metric']} {b['value']:.4f}; "
              "what load/eval/classify use)")
    print(f"metrics:    {result.run_dir}/{METRICS}   plot: {result.run_dir}/{PLOT}")
    report = getattr(task, "report", None)  # a task's final held-out summary (classify: confusion matrix)
    if report is not None and result.reason != "interrupted":
        from tformer.checkpoints.format import load
        print(report(load(result.best_checkpoint or result.checkpoint), result.run_dir))
    return 130 if result.reason == "interrupted" else 0
