"""A training run from options, as `tformer train` makes it: the library call behind the command.

    from tformer.training.session import train
    result = train("lm", data="play.txt", max_steps=200)    # a new run in runs/lm-<date>-<time>
    result = train(resume=result.run_dir, max_steps=400)   # continue it to step 400

The options are those of `tformer train` (the fields of TrainOptions and of the task's Options), with
None meaning "not given", and what `tformer train` does with them happens here:

- resume: the saved run's options (trainer_state.json "args"), updated with the options given now; only
  those with the --resume rule CHANGE or ONCE may be given (tformer.training.options), and ONCE ones
  are never inherited. The run continues in the directory of the checkpoint, with its tokenizer(s).
- a new run: each option not given comes from the task's recipe for the data set, else from the
  option field's default (tformer.training.config.resolve_options); neither max_steps nor time_budget
  trains for DEFAULT_TIME_BUDGET seconds, and no out writes a new runs/<task>-<date>-<time>
  (tformer.training.config.run_defaults).

`prepare` does all of that without training (what `tformer train` prints comes from its `Plan`);
`train` is `prepare(...).fit()`.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from ..checkpoints.layout import run_dir_of
from ..errors import ConfigError
from .config import TASKS, Task, TrainConfig, TrainOptions, resolve_options, run_defaults, task_class
from .options import CHANGE, ONCE, flag_fields, pick, resume_rule
from .rundir import FitResult, read_trainer_state


class Plan(NamedTuple):
    """A run ready to start: unpacks as (task, cfg, resume, args, chosen)."""
    task: Task
    cfg: TrainConfig
    resume: str | None          # the checkpoint directory it continues from, or None for a new run
    args: dict[str, Any]        # every option's value, saved in trainer_state.json for a later resume
    chosen: dict[str, Any]      # what the task's recipe chose (empty on resume): `tformer train` prints it

    def fit(self, command: list[str] | None = None) -> FitResult:
        """Train (tformer.training.loop.fit). `command`: what trainer_state.json records as the command
        line (default sys.argv)."""
        from .loop import fit

        return fit(self.task, self.cfg, resume=self.resume, command=command, args=self.args)


def option_names(cls: type) -> set[str]:
    """The options (flags) of the Options dataclass `cls`."""
    return {f.name for f in flag_fields(cls)}


def _check_names(options: dict[str, Any]) -> None:
    """An option no task has (a typo) is an error, as an unknown flag is to `tformer train`; one of
    another task than the one trained is ignored, as its flag is."""
    unknown = set(options) - option_names(TrainOptions)
    for name in TASKS:
        if not unknown:
            return
        try:
            unknown -= option_names(task_class(name).Options)
        except ConfigError:
            continue  # a task that is not installed
    if unknown:
        raise ConfigError(f"unknown training option(s): {', '.join(sorted(unknown))}")


FROM_INIT = ("preset", "tokenizer", "vocab_size")   # what an --init checkpoint brings: its shape, its tokenizer


def _check_unused(given: set[str], values: dict[str, Any]) -> None:
    """A flag (`given`: the options set, not None) the run `values` would leave unused is an error, not
    quietly dropped: one choosing what --init's checkpoint brings, LoRA's settings where no rank is set."""
    def flags(names: list[str]) -> str:
        return " and ".join("--" + name.replace("_", "-") for name in names)
    if values.get("init") is not None and (shape := [n for n in FROM_INIT if n in given]):
        raise ConfigError(f"{flags(shape)} cannot apply with --init {values['init']}: the model's shape and its "
                          "tokenizer are the checkpoint's")
    if values.get("lora_r") is None and (lora := sorted(n for n in given if n.startswith("lora_"))):
        raise ConfigError(f"{flags(lora)} set LoRA's adapters: give --lora-r too (without it every weight trains)")


def resumed_options(resume: str | os.PathLike, options: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(options, checkpoint directory) of a run continued from `resume` (a run or checkpoint directory):
    the saved run's options updated with the `options` given now (None: not given). Only options
    whose --resume rule is CHANGE or ONCE may be given; ONCE ones are not inherited from the saved run.
    `out` becomes the run directory of the checkpoint."""
    ckpt, state = read_trainer_state(resume)
    given = {k for k, v in options.items() if v is not None} - {"resume", "out"}
    once = resume_rule(TrainOptions, ONCE)  # apply to one invocation only, never inherited by --resume
    clash = sorted(given - resume_rule(TrainOptions, CHANGE) - once)
    if clash:
        raise ConfigError(f"--resume continues the saved run; these flags cannot change: "
                          f"{', '.join('--' + c.replace('_', '-') for c in clash)}")
    saved = {k: v for k, v in state.get("args", {}).items() if k not in once}
    saved.setdefault("test_fraction", 0.0)   # a run from before test splits goes on with its one held-out split
    merged = {**options, **saved, **{k: options[k] for k in given}}
    return {**merged, "out": str(run_dir_of(ckpt))}, str(ckpt)


def prepare(task: str | None = None, *, resume: str | os.PathLike | None = None, **options: Any) -> Plan:
    """The run `tformer train` would make of these options (task: a name of tformer.training.config.TASKS,
    default lm; options: TrainOptions fields and the task's own, None = not given; resume: a run or
    checkpoint directory to continue), its task built and its batch checked against the memory there
    is. Raises ConfigError / DataError / CheckpointError for what is wrong."""
    options = {**options, "task": task}
    _check_names(options)
    given = {k for k, v in options.items() if v is not None}
    if resume:
        options, resume = resumed_options(resume, options)
    name = options.get("task") or "lm"
    cls = task_class(name)
    values, chosen = resolve_options(cls, options)
    _check_unused(given, values)
    filled = run_defaults(values, name)        # after the recipe: its max_steps is a budget too
    values.update(filled)
    options.update(filled)
    cfg = pick(TrainConfig, values)
    cfg.check()
    tokenizers = {}
    if resume:
        from ..checkpoints.format import load_source_tokenizer, load_tokenizer
        tokenizers["tokenizer"] = load_tokenizer(resume)
        source = load_source_tokenizer(resume)
        if source is not None:  # only a translator with separate vocabularies has one
            tokenizers["source_tokenizer"] = source
    if values.get("init") and not resume:   # a LoRA --init starts from base + adapter merged: not on int8
        from ..checkpoints.adapter import refuse_int8_init
        refuse_int8_init(values["init"])
    built = cls(pick(cls.Options, values), **tokenizers, init=None if resume else values.get("init"))
    from ..inference.limits import check_task
    check_task(built, cfg)  # a batch that cannot fit in memory: an error now, not an OOM kill later
    saved = {k: v for k, v in values.items() if k in (option_names(cls.Options) | set(options)) - {"resume"}}
    return Plan(built, cfg, resume, saved, {} if resume else chosen)


def train(task: str | None = None, *, resume: str | os.PathLike | None = None, command: list[str] | None = None,
          **options: Any) -> FitResult:
    """Train as `tformer train` does (see the module docstring): `prepare(task, resume=resume,
    **options).fit(command)`.

        train("classify", data="reviews.csv", max_steps=500, out="runs/reviews")
        train(resume="runs/reviews", max_steps=1000)
    """
    return prepare(task, resume=resume, **options).fit(command)
