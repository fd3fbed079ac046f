"""Several LoRA adapters over one frozen base, chosen row by row inside one batch (punica's batched
gather, S-LoRA; vLLM's multi-LoRA): a server answers requests for different adapters in the same step.

    y_i = x_i Wᵀ + b + s_a · B_a A_a x_i         row i of the batch uses adapter a = rows[i] (0: none)

The base's W and b stay unmerged, shared by every adapter. Each layer that some adapter targets becomes
a StackedLoRALinear (the same weight and bias Parameters), which keeps, per target (lora.slots' names:
q, k, v, qkv, o, gate, up, down, lm_head, head), the adapters' A and Bᵀ stacked on a leading axis:

    <layer>.lora.<target>.a        (N + 1, r, in)      r: the largest rank among the adapters there;
    <layer>.lora.<target>.bt       (N + 1, r, rows)    a smaller rank is padded with zeros, which add exact 0
    <layer>.lora.<target>.scaling  (N + 1,)            alpha / r (rsLoRA: alpha / √r)

Entry 0 is zeros (the base), and so is the entry of an adapter that does not target this slot. The
stack is the one copy of each adapter's tensors. Before each model.step, `select_adapters(model, rows)`
says which adapter each row of the batch uses; each adapted layer then adds to its rows of the output

    every row 0          nothing (the base's product alone)
    every row k          (x A_kᵀ) B_kᵀ · s_k, as lora_adapter.Adapter.forward (a prompt's prefill: one row)
    rows differ, few     h = x [A_0; ...; A_N]ᵀ (n, T, (N + 1) r), each row's other adapters' columns
      adapters            zeroed and its own scaled: y += h [B_0ᵀ; ...; B_Nᵀ]  (two plain products)
    rows differ, many    A, Bᵀ and s gathered per row (punica's BGMV):
                          y += bmm(bmm(x, A[rows]ᵀ), Bᵀ[rows]) · s[rows]

"Few": (N + 1) r <= DENSE_RANK. Running every adapter reads all their A and B (small next to W) and
computes the other adapters' products for nothing; the gather copies each row's A and B instead, a cost
that does not grow with N. On a CPU the first is cheaper up to about 16 adapters of rank 8
(benchmarks/lora_rows.py; docs/SERVING.md, "Adapters per request").

    adapters = [take_adapters(attach(base, a)) for a in ...]     # {path: {target: Adapter}} each, 1..N
    stack_adapters(base, adapters)
    select_adapters(base, [0, 2, 1, 1]); base.step(ids, cache, ...)

Decoding plans: as LoRALinear, the base's plan is kept aside (`base_plan`; `plan` None), so the fused GPT
step and the greedy argmax screen, which cannot add an adapter, leave these layers alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError
from .linear import Linear, Plan
from .lora import LoRALinear, lora_layers, remove_lora
from .lora_adapter import Adapter

SELECTION = "adapter_rows"      # the model attribute holding its RowAdapters, set by stack_adapters
DENSE_RANK = 128                # rows of every adapter's A together, up to which a mixed step runs them all


class RowAdapters:
    """Which adapter each row of the next steps uses: `single` (every row that one; 0: the base), or
    `index` (n,) and its `onehot` (n, N + 1) on the model's device when the rows differ. Shared by the
    model's StackedLoRALinears."""

    def __init__(self, count: int, device: torch.device):
        self.count, self.device = count, device
        self.single: int | None = 0
        self.index: Tensor | None = None
        self.onehot: Tensor | None = None

    def select(self, rows: Sequence[int]) -> None:
        if any(not 0 <= a <= self.count for a in rows):
            raise ValueError(f"adapter numbers {list(rows)}: this model has adapters 1..{self.count} (0: none)")
        first = rows[0] if rows else 0
        if all(a == first for a in rows):
            self.single, self.index = first, None
        else:
            self.single, self.index = None, torch.tensor(rows, device=self.device)
            self.onehot = F.one_hot(self.index, self.count + 1)


class Stack(nn.Module):
    """One target of one layer: the N adapters' A, Bᵀ and scaling, stacked (entry 0 zeros)."""

    def __init__(self, start: int, stop: int, a: Tensor, bt: Tensor, scaling: Tensor, present: list[bool]):
        super().__init__()
        self.start, self.stop, self.present = start, stop, present     # present[k]: adapter k targets this slot
        self.register_buffer("a", a)                  # (N + 1, r, in)
        self.register_buffer("bt", bt)                # (N + 1, r, rows): each adapter's B transposed
        self.register_buffer("scaling", scaling)      # (N + 1,)
        self.scales = scaling.tolist()

    def add_to(self, y: Tensor, x: Tensor, rows: RowAdapters) -> Tensor:
        """y (n, ..., out) plus each row's adapter in this target's rows, in place."""
        k = rows.single
        if k is not None:
            if self.present[k]:                      # (x A_kᵀ) B_kᵀ s_k, as Adapter.forward
                a, bt = self.a[k].to(x.dtype), self.bt[k].to(x.dtype)
                y[..., self.start:self.stop] += F.linear(F.linear(x, a), bt.t()) * self.scales[k]
            return y
        n, width = x.size(0), self.stop - self.start
        x3 = x.reshape(n, -1, x.size(-1))                                                # (n, T, in)
        a, bt = self.a.to(x.dtype), self.bt.to(x.dtype)
        if a.size(0) * a.size(1) <= DENSE_RANK:      # every adapter's low-rank product, each row keeping its own
            h = F.linear(x3, a.flatten(0, 1)).unflatten(-1, a.shape[:2])                 # (n, T, N + 1, r)
            h = h * (rows.onehot * self.scaling).to(h.dtype)[:, None, :, None]
            d = h.flatten(-2) @ bt.flatten(0, 1)                                         # (n, T, rows)
        else:                                        # each row's A and Bᵀ gathered (punica's BGMV)
            idx = rows.index
            d = torch.bmm(torch.bmm(x3, a[idx].transpose(1, 2)), bt[idx])                # (n, T, rows)
            d.mul_(self.scaling[idx].to(d.dtype).view(-1, 1, 1))
        y[..., self.start:self.stop] += d.view(*y.shape[:-1], width)
        return y


