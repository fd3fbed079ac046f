"""A GPT's decoding step in one call of tformer's kernel (gemv.gpt_step), where the model allows it.

A decoding step of GPT-2 at batch 1 is mostly reading its weights; layer by layer it also runs a dozen
or more PyTorch ops and module calls per layer, a large share of the token on a 2-core CPU (BENCHMARKS.md,
"Kernels"). For a stack of
pre-LN blocks with LayerNorm, multi-head attention without rotary positions and a plain GELU/ReLU FFN
(GPT-2, GPT-Neo-like shapes), every weight already on the gemv plan (fp32) or quantised to int8
(quantize_int8: tformer's int8 kernel, int8_plans.Gemv8), the whole step runs in C:

    step = GPTStep.of(stack.layers)          # None where a layer does not fit
    x = step(x, caches)                      # (B, 1, D) -> (B, 1, D); None where this step does not fit

Layers are read, not copied: the table of addresses is rebuilt when a plan changes (a new generate,
an optimizer step), and a step the kernel cannot take (a mask, a beam search's lineage, more than
gemv.PLAN_ROWS rows, gradients, training mode) returns None, and the caller runs the layers as usual.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels import gemv
from ..model.kv_cache import KVCache
from ..model.layers import ACTIVATIONS, DecoderLayer, PreNorm
from ..model.linear import Gemv
from .int8_plans import Gemv8
from .quant import Int8Linear

ACTS = {F.gelu: 0, ACTIVATIONS["gelu_tanh"]: 1, F.relu: 2}     # the kernel's codes


def _norm(residual: nn.Module) -> nn.LayerNorm | None:
    ok = isinstance(residual, PreNorm) and type(residual.norm) is nn.LayerNorm
    return residual.norm if ok and residual.norm.elementwise_affine else None


def _fits(layer: nn.Module) -> bool:
    if not isinstance(layer, DecoderLayer) or layer.cross_attn is not None:
        return False
    attn, ffn = layer.attn, layer.ffn
    n1, n2 = _norm(layer.attn_residual), _norm(layer.ffn_residual)
    return (n1 is not None and n2 is not None and n1.eps == n2.eps and attn.rotary is None
            and not attn.cross and attn.head_dim % 16 == 0 and attn.head_dim <= gemv.MAX_HEAD
            and not ffn.gated and ffn.act in ACTS)


class GPTStep:
    """The table of one stack's addresses for gemv.gpt_step, valid while every plan is the one it was
    built from and the caches are the same tensors."""

    def __init__(self, layers: list[DecoderLayer]):
        self.layers = layers
        first = layers[0]
        self.heads, self.kv_heads, self.head_dim = first.attn.n_heads, first.attn.n_kv_heads, first.attn.head_dim
        self.ffn_dim = first.ffn.up.out_features
        self.eps = first.attn_residual.norm.eps
        self.act = ACTS[first.ffn.act]
        self.scale = first.attn.scale if first.attn.scale is not None else self.head_dim ** -0.5
        self.table: Tensor | None = None
        self.caches: list[Tensor] = []
        self.watch: list[tuple] = []                 # what the table was built from (_unchanged)
        self.kept: list[Tensor | None] = []

    @classmethod
    def of(cls, layers) -> GPTStep | None:
        layers = list(layers)
        if not layers or not gemv.available() or not all(_fits(layer) for layer in layers):
            return None
        shapes = {(x.attn.n_heads, x.attn.n_kv_heads, x.attn.head_dim, x.ffn.up.out_features, x.attn_residual.norm.eps,
                   x.ffn.act, x.attn.scale) for x in layers}
        return cls(layers) if len(shapes) == 1 else None

    @staticmethod
    def _linears(layer: DecoderLayer):
        """(owner, name) of the layer's four linears."""
        return (layer.attn, "qkv_proj"), (layer.attn, "out_proj"), (layer.ffn, "up"), (layer.ffn, "down")

    @staticmethod
    def _plan(lin: nn.Module) -> Gemv | Gemv8 | None:
        """The copy of this linear's weight that the kernel reads: a Linear's fp32 Gemv plan, or an
        Int8Linear's int8 one; None where there is none (or it is stale)."""
        plan = lin.gemv_plan() if isinstance(lin, Int8Linear) else lin.plan
        return plan if isinstance(plan, (Gemv, Gemv8)) and plan.made_for(lin.weight) else None

    def _unchanged(self, caches: list[KVCache]) -> bool:
        """The check each step (a small fraction of what building the table takes; BENCHMARKS.md,
        "Kernels"): the same caches, the same linear modules, weights (not changed in place since) and plans.
        The norms' parameters and the biases are read where they were (the table keeps them alive)."""
        return (all(a is b for a, b in zip((t for c in caches for t in (c.k, c.v)), self.caches))
                and all(modules[name] is lin and tensors["weight"] is w and lin.__dict__.get(kind) is plan
                        and w.data_ptr() == plan.ptr and (version is None or w._version == version)
                        for modules, name, lin, tensors, w, version, kind, plan in self.watch))

    def _current(self, caches: list[KVCache]) -> bool:
        """Whether the table still holds the layers' plans and these caches (rebuilt if not)."""
        if self.table is not None and self._unchanged(caches):
            return True
        owners = [(owner, name, getattr(owner, name)) for layer in self.layers for owner, name in self._linears(layer)]
        linears = [lin for _, _, lin in owners]
        plans = [self._plan(lin) for lin in linears]
        if any(p is None for p in plans):
            return False
        norms = [n for layer in self.layers for n in (layer.attn_residual.norm, layer.ffn_residual.norm)]
        kept = [t for m in norms for t in (m.weight, m.bias)] + [m.bias for m in linears]
        if any(p is not None and (p.dtype != torch.float32 or not p.is_contiguous()) for p in kept):
            return False
        rows = []
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            n1, n2 = layer.attn_residual.norm, layer.ffn_residual.norm
            row = []
            for norm, pair in ((n1, (4 * i, 4 * i + 1)), (n2, (4 * i + 2, 4 * i + 3))):
                row += [norm.weight.data_ptr(), norm.bias.data_ptr() if norm.bias is not None else 0]
                for j in pair:
                    lin, plan = linears[j], plans[j]
                    row += [plan.packed.data_ptr(), int(isinstance(plan, Gemv8)),
                            lin.bias.data_ptr() if lin.bias is not None else 0]
            rows.append(row + [cache.k.data_ptr(), cache.v.data_ptr()])
        self.table, self.kept = torch.tensor(rows, dtype=torch.int64), kept
        self.caches = [t for c in caches for t in (c.k, c.v)]
        # nn.Module's own dicts: its attribute lookup (__getattr__) is slow next to a dict lookup.
        self.watch = [(owner._modules, name, lin, lin._buffers if isinstance(lin, Int8Linear) else lin._parameters,
                       lin.weight, plan.version, "kernel" if isinstance(lin, Int8Linear) else "plan", plan)
                      for (owner, name, lin), plan in zip(owners, plans)]
        return True

    def __call__(self, x: Tensor, caches: list[KVCache]) -> Tensor | None:
        """x (B, 1, D) after the embeddings -> the last block's output (B, 1, D), the caches one position
        longer; None (nothing changed) where the kernel cannot take this step."""
        B, t, D = x.shape
        if (t != 1 or B > gemv.PLAN_ROWS or x.dtype != torch.float32 or x.device.type != "cpu"
                or torch.is_grad_enabled() and x.requires_grad or len(caches) != len(self.layers)
                or self.layers[0].training):                                 # dropout: the layers apply it
            return None
        first = caches[0]
        pos, max_len = first.length, first.k.size(2)
        for c in caches:
            if (c.lineage is not None or c.length != pos or c.k.shape != (B, self.kv_heads, max_len, self.head_dim)
                    or c.k.dtype != torch.float32 or not (c.k.is_contiguous() and c.v.is_contiguous())
                    or c.v.shape != c.k.shape):
                return None
        if pos >= max_len or not self._current(caches):
            return None
        y = x.reshape(B, D).contiguous().clone()
        gemv.gpt_step(self.table, y, self.heads, self.kv_heads, self.head_dim, self.ffn_dim, max_len, pos, self.eps,
                      self.act, self.scale)
        for c in caches:
            c.length = pos + 1
        return y.view(B, 1, D)
