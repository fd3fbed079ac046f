"""Low-rank adapters (LoRA, Hu et al. 2021) on the linear layers, applied from outside the model.

    y = x Wᵀ + b + s · B A dropout(x)       A (r, in), B (rows, r), s = alpha / r  (rsLoRA: alpha / √r)

W and b stay frozen; only A and B train. A starts as nn.Linear's weights do (Kaiming-uniform,
a = √5) and B at zero, so training starts from the base model (peft's initialisation).

tformer fuses projections that Hugging Face keeps apart: self-attention's qkv_proj holds [q; k; v]
(k and v have H_kv·hd rows under grouped-query attention), cross-attention's kv_proj [k; v], and a
gated feed-forward's up [gate; up]. An adapter targets a logical projection; the base keeps its one
fused product and each adapter adds its low-rank product into its own rows of the output:

    qkv_proj output   [  q (H·hd)  |  k (H_kv·hd)  |  v (H_kv·hd)  ]
    target "q"           s B_q A_q x
    target "v"                                         s B_v A_v x
    target "qkv"      s B A x over every row (GPT-2's c_attn: one adapter on the fused matrix)

Targets (TARGETS): q, k, v, qkv, o (out_proj; self- and cross-attention), gate, up, down, lm_head, head.

    apply_lora(model, r=8, alpha=16, targets=("q", "v"))   # in place; only the adapters require grad
    merge(model); unmerge(model)                           # W += s B A (exactly undone up to rounding)
    with adapters_off(model): ...                          # the base alone, adapters set aside (no copy)
    remove_lora(model)                                     # plain Linear layers again, W as it is now

A targeted Linear becomes a LoRALinear holding the same weight and bias Parameters (tied weights stay
tied, the base's state-dict names do not change); its adapters (lora_adapter.Adapter) add
`<layer>.lora.<target>.a` / `.b`. With gradients on, a LoRALinear computes through one autograd Function
(lora_adapter.lora_product) that keeps only what the adapters' gradients need.

Decoding plans: an unmerged layer keeps its plan aside (`base_plan`, `plan` None: the fused GPT step and the
argmax screen, which read `plan`, cannot skip an adapter); merging changes W, so generate() plans again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError
from . import dense
from .attention import MultiHeadAttention
from .layers import FeedForward
from .linear import Linear, Plan
from .lora_adapter import Adapter, lora_product

TARGETS = ("q", "k", "v", "qkv", "o", "gate", "up", "down", "lm_head", "head")


class LoRALinear(Linear):
    """A Linear with adapters on row ranges of its output (see the module docstring)."""

    base_plan: Plan | None = None         # the decoding plan of W while unmerged (forward alone uses it)

    def __init__(self, linear: nn.Linear):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias
        self.lora, self.merged = nn.ModuleDict(), False

    def forward(self, x: Tensor) -> Tensor:
        if self.merged or not self.lora:
            return super().forward(x)
        if torch.is_grad_enabled():           # training: one autograd Function, which keeps only what gradients need
            base = [p for p in (self.weight, self.bias) if p is not None]
            return lora_product(x, self, list(self.lora.values()), base if any(p.requires_grad for p in base) else ())
        plan, w = self.base_plan, self.weight
        y = plan(x, self.bias) if plan is not None and plan.usable(x, w) else F.linear(x, w, self.bias)
        for adapter in self.lora.values():
            y = adapter.add_to(y, x)
        return y

    def activated(self, x: Tensor, activation: str, act: Callable[[Tensor], Tensor]) -> Tensor:
        if self.merged or not self.lora:
            return super().activated(x, activation, act)
        return act(self(x))                   # the adapters' sum comes before the activation

    def base_product(self, x: Tensor, scratch: list[Tensor] | None = None) -> Tensor:
        return dense.forward(x, self.weight, self.bias)    # (M, K) -> (M, N), for lora_product

    def base_grad(self, g: Tensor) -> Tensor:
        return dense.grad_input(g, self.weight.to(g.dtype))   # dL/dx = g W (M, K); g is bf16 under autocast

    def make_plan(self, rows: int, kind: type[Plan] | None) -> Plan | None:
        if self.merged or not self.lora:
            return super().make_plan(rows, kind)
        # Plan W as Linear does (keeping a plan still valid), then move it to where only forward looks.
        self.plan, self.base_plan = self.base_plan, None
        try:
            return super().make_plan(rows, kind)
        finally:
            self.base_plan, self.plan = self.plan, None

    def merge(self) -> None:
        if not self.merged:
            self._add(+1)

    def unmerge(self) -> None:
        if self.merged:
            self._add(-1)

    def _add(self, sign: int) -> None:
        self.merged = sign > 0
        with torch.no_grad():                 # in place: W's version changes, so its plans go stale
            for adapter in self.lora.values():
                self.weight[adapter.start:adapter.stop] += sign * adapter.delta().to(self.weight.dtype)
        self.plan = self.base_plan = None


def slots(model: nn.Module) -> dict[str, dict[str, tuple[int, int]]]:
    """Where adapters can go: {layer path: {target: (first row, end row) of its output}}."""
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for name, m in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(m, MultiHeadAttention):
            q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
            if m.cross:
                out[f"{prefix}q_proj"] = {"q": (0, q)}
                out[f"{prefix}kv_proj"] = {"k": (0, kv), "v": (kv, 2 * kv)}
            else:
                out[f"{prefix}qkv_proj"] = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv),
                                          "qkv": (0, q + 2 * kv)}
            out[f"{prefix}out_proj"] = {"o": (0, m.out_proj.out_features)}
        elif isinstance(m, FeedForward):
            n = m.up.out_features
            out[f"{prefix}up"] = {"gate": (0, n // 2), "up": (n // 2, n)} if m.gated else {"up": (0, n)}
            out[f"{prefix}down"] = {"down": (0, m.down.out_features)}
    head = {"decoder": "lm_head", "encoder-decoder": "lm_head", "classifier": "head", "tagger": "head"}.get(
        getattr(model, "kind", None))
    if head is not None:
        out[head] = {head: (0, model.get_submodule(head).out_features)}
    return out


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """{path: layer} of every layer with adapters."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def refusal(model: nn.Module, path: str, target: str) -> str | None:
    """Why an adapter for `target` cannot go on the layer at `path`, or None."""
    layer = model.get_submodule(path)
    if not isinstance(layer, Linear) and not hasattr(layer, "with_adapters"):   # Int8Linear has it (QLoRA)
        return f"{path} is a {type(layer).__name__}, neither a Linear nor a layer that takes adapters"
    if isinstance(layer, LoRALinear) and layer.merged:
        return f"{path} has merged adapters; unmerge(model) before adding one"
    if isinstance(layer, LoRALinear) and target in layer.lora:
        return f"{path} already has an adapter for {target!r}"
    return None


