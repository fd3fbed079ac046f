"""Reading and writing a run directory (its layout: tformer.checkpoints.layout): the checks before a run starts,
metrics.jsonl and its plot, step checkpoints with their training state, pruning, best/.

Only the main process writes; under torchrun the others call the same methods, do not write, and
wait at the end of each save, so the trainer need not ask who it is at each call."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoints.format import read_config, save, verify
from ..checkpoints.layout import (
    BASE,
    BEST,
    CONFIG,
    METRICS,
    PLOT,
    STATE,
    checkpoint_dir,
    hidden_leftovers,
    holds_run,
    resolve,
    step_dirs,
)
from ..errors import CheckpointError
from .distributed import Dist


@dataclass
class TrainState:
    """Where training stands; saved as part of trainer_state.json, restored on --resume."""
    step: int = 0                      # optimizer steps done
    elapsed: float = 0.0               # training seconds, over every resumed part
    warm_elapsed: float | None = None  # `elapsed` when warm-up ended (the time-based cosine starts there)
    best_val_loss: float | None = None
    tokens: int = 0
    best: dict[str, Any] | None = None  # the record of RUN/best/ (--keep-best)


@dataclass
class FitResult:
    reason: str                        # max_steps, time_budget, stop_at or interrupted
    step: int
    best_val_loss: float | None
    checkpoint: str                    # the last step checkpoint
    best: dict[str, Any] | None        # RUN/best/'s record ({"metric", "mode", "value", "step"}), or None
    best_checkpoint: str | None
    run_dir: str
    elapsed: float
    tokens: int
    records: list[dict[str, Any]] = field(default_factory=list)  # what metrics.jsonl holds


def read_trainer_state(path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """(checkpoint dir, trainer_state.json) of a training checkpoint or run directory (the newest
    checkpoints/step-*, never best/: that one holds the best model, not where training stopped)."""
    ckpt = Path(verify(resolve(path, best=False))["_dir"])  # checksums first: never resume from a damaged checkpoint
    if not (ckpt / STATE).is_file():
        hint = f"resume from the run directory {ckpt.parent}" if ckpt.name == BEST else \
            "use --init to start a new run from it instead of --resume"
        raise CheckpointError(f"{ckpt} holds a model but no training state ({STATE}); {hint}")
    try:
        return ckpt, json.loads((ckpt / STATE).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{ckpt / STATE} is corrupt ({e})") from None


def parse_record(line: str) -> dict[str, Any] | None:
    """One metrics.jsonl line, or None for a blank or half-written one (a run killed mid-write)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


