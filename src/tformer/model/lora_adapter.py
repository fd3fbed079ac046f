"""One LoRA adapter (lora.py applies them), and training through a layer with adapters, or through a
frozen layer, as one autograd Function.

    y = base(x) + Σ_i s_i · B_i A_i x_i        x_i = dropout_i(x) (x itself without dropout), (M, K) -> (M, N)

Run op by op, autograd keeps more than the gradients need. An adapter added in place into its rows of
the base's output records a clone of the whole output for the backward (CopySlices) and pads its
gradient back to full width (as_strided_backward: zeros, then a copy); added out of place (where the
base's output tracks no gradient) it builds a zero-padded copy of the output and a second output. Each
is a tensor the size of the layer's output, forward or backward, per layer and step. Here the forward
adds s_i B_i A_i x_i into y in place, outside autograd, and the backward computes, from the output's
gradient g (M, N) and g_i = g[:, rows of adapter i]:

    dL/dx   = g W  (the base's `base_grad`)  +  Σ_i (s_i g_i B_i) A_i      (into dL/dx_i where x_i is not x)
    dL/dA_i = (s_i g_i B_i)ᵀ x_i            dL/dB_i = (s_i g_i)ᵀ (A_i x_i)ᵀ  (computed as ((x_i A_iᵀ)ᵀ g_i)ᵀ s_i:
                                             the (r, rows) product, ~2.5x faster on a CPU's BLAS)
    dL/dW   = gᵀ x,  dL/db = Σ_m g_m        (only where the base's weight trains: LoRALinear)

keeping x_i and h_i = x_i A_iᵀ (M, r) only: no copy of the input or the output. The forward's values are
those of the op-by-op path, bit for bit (same products, same order: (h_i B_iᵀ) · s_i, then added).
A frozen base never needs its input for the backward (g W needs W alone), so an int8 base without
adapters (quant.Int8Linear) keeps nothing at all.

The base is any object with `base_product(x (M, K), scratch=None) -> (M, N)` (no graph: called inside the
Function; `scratch`: see block_buffer) and `base_grad(g (M, N)) -> (M, K)` = g W; LoRALinear and
quant.Int8Linear are two, lm_loss.Dense (an output layer's) a third.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .dropout import Dropout


def block_buffer(scratch: list[Tensor] | None, size: int, like: Tensor) -> Tensor:
    """A flat tensor of `size` elements in like's dtype and device, for a base's product: the one `scratch` holds
    where it is large enough, else a new one, left in `scratch` for the next call. lm_loss passes one list for
    all its blocks of rows: a fresh (rows x vocabulary) tensor a block is fresh pages from the system each time
    (glibc hands blocks this large back on free), whose first touches cost a sixth of the product's time and
    whose churn grows the heap (BENCHMARKS.md, "LoRA"). None: always a new tensor."""
    if scratch is None:
        return like.new_empty(size)
    if not scratch or scratch[0].numel() < size or scratch[0].dtype != like.dtype:
        scratch[:] = [like.new_empty(size)]
    return scratch[0][:size]


class Adapter(nn.Module):
    """One low-rank update s·B A, written into rows [start, stop) of its layer's output."""

    def __init__(self, in_features: int, start: int, stop: int, r: int, alpha: float, dropout: float = 0.0,
                 rslora: bool = False, device=None, dtype=None):
        super().__init__()
        self.start, self.stop, self.r, self.alpha, self.rslora = start, stop, r, alpha, rslora
        self.scaling = alpha / math.sqrt(r) if rslora else alpha / r
        self.a = nn.Parameter(torch.empty(r, in_features, device=device, dtype=dtype))
        self.b = nn.Parameter(torch.zeros(stop - start, r, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.a, a=math.sqrt(5))
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """(..., in) -> (..., stop - start): this adapter's share of the layer's output."""
        return F.linear(F.linear(self.dropout(x), self.a), self.b) * self.scaling

    def delta(self) -> Tensor:
        """(stop - start, in): what merging adds to those rows of W."""
        return (self.b @ self.a) * self.scaling

    def add_to(self, y: Tensor, x: Tensor) -> Tensor:
        """y (..., out) plus this adapter in its rows, in place (without gradients: lora_product trains)."""
        y[..., self.start:self.stop] += self(x)
        return y


class LoRAFunction(torch.autograd.Function):
    """apply(x, base, spans, n, *tensors): tensors = x_1..x_n (None where x_i is x), then A_1, B_1, ..., then the
    base's W and b where they train (else nothing). spans: ((start, stop, s), ...) of the n adapters."""

    @staticmethod
    def forward(ctx, x, base, spans, n, *tensors):
        inputs, ab, trained = tensors[:n], tensors[n:3 * n], tensors[3 * n:]
        y = base.base_product(x)                                                 # (M, N)
        hs = []
        for i, (start, stop, scaling) in enumerate(spans):
            xi = x if inputs[i] is None else inputs[i]
            h = F.linear(xi, ab[2 * i]).to(y.dtype)                              # (M, r); bf16 under autocast
            b = ab[2 * i + 1].to(y.dtype)
            if math.frexp(scaling)[0] == 0.5:         # s = 2^e: (h Bᵀ) s + y, exactly, without an (M, rows) temporary
                y[:, start:stop].addmm_(h, b.t(), alpha=scaling)
            else:
                y[:, start:stop] += F.linear(h, b).mul_(scaling)                 # (h Bᵀ) s, as Adapter.forward
            hs.append(h)
        ctx.base, ctx.spans, ctx.n, ctx.trained = base, spans, n, len(trained)
        keep_x = any(t is None for t in inputs) or bool(trained)                 # an adapter's or W's gradient reads x
        ctx.save_for_backward(x if keep_x else None, *inputs, *hs, *ab)
        return y

    @staticmethod
    def backward(ctx, g):
        n, spans = ctx.n, ctx.spans
        x, *rest = ctx.saved_tensors
        inputs, hs, ab = rest[:n], rest[n:2 * n], rest[2 * n:]
        needs = ctx.needs_input_grad
        gx = ctx.base.base_grad(g) if needs[0] else None                         # (M, K) = g W
        g_inputs, g_ab = [None] * n, [None] * (2 * n)
        for i, (start, stop, scaling) in enumerate(spans):
            a, b, xi = ab[2 * i], ab[2 * i + 1], x if inputs[i] is None else inputs[i]
            a, b, xi = a.to(g.dtype), b.to(g.dtype), xi.to(g.dtype)             # autocast: g is bf16, A and B fp32
            gd = g[:, start:stop]                                                # (M, rows), a view; s goes on
            gh = gd.mm(b).mul_(scaling)                                          # (M, r): s g_i B_i
            if needs[4 + n + 2 * i]:
                g_ab[2 * i] = gh.t().mm(xi)                                      # (r, K)
            if needs[5 + n + 2 * i]:
                g_ab[2 * i + 1] = hs[i].t().mm(gd).t().mul_(scaling)             # (rows, r), as (h_iᵀ g_i)ᵀ
            if inputs[i] is None and gx is not None:
                gx.addmm_(gh, a)
            elif inputs[i] is not None and needs[4 + i]:
                g_inputs[i] = gh.mm(a)
        g_trained = []
        if ctx.trained:                                                          # the base's W (and b) train too
            g_trained = [g.t().mm(x.to(g.dtype)) if needs[4 + 3 * n] else None]
            if ctx.trained == 2:
                g_trained.append(g.sum(0) if needs[5 + 3 * n] else None)
        return (gx, None, None, None, *g_inputs, *g_ab, *g_trained)


def lora_product(x: Tensor, base, adapters: Sequence, trained: Sequence[Tensor] = ()) -> Tensor:
    """x (..., K) -> (..., N): base(x) plus each adapter's s·B A dropout(x) in its rows, through LoRAFunction.
    `adapters`: objects with start, stop, scaling, a, b and dropout (lora.Adapter); `trained`: the base's
    weight and bias where they require grad (their gradients then come back too)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    inputs = []
    for adapter in adapters:
        xi = adapter.dropout(x2)
        inputs.append(None if xi is x2 else xi)
    spans = tuple((a.start, a.stop, a.scaling) for a in adapters)
    params = [p for a in adapters for p in (a.a, a.b)]
    y = LoRAFunction.apply(x2, base, spans, len(spans), *inputs, *params, *trained)
    return y.view(*shape[:-1], y.size(-1))