def add_adapter(model: nn.Module, path: str, target: str, rows: tuple[int, int], r: int, alpha: float,
                dropout: float = 0.0, rslora: bool = False) -> Adapter:
    """A new adapter (peft's initialisation) for `target`, rows [start, stop) of the output of the layer
    at `path` (as slots() gives them), turning that layer into a LoRALinear where it is not one yet."""
    if (why := refusal(model, path, target)) is not None:
        raise ConfigError(f"LoRA: {why}")
    layer = model.get_submodule(path)
    if not isinstance(layer, LoRALinear):
        parent, _, child = path.rpartition(".")
        layer = layer.with_adapters() if hasattr(layer, "with_adapters") else LoRALinear(layer)
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    w = layer.weight                      # an int8 base's adapters are fp32
    layer.lora[target] = adapter = Adapter(layer.in_features, *rows, r, alpha, dropout, rslora, device=w.device,
                                           dtype=w.dtype if w.is_floating_point() else None)
    return adapter


def train_only_adapters(model: nn.Module) -> None:
    """requires_grad for the adapters' weights only."""
    model.requires_grad_(False)
    for layer in lora_layers(model).values():
        layer.lora.requires_grad_(True)


def check_settings(r, alpha, dropout) -> None:
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ConfigError(f"LoRA rank r={r!r} must be a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ConfigError(f"LoRA alpha={alpha!r} must be a positive number")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"LoRA dropout={dropout!r} must be in [0, 1)")


def apply_lora(model: nn.Module, r: int, alpha: float, dropout: float = 0.0,
               targets: str | Iterable[str] = ("q", "v"), rslora: bool = False) -> nn.Module:
    """Add an adapter (rank r, scaling alpha / r, or alpha / √r with rslora) on every layer each target
    names, in place, and freeze everything else: afterwards only adapter weights require grad.
    Returns the model. Nothing changes when an argument is refused (ConfigError)."""
    check_settings(r, alpha, dropout)
    targets = tuple(dict.fromkeys((targets,) if isinstance(targets, str) else targets))
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise ConfigError(f"LoRA targets {unknown or list(targets)}: choose from {', '.join(TARGETS)}")
    table = slots(model)
    if missing := [t for t in targets if not any(t in names for names in table.values())]:
        kind = getattr(model, "kind", "model")
        raise ConfigError(f"LoRA target(s) {', '.join(missing)} name no layer of this {kind}")
    places = [(path, t) for path, names in table.items() for t in targets if t in names]
    if (why := next((w for w in (refusal(model, path, t) for path, t in places) if w), None)) is not None:
        raise ConfigError(f"LoRA: {why}")                    # refused before anything changes
    for path, t in places:
        add_adapter(model, path, t, table[path][t], r, alpha, dropout, rslora)
    train_only_adapters(model)
    return model


def merge(model: nn.Module) -> nn.Module:
    """W += s·B A in every adapted layer (the adapters are then idle). Returns the model."""
    layers = lora_layers(model)
    counts = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    if tied := [path for path, layer in layers.items() if counts[id(layer.weight)] > 1]:
        raise ConfigError(f"LoRA: the weight of {', '.join(tied)} is shared with another layer (tied embeddings): "
                          f"merging would change both; keep its adapter unmerged")
    for layer in layers.values():
        layer.merge()
    return model


def unmerge(model: nn.Module) -> nn.Module:
    """Undo merge: W -= s·B A (equal to the unmerged weights up to fp rounding). Returns the model."""
    for layer in lora_layers(model).values():
        layer.unmerge()
    return model


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapter tensors only, under their names in model.state_dict()."""
    return {f"{path}.lora.{t}.{p}": getattr(a, p).detach()
            for path, layer in lora_layers(model).items() for t, a in layer.lora.items() for p in ("a", "b")}


def load_lora_state_dict(model: nn.Module, state: dict[str, Tensor]) -> nn.Module:
    """Strictly load lora_state_dict()'s tensors into a model with the same adapters (apply_lora with
    the same rank and targets first): a missing, unexpected or misshapen tensor is a ConfigError."""
    expected = lora_state_dict(model)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ConfigError(f"LoRA state does not match the model's adapters: missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}")
    if bad := [k for k, v in expected.items() if tuple(state[k].shape) != tuple(v.shape)]:
        raise ConfigError(f"LoRA state: {bad[0]} has shape {tuple(state[bad[0]].shape)}, "
                          f"the adapter {tuple(expected[bad[0]].shape)}")
    if any(layer.merged for layer in lora_layers(model).values()):
        raise ConfigError("LoRA: the adapters are merged; unmerge(model) before loading new ones")
    with torch.no_grad():
        for k, v in expected.items():
            v.copy_(state[k])
    return model


def remove_lora(model: nn.Module) -> nn.Module:
    """Plain Linear layers again, with W as it is now: merged adapters stay in W (peft's
    merge_and_unload after merge), unmerged ones are dropped (peft's unload). Returns the model."""
    for path, layer in lora_layers(model).items():
        plain = Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        plain.weight, plain.bias = layer.weight, layer.bias
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, plain)
    return model


def refuse_adapters(model: nn.Module, doing: str, merged_ok: bool = False) -> None:
    """ConfigError where `doing` (an export, a save, int8 quantisation) would drop `model`'s adapters
    without a word; merged_ok: adapters merged into W travel with it there."""
    if kept := [p for p, layer in lora_layers(model).items() if layer.lora and not (merged_ok and layer.merged)]:
        raise ConfigError(f"cannot {doing} a model with LoRA adapters (on {kept[0]}): merge them into the "
                          "weights and remove them first (tformer.model.lora.merge, remove_lora)")


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """`model` computing as its base alone inside the block: each layer's adapters set aside, then put back."""
    saved = {layer: layer.lora for layer in lora_layers(model).values()}
    if any(layer.merged for layer in saved):
        raise ConfigError("LoRA: merged adapters cannot be turned off; unmerge(model) first")
    for layer in saved:
        layer.lora = nn.ModuleDict()
    try:
        yield model
    finally:
        for layer, lora in saved.items():
            layer.lora = lora
