"""Training: one loop for every task (language model, classifier, translator).

The loop knows nothing about text or labels; a *task* supplies the model, the batches, the loss,
the evaluation and a progress sample. Tasks are registered by name in `TASKS` ("module:Class",
imported lazily) and selected with `tformer train --task NAME`.

The Task protocol (see `Task` below; `tformer.tasks.lm.LMTask` is the reference implementation):

    class MyTask:
        name = "classify"
        default_data = "rotten-tomatoes"       # optional: --data when not given (LM: "hamlet")
        default_preset = "small"               # optional: --preset when not given
        @classmethod
        def add_arguments(cls, parser): ...   # extra CLI flags; a flag another task already declared
                                              # is skipped (the first declaration wins), so share meanings
        def __init__(self, args, tokenizer=None, init=None):
            # args: the parsed `tformer train` namespace (common flags: data, preset, tokenizer,
            #   vocab_size, context, dropout, batch_size, seed, val_fraction, init, ...).
            # tokenizer: given on --resume (the saved one); otherwise build/train your own.
            # init: a checkpoint directory to start from (--init), or None.
            # Raise tformer.errors.DataError / ConfigError for bad input: they become `error: ...`.
        tokenizer                              # saved as tokenizer.json in each checkpoint (or None)
        source_tokenizer                       # optional: saved as source_tokenizer.json (a translator with
                                               # separate vocabularies); on --resume given to __init__ too
        def build_model(self) -> nn.Module     # fresh, CPU, fp32; a tformer model class (checkpoint.save)
        def batch(self, step, split="train") -> dict[str, Tensor]
            # The GLOBAL batch of optimizer step `step` (args.batch_size rows), a pure function of
            # (args.seed, step): use tformer.data.step_generator(seed, step). Every tensor has the
            # batch dimension first; the trainer slices rows for each process and micro-batch.
        def loss(self, model, batch) -> Tensor   # scalar mean loss of a (micro-)batch already on device
        def tokens(self, batch) -> int           # tokens processed in `batch` (for tokens/s)
        def evaluate(self, model) -> dict[str, float]
            # over the whole validation split, model in eval mode and no_grad; must contain
            # "val_loss"; may add e.g. "val_accuracy", "val_bleu". Called on every process.
        def sample(self, model) -> str           # short, seeded demo output printed at each validation
        def meta(self) -> dict                   # JSON-able; stored in config.json ("task" is added)
        best_metric = ("val_accuracy", "max")    # optional: what --keep-best maximises/minimises
                                                 # (default ("val_loss", "min"))
        keep_best = True                         # optional: --keep-best when the flag is not given

Determinism: batches depend only on (seed, step), the dropout RNG is re-seeded from (seed, step,
rank) before each step, and the schedule depends only on the step when `--max-steps` is given, so a
run that is interrupted and resumed reaches bit-identical weights on CPU. Under `torchrun` every
process builds the same model and the same global batch and keeps its own rows (DDP averages the
gradients), so 2 processes match 1 process with the same global batch up to float reduction order.

Run directory:
    RUN/metrics.jsonl                      one JSON object per log / validation step
    RUN/loss.png                           train and validation loss (tformer.viz.plot_loss)
    RUN/checkpoints/step-0001000/          tformer.save() directory (config.json, model.safetensors,
                                           tokenizer.json) + optimizer.safetensors + trainer_state.json
    RUN/best/                              with --keep-best: the model of the evaluation with the best
                                           `best_metric` (its record in config.json meta["best"]);
                                           tformer.load(RUN) takes it, --resume RUN the newest step-*
"""

from __future__ import annotations

import importlib
import math
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from .errors import ConfigError

