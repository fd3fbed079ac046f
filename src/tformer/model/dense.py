"""The float products of training on a CPU, y = x Wᵀ + b and its two gradients, by whichever of PyTorch's
default (MKL's GEMM) and oneDNN runs fp32 faster on this CPU.

PyTorch multiplies fp32 on a CPU with MKL, and MKL runs its AVX2 code on AMD CPUs: on a Zen 5, GPT-2-small's
products ran at ~205 GFLOP/s through `torch.mm` and at 400-470 through oneDNN (the same library PyTorch uses
for bf16 products and for inference plans: `torch.ops.mkldnn._linear_pointwise`, which takes the plain weight
and transposed views as they are; BENCHMARKS.md, "Training"). Which is faster is timed once per process on a
GPT-2-sized layer (`onednn_faster`, ~0.2 s); oneDNN must win by 10%, so an Intel CPU, where MKL runs AVX-512, and
any CPU where the two tie keep PyTorch's (the same products and values, run to run).

    y = linear(x, w, b)           # F.linear with autograd; its products by oneDNN where that is faster
    y = forward(x, w, b)          # the same without a graph, and
    gx = grad_input(g, w)         # g W, for a product whose gradient a caller computes itself (LoRA's)
    product_into(out, x, w); add_grad_input(gx, g, w)     # the same by blocks (an int8 base's)

Only fp32 CPU tensors outside autocast and torch.compile take oneDNN (autocast's bf16 products are oneDNN's
already; Inductor lowers F.linear its own way).
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F
from torch import Tensor

TIMED_SHAPE = (512, 768, 2304)      # rows, in, out: GPT-2-small's QKV projection on 4 x 128 tokens


def product(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (M, K) @ w (N, K)ᵀ + bias by oneDNN, w plain or a transposed view."""
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


@functools.cache
def onednn_faster(threads: int) -> bool:
    """Whether oneDNN's fp32 product (and its gradients' shapes) ran faster than PyTorch's default here, with
    `threads` threads: each timed three times on TIMED_SHAPE, the best of each kept."""
    if not torch.backends.mkldnn.is_available():
        return False
    m, k, n = TIMED_SHAPE
    rng = torch.Generator().manual_seed(0)      # its own: a run's stream (dropout masks) is not drawn from
    x, w, g = (torch.randn(*shape, generator=rng) for shape in ((m, k), (n, k), (m, n)))
    ours = lambda: (product(x, w), product(g, w.t()), product(g.t(), x.t()))            # noqa: E731
    theirs = lambda: (F.linear(x, w), g.mm(w), g.t().mm(x))                             # noqa: E731

    def best(f) -> float:
        f()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            f()
            times.append(time.perf_counter() - start)
        return min(times)
    return best(ours) < 0.9 * best(theirs)


def takes(x: Tensor, w: Tensor) -> bool:
    """Whether oneDNN multiplies these in training here: fp32 CPU tensors, no autocast, not being compiled
    (torch.compile lowers F.linear itself: Inductor cannot lower this op inside a custom Function), oneDNN
    faster."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
            and onednn_faster(torch.get_num_threads()))


def forward(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (M, K) Wᵀ + bias without a graph (inside another autograd Function), by oneDNN where `takes` says so."""
    return product(x, w, bias) if takes(x, w) else F.linear(x, w, bias)


def linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, w, bias) with its gradients, the products by oneDNN where `takes` says so."""
    if not takes(x, w):
        return F.linear(x, w, bias)
    return LinearFunction.apply(x, w, bias)


def grad_input(g: Tensor, w: Tensor) -> Tensor:
    """g (M, N) @ w (N, K): the gradient a product passes back to its input."""
    return product(g, w.t()) if takes(g, w) else g.mm(w)


def product_into(out: Tensor, x: Tensor, w: Tensor) -> None:
    """out = x wᵀ: MKL writes into `out`; oneDNN's call takes no `out=`, so its product is copied in."""
    if takes(x, w):
        out.copy_(product(x, w))
    else:
        torch.mm(x, w.t(), out=out)


def add_grad_input(gx: Tensor, g: Tensor, w: Tensor) -> None:
    """gx += g w (a gradient summed over blocks of w's rows)."""
    if takes(g, w):
        gx += product(g, w.t())
    else:
        gx.addmm_(g, w)


class LinearFunction(torch.autograd.Function):
    """y = x Wᵀ + b; dL/dx = g W, dL/dW = gᵀ x, dL/db = Σ g, each product by oneDNN. Keeps x (for dL/dW,
    only where W trains) and W, as F.linear's graph does."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
        x2 = x.reshape(-1, x.size(-1))
        ctx.save_for_backward(x2 if w.requires_grad else None, w)
        ctx.shape = x.shape
        return product(x2, w, bias).view(*x.shape[:-1], w.size(0))

    @staticmethod
    def backward(ctx, g: Tensor):
        x2, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.size(-1))
        gx = product(g2, w.t()).view(ctx.shape) if ctx.needs_input_grad[0] else None
        gw = product(g2.t(), x2.t()) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0) if ctx.needs_input_grad[2] else None
        return gx, gw, gb
