"""Training: one loop for every task (language model, classifier, translator).

The loop knows nothing about text or labels; a *task* supplies the model, the batches, the loss,
the evaluation and a progress sample. Tasks are registered by name in `TASKS` ("module:Class",
imported lazily) and selected with `tformer train --task NAME`. Every option is a field defined
once: `TrainConfig` (how to optimise), `TrainOptions` (what to train on: data, preset, tokenizer...)
and a task's own `Options` subclass; `tformer train`'s flags are derived from those fields.

The Task protocol (see `Task` below; `tformer.tasks.lm.LMTask` is the reference implementation):

    class MyTask:
        name = "classify"
        Options = ClassifyOptions              # a TrainOptions subclass: the task's own fields (and flags,
                                               # in a group titled Options.title); a flag another task
                                               # already declared is shared (the first declaration wins)
        default_data = "rotten-tomatoes"       # optional: --data when not given (LM: "hamlet")
        @staticmethod
        def recipe(data, init, time_budget) -> dict
            # optional: the task's defaults for this data set, --init and --time-budget (seconds, or
            # None under --max-steps), as option values ({"preset": ..., "lr": ..., "ema": ...}): its
            # best measured recipe. A flag the user gives wins; options neither sets keep the field's
            # default. `tformer train` prints what the recipe chose (see `resolve_options`).
        @classmethod
        def heldout(cls, meta, data=None, ..., split="test")
            # what `tformer eval` scores: the file `data` whole, else the run's `split` rebuilt from what
            # meta() recorded (the task's own defaults, default_data and its Options fields' defaults, for
            # what it did not record): "validation" the rows `evaluate` scored in training, "test" those
            # never looked at (tformer.data.splits), "held-out" a run's one split from before test splits.
        def __init__(self, opts, tokenizer=None, init=None):
            # opts: an Options instance (common fields: data, preset, tokenizer, vocab_size, context,
            #   dropout, batch_size, seed, val_fraction, init, ...).
            # tokenizer: given on --resume (the saved one); otherwise build/train your own.
            # init: a checkpoint directory to start from (--init), or None.
            # Raise tformer.errors.DataError / ConfigError for bad input: they become `error: ...`.
        tokenizer                              # saved as tokenizer.json in each checkpoint (or None)
        source_tokenizer                       # optional: saved as source_tokenizer.json (a translator with
                                               # separate vocabularies); on --resume given to __init__ too
        def build_model(self) -> nn.Module     # fresh, CPU, fp32; a tformer model class (checkpoint.save)
        def batch(self, step, split="train") -> dict[str, Tensor]
            # The GLOBAL batch of optimizer step `step` (opts.batch_size rows), a pure function of
            # (opts.seed, step): use tformer.data.files.step_generator(seed, step). Every tensor has the
            # batch dimension first; the trainer slices rows for each process and micro-batch.
        def loss(self, model, batch) -> Tensor   # scalar mean loss of a (micro-)batch already on device
        def loss_and_metrics(self, model, batch) -> tuple[Tensor, dict[str, float]]
            # optional: the loss and per-step metrics of the task's own, logged next to train_loss
            # (DPO's rewards/*); the loop then calls it instead of loss (tformer.training.steplog)
        def tokens(self, batch) -> int           # tokens processed in `batch` (for tokens/s)
        def evaluate(self, model) -> dict[str, float]
            # over the whole validation split, model in eval mode and no_grad; must contain
            # "val_loss"; may add e.g. "val_accuracy", "val_bleu". Called on every process.
        def sample(self, model) -> str           # short, seeded demo output printed at each validation
        def meta(self) -> dict                   # JSON-able; stored in config.json ("task" is added)
        best_metric = ("val_accuracy", "max")    # optional: what --keep-best maximises/minimises
                                                 # (default ("val_loss", "min"))
        extra_files = {"chat_template.jinja": b"..."}  # optional: files saved in every checkpoint

Determinism: batches depend only on (seed, step), the dropout RNG is re-seeded from (seed, step,
rank) before each step, and the schedule depends only on the step when `--max-steps` is given, so a
run that is interrupted and resumed reaches bit-identical weights on CPU. Under `torchrun` every
process builds the same model and the same global batch and keeps its own rows (DDP averages the
gradients), so 2 processes match 1 process with the same global batch up to float reduction order.

What a run writes (the run directory) is described, once, in tformer.checkpoints.layout.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, ClassVar, Protocol

from torch import Tensor, nn

from ..checkpoints.layout import default_run_dir
from ..errors import ConfigError
from .options import (
    CHANGE,
    ONCE,
    below_one,
    fraction,
    lora_target_list,
    nonneg_float,
    nonneg_int,
    option,
    positive_float,
    positive_int,
    tokenizer_choice,
)

TASKS: dict[str, str] = {
    "lm": "tformer.tasks.lm:LMTask",
    "classify": "tformer.tasks.classify:ClassifyTask",
    "translate": "tformer.tasks.translate:TranslateTask",
    "tag": "tformer.tasks.tag:TagTask",
    "sft": "tformer.tasks.sft:SFTTask",
    "dpo": "tformer.tasks.dpo:DPOTask",
}


class Task(Protocol):
    name: str
    tokenizer: Any

    def build_model(self) -> nn.Module: ...
    def batch(self, step: int, split: str = "train") -> dict[str, Tensor]: ...
    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> Tensor: ...
    def tokens(self, batch: dict[str, Tensor]) -> int: ...
    def evaluate(self, model: nn.Module) -> dict[str, float]: ...
    def sample(self, model: nn.Module) -> str: ...
    def meta(self) -> dict[str, Any]: ...


def task_class(name: str) -> type:
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    module, _, cls = TASKS[name].partition(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"task {name!r} is not available in this install ({e})") from None


@dataclass
class TrainConfig:
    """How to optimise; what to optimise comes from the task. Each field is also a `tformer train` flag."""
    out: str = option(help="run directory (default runs/<task>-<date>-<time>)", metavar="DIR", flag_default=None)
    # stop after max_steps optimizer steps or time_budget seconds (whichever first); the cosine spans it
    max_steps: int | None = option(None, "optimizer steps to train", resume=CHANGE, type=positive_int)
    time_budget: float | None = option(
        None, "train for this long; the learning-rate schedule is laid over it (default 300 when no --max-steps)",
        resume=CHANGE, type=positive_float, metavar="SECONDS")
    stop_at: int | None = option(  # as if interrupted: the schedule stays that of the full run
        None, "stop with a checkpoint after STEP, keeping the schedule of the full run (resume later)",
        resume=ONCE, type=positive_int, metavar="STEP")
    # the global batch: rows per optimizer step, over all processes and micro-batches
    batch_size: int = option(32, "global batch: sequences per optimizer step (default 32)", type=positive_int)
    # micro-batches per step: the same update with 1/grad_accum of the activation memory
    grad_accum: int = option(1, "micro-batches per step (default 1)", type=positive_int)
    lr: float = option(1e-3, "peak learning rate (default 1e-3)", type=positive_float)  # reached after warm-up
    min_lr_ratio: float = option(0.1, "final lr as a share of --lr (default 0.1)", type=nonneg_float)
    # linear warm-up: Adam's moment estimates are noisy at first
    warmup: int = option(100, "linear warm-up steps (default 100)", type=nonneg_int)
    # decoupled (AdamW); not applied to norms, biases and embeddings
    weight_decay: float = option(0.1, "AdamW decoupled weight decay (default 0.1)", type=nonneg_float)
    beta1: float = 0.9
    beta2: float = 0.99            # shorter memory than 0.999 suits short runs with small batches
    grad_clip: float = option(1.0, "max gradient norm, 0 = off (default 1.0)", type=nonneg_float)
    skip_nonfinite: int = option(
        0, "skip up to N steps whose loss or gradient is NaN/inf (no update) before stopping; the default 0 stops "
        "at the first, keeping the last good checkpoint", resume=CHANGE, type=nonneg_int, metavar="N")
    # bf16 autocast: matmuls in bfloat16, master weights in fp32. Only where the hardware computes
    # bf16 itself: a CPU without AVX-512 BF16 / AMX emulates it, far slower than fp32 (BENCHMARKS.md,
    # "bf16 on an AVX2 CPU").
    precision: str = option("auto", "bf16 autocast where the device computes bf16 natively (a recent GPU, a CPU "
                            "with AVX-512 BF16 or AMX), else fp32 (default: auto); or force bf16 / fp32",
                            choices=("auto", "fp32", "bf16"))
    eval_every: int = option(250, "validate (and print a sample) every N steps", resume=CHANGE, type=positive_int)
    save_every: int = option(1000, "checkpoint every N steps (and at the end)", resume=CHANGE, type=positive_int)
    keep: int = option(3, "checkpoints to keep (default 3)", resume=CHANGE, type=positive_int)  # older ones go
    # > 0: validate (and keep as best) a moving average of the weights, with this decay
    ema: float = option(
        0.0, "validate an exponential moving average of the weights (e.g. 0.99: about the last 100 steps) "
        "instead of the weights themselves; with --keep-best that average is what best/ keeps; it smooths "
        "the noise of small-batch steps; step checkpoints keep the live weights (and the average in "
        "ema.safetensors) (default: 0 = off)", type=nonneg_float, metavar="DECAY", flag_default=None)
    # also keep the best-validating model in RUN/best/ (what load(RUN) then takes)
    keep_best: bool = option(
        False, "also save the model of the best validation so far as RUN/best/, which `tformer.load(RUN)`, "
        "classify and eval then use (--resume still continues from the newest checkpoint); best = highest "
        "accuracy for classify, lowest val_loss otherwise (default: on for classify, off for the other tasks)",
        action=argparse.BooleanOptionalAction, flag_default=None)
    log_every: int = option(10, "write train loss to metrics.jsonl every N steps", resume=CHANGE, type=positive_int)
    seed: int = option(0, "random seed (data order, init, dropout)", type=nonneg_int)
    device: str = option("auto", "default: cuda if available", resume=ONCE, choices=("auto", "cpu", "cuda"))
    # shard parameters, gradients and optimizer state (FSDP2) under torchrun
    fsdp: bool = option(False, "shard the model with FSDP2 (under torchrun)", action="store_true")
    # torch.compile pays off only for long runs
    compile: bool = option(
        False, "torch.compile the model with its loss: one to two minutes of compiling (C++, needs a compiler), "
        "then faster steps (a Bible step: 1.2x in fp32) (default: on for translate on bible-en-es, "
        "off elsewhere)", action=argparse.BooleanOptionalAction, flag_default=None)
    activation_checkpointing: bool = option(
        False, "keep each layer's inputs only and recompute the rest in the backward (HF's gradient checkpointing): "
        "far less memory for activations, about one more forward pass of time", resume=CHANGE, action="store_true")
    progress: bool = option(True, "no progress bar", resume=ONCE, flag="--no-progress", action="store_false")
    # LoRA (tformer.model.lora): train low-rank adapters on a frozen base; checkpoints hold the adapter only
    lora_r: int | None = option(None, "train LoRA adapters of this rank on the frozen model (--init's, typically); "
                                "each checkpoint then holds the adapter and names its base (default: off, full "
                                "fine-tuning)", type=positive_int, metavar="R")
    lora_alpha: float = option(16.0, "LoRA scaling alpha / r (default 16)", type=positive_float)
    lora_dropout: float = option(0.05, "dropout on the adapters' input (default 0.05)", type=below_one)
    lora_targets: str = option("q,v", "layers that get adapters, comma-separated: q, k, v, qkv, o, gate, up, down, "
                               "lm_head, head (default q,v)", type=lora_target_list, metavar="T,...")
    lora_rslora: bool = option(False, "rsLoRA scaling alpha / sqrt(r)", action="store_true")
    lora_int8: bool = option(False, "quantise the frozen base to int8 first (QLoRA on a CPU)", action="store_true")

    def check(self) -> None:
        if self.max_steps is None and self.time_budget is None:
            raise ConfigError("give --max-steps or --time-budget (or both)")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ConfigError(f"--precision {self.precision!r}: choose auto, fp32 or bf16")
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"--batch-size {self.batch_size} must be divisible by --grad-accum {self.grad_accum}")
        if not 0.0 <= self.ema < 1.0:
            raise ConfigError(f"--ema {self.ema} must be in [0, 1) (0 = off; e.g. 0.99)")
        if self.ema and self.fsdp:
            raise ConfigError("--ema does not work with --fsdp (the average would need sharding too)")
        if self.skip_nonfinite < 0:
            raise ConfigError(f"--skip-nonfinite {self.skip_nonfinite} must be >= 0")
        if self.lora_r is not None and (isinstance(self.lora_r, bool) or not isinstance(self.lora_r, int)
                                        or self.lora_r <= 0):
            raise ConfigError(f"--lora-r {self.lora_r!r} must be a positive integer (the adapters' rank)")
        if self.lora_r is None and self.lora_int8:
            raise ConfigError("--lora-int8 quantises the base under LoRA adapters: give --lora-r too")
        if self.lora_r is not None and self.fsdp:
            raise ConfigError("--lora-r does not work with --fsdp (adapters are small: DDP is enough)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TrainOptions(TrainConfig):
    """What to train on (data, model shape, tokenizer) on top of how (TrainConfig): the `tformer train`
    options every task shares. A task's own options subclass this (its `Options`)."""
    title: ClassVar[str] = ""  # a task's Options: the heading of its flags in --help
    task: str = option("lm", "what to learn (default: lm, a language model)", choices=list(TASKS))
    data: str | None = option(None, "built-in corpus name (lm: hamlet) or a file (.txt; .csv/.tsv/.jsonl for "
                              "classify/translate); default: the task's built-in data")
    preset: str | None = option(None, "model shape from tformer.PRESETS (default: the task's recipe; lm: mini on "
                                "hamlet, small on other text; translate: nmt-mini on bible-en-es, 2 + 2 layers of "
                                "width 128 otherwise)")
    tokenizer: str | None = option(
        None, "char: one token per character; bpe: byte-level BPE trained on the data; wordpiece: BERT-style uncased "
        "WordPiece trained on the data; bert-uncased: BERT's own uncased WordPiece vocabulary (shipped); or a "
        "tokenizer.json (or a directory with one) used as it is (default: the task's recipe: char for lm; "
        "bert-uncased for classify on rotten-tomatoes, wordpiece on other data)", type=tokenizer_choice,
        metavar="{char,bpe,wordpiece,bert-uncased,FILE}")
    vocab_size: int | None = option(
        None, "vocabulary size of a trained bpe/wordpiece tokenizer (default 2000; classify: 8000; translate: "
        "2000 for numbers-fr-en, 8000 otherwise)", type=positive_int)
    context: int | None = option(None, "tokens per training window (default: the preset's max_seq_len)",
                                 type=positive_int)
    dropout: float | None = option(None, "dropout probability (default: the preset's)", type=below_one)
    attn_dropout: float | None = option(None, "dropout on attention weights (default: --dropout); 0 is cheaper "
                                        "to train", type=below_one)
    errors: str = option("strict", "bytes in --data that are not UTF-8: stop with an error naming the byte "
                         "(default), or read them as U+FFFD", choices=("strict", "replace"))
    val_fraction: float = option(0.1, "share of the data held out for validation (default 0.1)", type=fraction)
    test_fraction: float | None = option(
        None, "share of the data held out as the test split, which `tformer eval` scores and training never sees "
        "(default: 0.1 on built-in data, 0 = none on a user's file; not sft / dpo: tformer-instruct has its own)",
        type=below_one)
    init: str | None = option(None, "start from the weights (and tokenizer) of this checkpoint", metavar="DIR")
    resume: str | None = option(None, "continue the run in DIR (a run or checkpoint directory)", metavar="DIR")


