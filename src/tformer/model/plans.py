"""Which plan each Linear follows (linear.py has the plans): for decoding steps of a few rows
(`plan_decoding`, which generate() and the server call), and for an encoder's whole texts
(`plan_encoding`). For decoding, each kind of layer (dtype and shape) takes the fastest of the plans that can
run it on this CPU, timed once per CPU, threads, rows and shape (`timed_kinds`) and kept in the per-user
cache (plans.json); TFORMER_PLANS=rules keeps the rule (Linear.kind_of_plan) instead."""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..devices import available_memory, warn_shared_openmp
from ..kernels import build
from .linear import MAX_ROWS, Gemv, GemvBf16, Linear, Packed, Plan, Split, packs

COPIES = (Packed, Gemv, GemvBf16)         # the plans that hold a copy of their weight


def plan_decoding(model: nn.Module, rows: int) -> int:
    """Plan every Linear of `model` for decoding steps of `rows` rows (batch × beams or samples per
    prompt). Copies of weights are skipped when they would take more than half of the memory still
    available (decoding is then slower, not killed). Returns how many layers have a plan."""
    warn_shared_openmp()
    rows = max(1, min(rows, MAX_ROWS))
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    kinds = {m: m.kind_of_plan(rows) for m in layers}
    available = available_memory()
    if measuring() and (available is None or available > 4 * TIMED_BYTES):       # timing holds copies too
        kinds.update(timed_kinds(layers, rows))
    to_copy = sum(m.weight.numel() * m.weight.element_size() for m in layers
                  if kinds[m] in COPIES and not isinstance(m.plan, COPIES))
    if available is not None and to_copy > available // 2:
        kinds = {m: None if kind in COPIES else kind for m, kind in kinds.items()}
    return sum(m.make_plan(rows, kinds[m]) is not None for m in layers)


def plan_encoding(model: nn.Module) -> int:
    """Plan every Linear of `model` for whole texts (an encoder's batches: from one short text to thousands of
    tokens, any number of rows): oneDNN's packed weights, where it packs their dtype and the matrix is large
    enough to pay (SPLIT_MIN), and where a timed pass (`timed_kinds`, at ENCODE_ROWS rows) finds them faster
    than F.linear for that kind of layer on this CPU. On a Zen 4, all-MiniLM-L6-v2's products on batches of short
    texts run at ~125 GFLOP/s through F.linear (MKL) and ~180 packed: 1.3x the sentences per second
    (BENCHMARKS.md, "Against CTranslate2 and ONNX Runtime"). Valid plans are kept; skipped when the copies would
    take more than half of the memory still available. Returns how many layers have a packed plan."""
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.plannable() and packs(m.weight.dtype)]
    if measuring():                          # where F.linear multiplies these shapes faster here, it keeps them
        unpacked = {m for m, kind in timed_kinds(layers, ENCODE_ROWS, lambda m: [None, Packed]).items()
                    if kind is None}
        for m in unpacked:
            m.plan = None
        layers = [m for m in layers if m not in unpacked]
    fresh = [m for m in layers if not (isinstance(m.plan, Packed) and m.plan.rows == ENCODE_ROWS
                                       and m.plan.made_for(m.weight))]
    available = available_memory()
    if available is not None and sum(m.weight.numel() * m.weight.element_size() for m in fresh) > available // 2:
        return 0
    for m in fresh:
        m.plan = Packed(m.weight, ENCODE_ROWS, max_rows=1 << 40)
    return len(layers)


ENCODE_ROWS = 1024                  # rows of a typical encoder batch (64 texts of ~16 tokens): oneDNN's blocking
TIMED_BYTES = 128 << 20             # weights streamed per timed pass: several times most CPUs' last-level cache
NAMES: dict[str, type[Plan] | None] = {"F.linear": None, "Split": Split, "Packed": Packed, "Gemv": Gemv,
                                       "GemvBf16": GemvBf16}
CHOICES: dict[str, str] = {}         # "cpu|threads|rows|dtype|shape" -> a name of NAMES: timed, or read from plans.json


def measuring() -> bool:
    """Whether plan_decoding times the candidates (the default) or keeps the rule (TFORMER_PLANS=rules)."""
    return os.environ.get("TFORMER_PLANS", "timed") != "rules"


@functools.cache
def this_cpu() -> str:
    return build.cpu()[0]


def key_of(m: Linear, rows: int) -> str:
    w = m.weight
    return f"{this_cpu()}|{torch.get_num_threads()}|{rows}|{str(w.dtype).removeprefix('torch.')}|{tuple(w.shape)}"