TASKS: dict[str, str] = {
    "lm": "tformer.tasks.lm:LMTask",
    "classify": "tformer.tasks.classify:ClassifyTask",
    "translate": "tformer.tasks.translate:TranslateTask",
    "tag": "tformer.tasks.tag:TagTask",
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
    """How to optimise; what to optimise comes from the task."""
    out: str                       # run directory
    max_steps: int | None = None   # stop after this many optimizer steps ...
    time_budget: float | None = None  # ... or after this many seconds (whichever first); cosine spans it
    batch_size: int = 32           # global batch: rows per optimizer step, over all processes and micro-batches
    grad_accum: int = 1            # micro-batches per step: same update, 1/grad_accum of the activation memory
    lr: float = 1e-3               # peak learning rate, reached after warm-up
    min_lr_ratio: float = 0.1      # the cosine decays to lr * min_lr_ratio
    warmup: int = 100              # linear warm-up steps: Adam's moment estimates are noisy at first
    weight_decay: float = 0.1      # decoupled (AdamW); not applied to norms, biases and embeddings
    beta1: float = 0.9
    beta2: float = 0.99            # shorter memory than 0.999 suits short runs with small batches
    grad_clip: float = 1.0         # max global gradient norm (0 = off)
    precision: str = "bf16"        # bf16 autocast (matmuls in bfloat16, master weights fp32) or fp32
    eval_every: int = 250
    save_every: int = 1000
    keep: int = 3                  # checkpoints kept (older ones are deleted)
    keep_best: bool = False        # also keep the best-validating model in RUN/best/ (what load(RUN) then takes)
    ema: float = 0.0               # > 0: validate (and keep as best) a moving average of the weights, this decay
    log_every: int = 10
    seed: int = 0
    device: str = "auto"
    fsdp: bool = False             # shard parameters, gradients and optimizer state (FSDP2) under torchrun
    compile: bool = False          # torch.compile the model (pays off only for long runs)
    stop_at: int | None = None     # stop (with a checkpoint) after this step, as if interrupted
    progress: bool = True          # tqdm bar on stderr
    skip_nonfinite: int = 0        # steps with a NaN/inf loss or gradient skipped (no update) before stopping

    def check(self) -> None:
        if self.max_steps is None and self.time_budget is None:
            raise ConfigError("give --max-steps or --time-budget (or both)")
        if self.precision not in ("fp32", "bf16"):
            raise ConfigError(f"--precision {self.precision!r}: choose fp32 or bf16")
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"--batch-size {self.batch_size} must be divisible by --grad-accum {self.grad_accum}")
        if not 0.0 <= self.ema < 1.0:
            raise ConfigError(f"--ema {self.ema} must be in [0, 1) (0 = off; e.g. 0.99)")
        if self.ema and self.fsdp:
            raise ConfigError("--ema does not work with --fsdp (the average would need sharding too)")
        if self.skip_nonfinite < 0:
            raise ConfigError(f"--skip-nonfinite {self.skip_nonfinite} must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def lr_at(cfg: TrainConfig, step: int, progress: float) -> float:
    """Linear warm-up over `cfg.warmup` steps, then cosine from lr to lr * min_lr_ratio as `progress`
    (the fraction of the post-warm-up phase done, by steps or by time) goes from 0 to 1."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    p = min(max(progress, 0.0), 1.0)
    low = cfg.lr * cfg.min_lr_ratio
    return low + 0.5 * (cfg.lr - low) * (1.0 + math.cos(math.pi * p))


def progress_of(cfg: TrainConfig, step: int, elapsed: float, warm_elapsed: float | None) -> float:
    """Fraction of the decay phase done: by steps for --max-steps, by seconds for --time-budget
    (the larger when both are given). By steps only, it is deterministic."""
    by_steps = (step - cfg.warmup) / max(1, cfg.max_steps - cfg.warmup) if cfg.max_steps else 0.0
    by_time = 0.0
    if cfg.time_budget and warm_elapsed is not None:
        by_time = (elapsed - warm_elapsed) / max(1e-9, cfg.time_budget - warm_elapsed)
    return max(by_steps, by_time)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay the weight matrices only: norms, biases and embedding tables are left alone (decaying
    them pulls gains towards 0 and rare tokens' vectors towards the origin)."""
    decay, no_decay = [], []
    embeddings = {id(m.weight) for m in model.modules()
                  if isinstance(m, nn.Embedding) or type(m).__name__ == "LearnedPositions"}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append((name, p))
    return [{"names": [n for n, _ in decay], "params": [p for _, p in decay], "weight_decay": weight_decay},
            {"names": [n for n, _ in no_decay], "params": [p for _, p in no_decay], "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> tuple[torch.optim.AdamW, list[str]]:
    """AdamW over `model` and the parameter names in optimizer order (for saving its state by name)."""
    groups = param_groups(model, cfg.weight_decay)
    names = [n for g in groups for n in g.pop("names")]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
    return opt, names


def optimizer_tensors(opt: torch.optim.Optimizer, names: list[str]) -> tuple[dict[str, Tensor], list[dict]]:
    """Optimizer state keyed by parameter name ("NAME/exp_avg"...) + the groups' hyperparameters."""
    sd = opt.state_dict()
    tensors = {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            t = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"{names[idx]}/{key}"] = t.detach().cpu().contiguous()
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [names[i] for i in g["params"]]}
              for g in sd["param_groups"]]
    return tensors, groups


def load_optimizer_tensors(opt: torch.optim.Optimizer, names: list[str], tensors: dict[str, Tensor],
                           groups: list[dict], source: str) -> None:
    index = {n: i for i, n in enumerate(names)}
    state: dict[int, dict[str, Tensor]] = {}
    for key, t in tensors.items():
        name, _, field = key.rpartition("/")
        if name not in index:
            raise ConfigError(f"{source}: optimizer state for unknown parameter {name!r}")
        state.setdefault(index[name], {})[field] = t
    saved_groups = [dict(g, params=[index[n] for n in g["params"]]) for g in groups]
    try:
        opt.load_state_dict({"state": state, "param_groups": saved_groups})
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{source}: optimizer state does not fit the model ({e})") from None


def micro_batches(batch: dict[str, Tensor], rank: int, world: int, accum: int) -> list[dict[str, Tensor]]:
    """Rows of the global batch for this process, cut into `accum` micro-batches:
    rows [rank*B/world, (rank+1)*B/world) of every tensor, then `accum` equal slices of those."""
    size = next(iter(batch.values())).size(0)
    if size % (world * accum):
        raise ConfigError(f"the batch of {size} rows does not split into {world} process(es) x {accum} "
                          "micro-batch(es); change --batch-size or --grad-accum")
    per_rank, per_micro = size // world, size // (world * accum)
    mine = {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in batch.items()}
    return [{k: v[i * per_micro:(i + 1) * per_micro] for k, v in mine.items()} for i in range(accum)]


def autocast(device: torch.device, precision: str):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA GPU is available (use --device cpu)")
        return torch.device("cuda", local_rank)
    if name != "cpu":
        raise ConfigError(f"--device {name!r}: choose auto, cpu or cuda")
    return torch.device("cpu")


def fit(task: Task, cfg: TrainConfig, resume: str | None = None, command: list[str] | None = None,
        args: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train `task` as described by `cfg`, writing into cfg.out; continue from the checkpoint
    directory `resume` if given. Returns a summary (best_val_loss, step, checkpoint, ...)."""
    from .loop import Trainer

    cfg.check()
    return Trainer(task, cfg, command=command, args=args).run(resume)