class RunDir:
    """The run directory `path`, written by the main process of `dist` only."""

    def __init__(self, path: str | os.PathLike, dist: Dist):
        self.path, self.dist, self.main = Path(path), dist, dist.main
        self.records: list[dict[str, Any]] = []  # metrics.jsonl as written so far (for the plot)
        self.base: Path | None = None  # a LoRA run's base checkpoint: checkpoints then hold the adapter only

    def check(self, resume: bool) -> None:
        """Refuse to overwrite another run; fail early (before training) when the directory is
        unwritable. The main process decides and tells the others, so they never race with its mkdir."""
        error = None
        if self.main:
            try:
                self._check_here(resume)
            except CheckpointError as e:
                error = str(e)
        error = self.dist.broadcast(error)
        if error:
            raise CheckpointError(error)

    def _check_here(self, resume: bool) -> None:
        run = self.path
        if run.exists() and not run.is_dir():
            raise CheckpointError(f"--out {run} is a file, not a directory")
        if not resume and run.is_dir() and holds_run(run):
            raise CheckpointError(f"--out {run} already holds a run (continue it with --resume {run}, "
                                  "or choose another --out)")
        try:
            run.mkdir(parents=True, exist_ok=True)
            probe = run / f".write-test-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise CheckpointError(f"cannot write to --out {run} ({e.strerror or e})") from None
        # Hidden leftovers of a run killed mid-save or mid-prune (never loaded): free their space.
        for leftover in hidden_leftovers(run):
            shutil.rmtree(leftover, ignore_errors=True)

    # --- metrics -------------------------------------------------------------------------
    def start_metrics(self, keep_until: int) -> None:
        """Keep the records up to step `keep_until` (on resume: forget what the interrupted run
        logged after its checkpoint; 0 for a new run)."""
        if not self.main:
            return
        path = self.path / METRICS
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines() if path.exists() else []
        self.records = [r for r in map(parse_record, lines) if r is not None and r.get("step", 0) <= keep_until]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records), encoding="utf-8")
        os.replace(tmp, path)

    def log(self, record: dict[str, Any]) -> None:
        if not self.main:
            return
        self.records.append(record)
        with open(self.path / METRICS, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def plot(self) -> None:
        if not self.main or not self.records:
            return
        try:
            from ..inspect.viz import plot_loss
        except ImportError:  # matplotlib missing: the metrics file still has everything
            return
        plot_loss(self.records, self.path / PLOT)

    # --- checkpoints ---------------------------------------------------------------------
    def save_step(self, step: int, model: nn.Module | None, task, state: dict[str, Any],
                  tensors: dict[str, dict[str, torch.Tensor]], keep: int) -> Path:
        """Write checkpoints/step-N/: the model, trainer_state.json (`state`) and one safetensors file
        per entry of `tensors` (optimizer, rng, ema); then keep only the newest `keep` checkpoints."""
        from safetensors.torch import save as st_save

        path = checkpoint_dir(self.path, step)
        if self.main:
            extra = {**getattr(task, "extra_files", {}), **{name: st_save(t) for name, t in tensors.items()}}
            extra[STATE] = json.dumps(state, indent=2).encode()
            save(model, path, tokenizer=task.tokenizer, meta={"task": task.name, **task.meta(), "step": step},
                 extra_files=extra, source_tokenizer=getattr(task, "source_tokenizer", None), adapter_base=self.base)
            self.prune(keep)
        self.dist.barrier()
        return path

    def prune(self, keep: int) -> None:
        for old in step_dirs(self.path)[:-keep]:
            hidden = old.with_name(f".{old.name}.deleting")  # never leave a half-deleted visible checkpoint
            os.replace(old, hidden)
            shutil.rmtree(hidden, ignore_errors=True)

    def newest_step(self) -> Path | None:
        steps = step_dirs(self.path)
        return steps[-1] if steps else None

    def has_step(self, step: int) -> bool:
        return checkpoint_dir(self.path, step).exists()

    # --- best/ ---------------------------------------------------------------------------
    @property
    def best_dir(self) -> Path:
        return self.path / BEST

    def best_record(self) -> dict[str, Any] | None:
        """The record ({"metric", "mode", "value", "step"}) of the model in RUN/best/, or None."""
        if not (self.best_dir / CONFIG).is_file():
            return None
        try:
            return read_config(self.best_dir).get("meta", {}).get("best")
        except CheckpointError:
            return None

    def save_best(self, model: nn.Module | None, task, record: dict[str, Any]) -> None:
        if self.main:
            save(model, self.best_dir, tokenizer=task.tokenizer,
                 meta={"task": task.name, **task.meta(), "step": record["step"], "best": record},
                 extra_files=getattr(task, "extra_files", None),
                 source_tokenizer=getattr(task, "source_tokenizer", None), adapter_base=self.base)
        self.dist.barrier()

    def save_base(self, model: nn.Module, task) -> Path:
        """Write RUN/base/: the frozen model a LoRA run's adapters are trained on (when --init is not it)."""
        path = self.path / BASE
        if self.main:
            save(model, path, tokenizer=task.tokenizer, meta={"task": task.name, **task.meta(), "lora_base": True},
                 source_tokenizer=getattr(task, "source_tokenizer", None))
        self.dist.barrier()
        return path