def timed_kinds(layers: list[Linear], rows: int,
                candidates: Callable[[Linear], list[type[Plan] | None]] | None = None
                ) -> dict[Linear, type[Plan] | None]:
    """For every layer with more than one candidate plan (Linear.candidates), the plan that ran its kind of
    layer (dtype and shape) fastest on this CPU at `rows` rows, timed once and kept in the per-user cache
    (plans.json) by CPU, threads, rows, dtype and shape. Every kind is timed in the same passes, each layer
    timed where it sits among the others (`kind_times`): its weights come from memory, as in a decoding step,
    not from the cache, where plans that differ in how fast they stream tie. Where it differs from the rule
    (BENCHMARKS.md, "Plans chosen by timing"): at 16 rows the kernel for GPT-2's large fp32 matrices (Zen 4: a
    decoding step 54 -> 43 ms; Intel AMX: 1.07-1.10x the tokens/s), at one row tformer's bf16 kernel for a bf16
    GPT-2's layer matrices (Intel AMX: 1.01-1.08x). `candidates`: the plans to time for a layer (default
    Linear.candidates)."""
    candidates = candidates or (lambda m: m.candidates(rows))
    groups: dict[str, list[Linear]] = {}
    for m in layers:
        if len(candidates(m)) > 1:
            groups.setdefault(key_of(m, rows), []).append(m)
    if any(k not in CHOICES for k in groups):
        CHOICES.update(read_choices())
    pending = {k: ms for k, ms in groups.items() if k not in CHOICES}
    if pending:
        times = kind_times(layers, pending, rows, candidates)
        for k, by_kind in times.items():
            CHOICES[k] = min(by_kind, key=by_kind.get)
        write_choices()
    # A choice read from plans.json that cannot run here (the kernel not built in this process) keeps the rule.
    return {m: NAMES[CHOICES[k]] for k, ms in groups.items() for m in ms
            if k in CHOICES and NAMES[CHOICES[k]] in candidates(m)}


def kind_times(layers: list[Linear], groups: dict[str, list[Linear]], rows: int,
               candidates: Callable[[Linear], list[type[Plan] | None]]) -> dict[str, dict[str, float]]:
    """{group: {plan name: seconds of its products at `rows` rows}}. What is timed: from each group, in the
    model's order (`layers`), its weights up to an equal share of TIMED_BYTES (a matrix larger than the share,
    an output layer, is cut to its first output rows: a product streams its weight row block by row block, and
    a slice streams as the whole does). Round r gives every group its r-th candidate plan (a group out of
    candidates keeps its last, so that every pass streams the same bytes), made on those weights, then times
    passes over all of them (pass_times). Nothing is kept: plan_decoding makes the chosen plans."""
    share = TIMED_BYTES // len(groups)
    group_of = {m: k for k, ms in groups.items() for m in ms}
    held = dict.fromkeys(groups, 0)
    units: list[tuple[str, Tensor, Tensor | None]] = []           # (group, weight or its first rows, bias)
    for m in layers:
        k = group_of.get(m)
        if k is None or held[k] >= share:
            continue
        w, step = m.weight.detach(), 16 * torch.get_num_threads()  # whole blocks of the kernel, a Split's slices
        keep = min(w.size(0), max(step, (share - held[k]) // (w.size(1) * w.element_size()) // step * step))
        units.append((k, w[:keep], None if m.bias is None else m.bias.detach()[:keep]))
        held[k] += keep * w.size(1) * w.element_size()
    kinds = {k: candidates(ms[0]) for k, ms in groups.items()}
    names = {kind: name for name, kind in NAMES.items()}
    times: dict[str, dict[str, float]] = {k: {} for k in groups}
    calls: list[tuple[str, str, Callable, Tensor, Tensor | None]] = [(k, "", F.linear, w, b) for k, w, b in units]
    for r in range(max(map(len, kinds.values()))):
        for i, (k, _, _, w, b) in enumerate(calls):
            if r < len(kinds[k]):
                kind = kinds[k][r]
                calls[i] = (k, names[kind], F.linear if kind is None else unweighted(kind(w, rows)), w, b)
        for k, t in pass_times(calls, rows).items():
            if r < len(kinds[k]):
                times[k][names[kinds[k][r]]] = t
    return times


def unweighted(plan: Plan) -> Callable:
    """A plan as F.linear's signature (x, weight, bias) -> y, the weight being the one it was made for."""
    return lambda x, w, b: plan(x, b)


def pass_times(calls: list[tuple[str, str, Callable, Tensor, Tensor | None]], rows: int) -> dict[str, float]:
    """{group: seconds} of one product of `rows` rows by each of `calls` ((group, plan name, product, weight,
    bias)), called in turn, each group's calls summed: the faster of 2 passes after one (the first pays for
    first touches)."""
    xs = {(w.size(1), w.dtype): torch.randn(rows, w.size(1)).to(w.dtype) for _, _, _, w, _ in calls}
    runs: dict[str, list[float]] = {k: [] for k, *_ in calls}
    with torch.no_grad():
        for _ in range(3):
            spent = dict.fromkeys(runs, 0.0)
            for k, _, product, w, b in calls:
                x = xs[w.size(1), w.dtype]
                start = time.perf_counter()
                product(x, w, b)
                spent[k] += time.perf_counter() - start
            for k, t in spent.items():
                runs[k].append(t)
    return {k: min(t[1:]) for k, t in runs.items()}


def choices_path():
    return build.cache_root() / "plans.json"


def read_choices() -> dict[str, str]:
    try:
        found = json.loads(choices_path().read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in found.items() if v in NAMES} if isinstance(found, dict) else {}


def write_choices() -> None:
    """plans.json: what another process stored, and ours, written whole and renamed into place (atomic);
    where the cache cannot be written the next process times again."""
    path = choices_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump({**read_choices(), **CHOICES}, f, indent=0, sort_keys=True)
        os.replace(f.name, path)
    except OSError:
        pass
