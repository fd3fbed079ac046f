"""The run directory: every name and rule of its layout, in one place.

    RUN/metrics.jsonl                      one JSON object per log / validation step
    RUN/loss.png                           train and validation loss (tformer.inspect.viz.plot_loss)
    RUN/checkpoints/step-0001000/          a checkpoint (tformer.checkpoints.format: config.json, model.safetensors,
                                           tokenizer.json) + optimizer.safetensors + rng.safetensors
                                           + trainer_state.json (+ ema.safetensors with --ema)
    RUN/best/                              with --keep-best: the model of the evaluation with the best
                                           `best_metric` (its record in config.json meta["best"])

A LoRA run (`--lora-r`) writes each of those checkpoints as an adapter (tformer.checkpoints.adapter:
adapter_model.safetensors + adapter_config.json instead of model.safetensors) naming its base: the
--init checkpoint when the task's model is exactly that one, else the model as built, saved once as

    RUN/base/                              a plain checkpoint: the frozen base of the run's adapters

A run given no directory goes to runs/<task>-<date>-<time> (`default_run_dir`).
`tformer.load(RUN)` takes best/ when there is one, else the newest complete step-*; `--resume RUN`
always the newest step-* (best/ holds the best model, not where training stopped). Writes are atomic:
a checkpoint is built in a hidden `.step-*` / `.best.*` directory and renamed into place, so hidden
leftovers are never loaded, and a run killed mid-save or mid-prune is cleaned up when it resumes.
This module only names paths; tformer.training.rundir reads and writes them.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from ..errors import CheckpointError

CONFIG = "config.json"  # every checkpoint's manifest; checkpoint.save renames the directory into place
CHECKPOINTS = "checkpoints"
BEST = "best"
BASE = "base"  # a LoRA run's base, when it is not its --init checkpoint
METRICS = "metrics.jsonl"
PLOT = "loss.png"
STATE = "trainer_state.json"   # where training stopped: step, clock, best, arguments
OPTIMIZER = "optimizer.safetensors"
RNG = "rng.safetensors"
EMA = "ema.safetensors"
STEP_DIR = re.compile(r"step-\d{7}")
RUNS = "runs"  # where a run goes when no directory is given: runs/<task>-<date>-<time>


def default_run_dir(task: str) -> str:
    """The directory of a new run of `task` when none is given: runs/<task>-YYYYMMDD-HHMMSS (local time)."""
    return f"{RUNS}/{task}-{time.strftime('%Y%m%d-%H%M%S')}"


def checkpoint_dir(run: Path, step: int) -> Path:
    return run / CHECKPOINTS / f"step-{step:07d}"


def step_dirs(run: Path) -> list[Path]:
    """The visible step checkpoints of `run`, oldest first."""
    folder = run / CHECKPOINTS
    return sorted(p for p in folder.iterdir() if STEP_DIR.fullmatch(p.name)) if folder.is_dir() else []


def hidden_leftovers(run: Path) -> list[Path]:
    """Temporary directories of a save or prune that was killed (never loaded; safe to delete)."""
    folder = run / CHECKPOINTS
    return [*(folder.glob(".step-*") if folder.is_dir() else ()), *run.glob(f".{BEST}.*"), *run.glob(f".{BASE}.*")]


def holds_run(run: Path) -> bool:
    """Whether `run` already holds a run (so a new one must not write into it)."""
    return (run / CHECKPOINTS).exists() or (run / METRICS).exists()


def run_dir_of(ckpt: Path) -> Path:
    return ckpt.parent.parent if ckpt.parent.name == CHECKPOINTS else ckpt


def resolve(path: str | os.PathLike, best: bool = True) -> Path:
    """A checkpoint directory itself; inside a run directory, `best/` (the model with the best
    validation score, written by `tformer train --keep-best`) when `best` is true and it exists,
    else the newest complete `checkpoints/step-*` (the one training resumes from)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist (pass a checkpoint or run directory)")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory (pass a checkpoint or run directory)")
    if (path / CONFIG).exists():
        return path
    if best and (path / BEST / CONFIG).exists():
        return path / BEST
    ckpts = [p for p in (path / CHECKPOINTS).glob("step-*") if (p / CONFIG).exists()] \
        if (path / CHECKPOINTS).is_dir() else []
    if ckpts:
        return max(ckpts, key=_step_number)
    raise CheckpointError(f"{path} is not a tformer checkpoint: no {CONFIG} and no checkpoints/step-* inside")


def _step_number(path: Path) -> tuple[int, str]:
    """Sort key of `step-N` directories: by N as a number (step-9 before step-10), then by name."""
    digits = path.name.removeprefix("step-")
    return (int(digits) if digits.isdigit() else -1, path.name)