DEFAULT_TIME_BUDGET = 300.0  # seconds: how long a run trains when given neither max_steps nor time_budget


def run_defaults(values: dict[str, Any], task: str) -> dict[str, Any]:
    """What a run of `task` (`tformer train`, `fit`, tformer.training.session.train) takes for the options
    `values` leaves unset (None): time_budget DEFAULT_TIME_BUDGET when max_steps is unset too, and out a new
    runs/<task>-<date>-<time> (tformer.checkpoints.layout.default_run_dir). Only those entries."""
    filled: dict[str, Any] = {}
    if values.get("max_steps") is None and values.get("time_budget") is None:
        filled["time_budget"] = DEFAULT_TIME_BUDGET
    if values.get("out") is None:
        filled["out"] = default_run_dir(task)
    return filled


def resolve_options(cls: type, given: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The options of a run of task class `cls`: each one `given` (not None), else what the task's
    recipe chooses for this data set, --init and time budget, else the option field's own default.
    Returns (values, chosen): `chosen` is the part the recipe decided, for the run to print."""
    given = {k: v for k, v in given.items() if v is not None}
    data = given.get("data") or getattr(cls, "default_data", "hamlet")
    recipe = getattr(cls, "recipe", None)
    proposed = recipe(data, given.get("init"), given.get("time_budget")) if recipe is not None else {}
    chosen = {k: v for k, v in proposed.items() if k not in given}
    defaults = {f.name: f.default for f in fields(cls.Options) if f.default is not MISSING}
    return {**defaults, "data": data, **chosen, **given}, chosen


def describe_recipe(chosen: dict[str, Any]) -> str:
    """The recipe's choices as the flags that would set them: `--preset small --lr 0.002 ...`."""
    def flag(name: str, value: Any) -> str:
        name = "--" + name.replace("_", "-")
        if value is True:
            return name
        if value is False:
            return "--no-" + name[2:]
        return f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}"
    return " ".join(flag(k, v) for k, v in chosen.items())
