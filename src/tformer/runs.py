"""The layout of a run directory, read back: `RUN/checkpoints/step-NNNNNNN/` (a checkpoint plus
trainer_state.json), `RUN/best/`, `RUN/metrics.jsonl`. See train.py for what each file holds."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .checkpoint import BEST, read_config, resolve, verify
from .errors import CheckpointError

STATE = "trainer_state.json"


def checkpoint_dir(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:07d}"


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


def _record(line: str) -> dict[str, Any] | None:
    """One metrics.jsonl line, or None for a blank or half-written one (a run killed mid-write)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _best_record(run: Path) -> dict[str, Any] | None:
    """The record ({"metric", "mode", "value", "step"}) of the model in RUN/best/, or None."""
    if not (run / BEST / "config.json").is_file():
        return None
    try:
        return read_config(run / BEST).get("meta", {}).get("best")
    except CheckpointError:
        return None


def run_dir_of(ckpt: Path) -> Path:
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt
