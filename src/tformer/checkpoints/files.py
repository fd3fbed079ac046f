"""Atomic writes, for every directory and manifest the checkpoints package writes: a file
(`write_json_atomic`) or a whole directory (`atomic_dir`) appears complete or not at all.

    with atomic_dir(path) as tmp:      # a hidden .NAME.tmp-XXXXXXXX next to `path`
        (tmp / "model.safetensors").write_bytes(...)
    # here `path` holds everything written to tmp; had the block raised, nothing changed at `path`

    with atomic_file(path) as tmp:     # one file (a GGUF): a hidden .NAME.tmp-XXXXXXXX, renamed into place

A process killed mid-write leaves only the hidden directory (or file), which loading never reads and a
resumed run deletes (tformer.checkpoints.layout.hidden_leftovers).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def replace_dir(tmp: Path, path: Path) -> None:
    """Move the finished directory `tmp` to `path`, replacing an existing one. The old copy is moved
    aside first and deleted last, so a crash at any moment leaves one complete directory."""
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Write the directory `path` all at once: yields a new hidden directory next to it to fill;
    when the block ends, renames it into place (replacing an existing `path`, see `replace_dir`);
    when the block raises (KeyboardInterrupt included), deletes it and lets the error through."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        yield tmp
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Write the file `path` all at once: yields a hidden temporary path next to it to write; when the
    block ends, flushes it to disk and renames it into place (replacing an existing file); when the
    block raises (KeyboardInterrupt included), deletes it and lets the error through."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
