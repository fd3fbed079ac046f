"""Which plan each Linear follows (linear.py has the plans): for decoding steps of a few rows
(`plan_decoding`, which generate() and the server call), and for an encoder's whole texts
(`plan_encoding`). Above gemv.PLAN_ROWS rows, large fp32 matrices take tformer's kernel or oneDNN's packed
weights by a timed pass (`gemv_limit`), kept in the per-user cache (plans.json)."""

from __future__ import annotations

import functools
import json
import os
import statistics
import tempfile
import time

import torch
from torch import nn

from ..devices import available_memory, warn_shared_openmp
from ..kernels import build, gemv
from .linear import MAX_ROWS, SPLIT_MIN, Gemv, Linear, Packed, packs


def plan_decoding(model: nn.Module, rows: int) -> int:
    """Plan every Linear of `model` for decoding steps of `rows` rows (batch × beams or samples per
    prompt). Packing is skipped when its copies would take more than half of the memory still
    available (decoding is then slower, not killed). Returns how many layers have a plan."""
    warn_shared_openmp()
    rows = max(1, min(rows, MAX_ROWS))
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    to_pack = sum(m.weight.numel() * m.weight.element_size() for m in layers
                  if m.kind_of_plan(rows) in (Packed, Gemv) and not isinstance(m.plan, (Packed, Gemv)))
    available = available_memory()
    pack = available is None or to_pack <= available // 2
    gemv_rows = gemv_limit(layers, rows) if pack else gemv.PLAN_ROWS
    return sum(m.make_plan(rows, pack, gemv_rows) is not None for m in layers)


def plan_encoding(model: nn.Module) -> int:
    """Plan every Linear of `model` for whole texts (an encoder's batches: from one short text to thousands of
    tokens, any number of rows): oneDNN's packed weights, where it packs their dtype and the matrix is large
    enough to pay (SPLIT_MIN). On a Zen 4, all-MiniLM-L6-v2's products on batches of short texts run at ~125
    GFLOP/s through F.linear (MKL) and ~180 packed: 1.3x the sentences per second (BENCHMARKS.md, "Against
    CTranslate2 and ONNX Runtime"). Valid plans are kept; skipped when the copies would take more than half of
    the memory still available. Returns how many layers have a packed plan."""
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.weight.device.type == "cpu"
              and m.weight.numel() >= SPLIT_MIN and not m.weight.is_inference() and packs(m.weight.dtype)]
    fresh = [m for m in layers if not (isinstance(m.plan, Packed) and m.plan.rows == ENCODE_ROWS
                                       and m.plan.made_for(m.weight))]
    available = available_memory()
    if available is not None and sum(m.weight.numel() * m.weight.element_size() for m in fresh) > available // 2:
        return 0
    for m in fresh:
        m.plan = Packed(m.weight, ENCODE_ROWS, max_rows=1 << 40)
    return len(layers)


ENCODE_ROWS = 1024                  # rows of a typical encoder batch (64 texts of ~16 tokens): oneDNN's blocking
TIMED_BYTES = 128 << 20             # weights streamed per timed pass: several times any CPU's last-level cache
GEMV_LIMITS: dict[str, int] = {}     # "cpu|threads|rows|shapes" -> gemv_rows: timed, or read from plans.json


def measuring() -> bool:
    """Whether plan_decoding times the two kernels (the default) or keeps the rule (TFORMER_PLANS=rules)."""
    return os.environ.get("TFORMER_PLANS", "timed") != "rules"


@functools.cache
def this_cpu() -> str:
    return build.cpu()[0]


def gemv_limit(layers: list[Linear], rows: int) -> int:
    """Up to how many rows large fp32 matrices take tformer's kernel rather than oneDNN's packed weights.
    By rule, gemv.PLAN_ROWS; for steps of more rows, whichever runs a whole step's products faster on this
    CPU (every weight read from memory, as in a decoding step, not one matrix from the cache, where the two
    tie), timed once and kept in the per-user cache (plans.json) by CPU, threads, rows and shapes. On a Zen 4
    at 16 rows the kernel wins: a decoding step of a GPT-2-small-sized model 54 -> 43 ms.
    TFORMER_PLANS=rules keeps the rule (the tests do)."""
    large = [m for m in layers if type(m) is Linear and m.kind_of_plan(rows) is Packed
             and m.kind_of_plan(rows, rows) is Gemv]
    if not large or not measuring():
        return gemv.PLAN_ROWS
    key = f"{this_cpu()}|{torch.get_num_threads()}|{rows}|{sorted({tuple(m.weight.shape) for m in large})}"
    if key not in GEMV_LIMITS:
        GEMV_LIMITS.update(read_limits())
    if key not in GEMV_LIMITS:
        timed, held = [], 0              # enough layers to stream TIMED_BYTES (no cache holds them), in order
        for m in large:
            timed.append(m)
            held += m.weight.numel() * m.weight.element_size()
            if held >= TIMED_BYTES:
                break
        times = {}
        for limit in (gemv.PLAN_ROWS, rows):
            for m in timed:
                m.make_plan(rows, True, limit)
            times[limit] = pass_time(timed, rows)
        GEMV_LIMITS[key] = min(times, key=times.get)
        write_limits()
    return GEMV_LIMITS[key]


def limits_path():
    return build.cache_root() / "plans.json"


def read_limits() -> dict[str, int]:
    try:
        found = json.loads(limits_path().read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in found.items() if type(v) is int} if isinstance(found, dict) else {}


def write_limits() -> None:
    """plans.json: what another process stored, and ours, written whole and renamed into place (atomic);
    where the cache cannot be written the next process times again."""
    path = limits_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump({**read_limits(), **GEMV_LIMITS}, f, indent=0, sort_keys=True)
        os.replace(f.name, path)
    except OSError:
        pass


def pass_time(layers: list[Linear], rows: int) -> float:
    """Seconds for one product of `rows` rows by every layer in turn: the median of 3 passes after one."""
    xs = {n: torch.randn(rows, n) for n in {m.in_features for m in layers}}
    times = []
    with torch.no_grad():
        for _ in range(4):
            start = time.perf_counter()
            for m in layers:
                m(xs[m.in_features])
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])