class StackedLoRALinear(Linear):
    """A Linear with the stacked adapters of several LoRA runs, each row of a batch using its own one."""

    base_plan: Plan | None = None         # the decoding plan of W (forward alone uses it)

    def __init__(self, linear: nn.Linear, rows: RowAdapters):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias
        self.lora, self.choice = nn.ModuleDict(), rows

    def forward(self, x: Tensor) -> Tensor:
        plan, w = self.base_plan, self.weight
        y = plan(x, self.bias) if plan is not None and plan.usable(x, w) else F.linear(x, w, self.bias)
        rows = self.choice
        if rows.single == 0:
            return y
        if rows.index is not None and rows.index.numel() != x.size(0):
            raise RuntimeError(f"select_adapters named {rows.index.numel()} rows; this step has {x.size(0)}")
        for stack in self.lora.values():
            y = stack.add_to(y, x, rows)
        return y

    def activated(self, x: Tensor, activation: str, act: Callable[[Tensor], Tensor]) -> Tensor:
        return act(self(x))                   # the adapters' sums come before the activation

    def make_plan(self, rows: int, kind: type[Plan] | None) -> Plan | None:
        # Plan W as Linear does (keeping a plan still valid), then move it to where only forward looks.
        self.plan, self.base_plan = self.base_plan, None
        try:
            return super().make_plan(rows, kind)
        finally:
            self.base_plan, self.plan = self.plan, None


def take_adapters(model: nn.Module) -> dict[str, dict[str, Adapter]]:
    """The unmerged adapters of `model` ({layer path: {target: Adapter}}), taken off: `model` is its plain
    base again (the same weight Parameters). What a reader attached (checkpoints.adapter.attach,
    checkpoints.hf.lora.from_peft), ready for stack_adapters."""
    layers = lora_layers(model)
    if any(layer.merged for layer in layers.values()):
        raise ConfigError("LoRA: the adapters are merged into the weights; unmerge(model) first")
    taken = {path: dict(layer.lora.items()) for path, layer in layers.items()}
    remove_lora(model)
    return taken


def _stack(adapters: list[Adapter | None], device, dtype) -> Stack:
    present = [a for a in adapters if a is not None]
    start, stop, width = present[0].start, present[0].stop, present[0].a.size(1)
    if any((a.start, a.stop) != (start, stop) for a in present):
        raise ConfigError("LoRA: adapters for one target cover different rows of its layer")
    r, n = max(a.r for a in present), len(adapters) + 1
    a = torch.zeros(n, r, width, device=device, dtype=dtype)
    bt = torch.zeros(n, r, stop - start, device=device, dtype=dtype)
    scaling = torch.zeros(n, device=device, dtype=torch.float32)
    for k, adapter in enumerate(adapters, 1):
        if adapter is not None:
            a[k, :adapter.r] = adapter.a.detach()
            bt[k, :adapter.r] = adapter.b.detach().t()
            scaling[k] = adapter.scaling
    return Stack(start, stop, a, bt, scaling, [False] + [x is not None for x in adapters])


def stack_adapters(model: nn.Module, adapters: Sequence[Mapping[str, Mapping[str, Adapter]]]) -> RowAdapters:
    """Put adapters 1..N (each as take_adapters gives it) on `model`, in place: every layer one of them
    targets becomes a StackedLoRALinear. Returns the model's RowAdapters (select_adapters sets it)."""
    if lora_layers(model) or model.__dict__.get(SELECTION) is not None:
        raise ConfigError("LoRA: the model already has adapters; stack adapters on a plain base model")
    weight = next(model.parameters())
    rows = RowAdapters(len(adapters), weight.device)
    paths = dict.fromkeys(path for adapter in adapters for path in adapter)
    for path in paths:
        layer = model.get_submodule(path)
        if not isinstance(layer, Linear) or isinstance(layer, LoRALinear):
            raise ConfigError(f"LoRA: {path} is a {type(layer).__name__}; stacked adapters need a plain Linear")
        stacked = StackedLoRALinear(layer, rows)
        targets = dict.fromkeys(t for adapter in adapters for t in adapter.get(path, {}))
        for target in targets:
            parts = [adapter.get(path, {}).get(target) for adapter in adapters]
            stacked.lora[target] = _stack(parts, layer.weight.device, layer.weight.dtype)
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, stacked)
    setattr(model, SELECTION, rows)
    return rows


def select_adapters(model: nn.Module, rows: Sequence[int]) -> None:
    """Row i of the next steps uses adapter rows[i] (0: none; a prompt's prefill: one row). Nothing
    on a model without stacked adapters."""
    choice = model.__dict__.get(SELECTION)
    if choice is not None:
        choice.select(rows)
