"""Dropout: during training, zero each element with probability p and scale the rest by 1/(1-p).

On a CPU, `F.dropout` draws one 32-bit random number per element, which costs more than the
matmuls around it in a small model (BENCHMARKS.md, "What makes a CPU training step fast"). Here 15
random bits serve each element, so p is rounded to a multiple of 1/32768: through tformer's kernel
(kernels/dropout.c: the bits hashed from one seed drawn from PyTorch's generator, one pass forward and
one backward) where it is built, on fp32 and bf16 CPU tensors; else one 64-bit draw of PyTorch's serves
four elements (five passes forward). Either way a run's --seed (and a resumed run's saved generator)
gives the same masks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels.build import function


class DropoutFunction(torch.autograd.Function):
    """Dropout by tformer's kernel: the mask (a byte each) kept from the forward for the backward."""

    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:
        x, scale, bf16 = x.contiguous(), 1.0 / (1.0 - p), int(x.dtype == torch.bfloat16)
        seed = int(torch.empty((), dtype=torch.int64).random_())              # PyTorch's generator, one draw
        y, keep = torch.empty_like(x), torch.empty(x.shape, dtype=torch.uint8)
        function("tformer_dropout")(x.data_ptr(), y.data_ptr(), keep.data_ptr(), x.numel(), seed,
                                    round(p * 32768), scale, bf16)
        ctx.save_for_backward(keep)
        ctx.scale, ctx.bf16 = scale, bf16
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        (keep,) = ctx.saved_tensors
        g = g.contiguous().to(torch.bfloat16 if ctx.bf16 else torch.float32)
        dx = torch.empty_like(g)
        function("tformer_dropout_grad")(g.data_ptr(), dx.data_ptr(), keep.data_ptr(), g.numel(), ctx.scale, ctx.bf16)
        return dx, None


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":                      # GPUs draw random numbers in the same fused kernel
        return F.dropout(x, p)
    if (x.dtype in (torch.float32, torch.bfloat16) and type(x) is Tensor and not torch.compiler.is_compiling()
            and function("tformer_dropout") is not None):
        return DropoutFunction.apply(x, p)
    n = x.numel()
    bits = torch.empty((n + 3) // 4, dtype=torch.int64, device=x.device).random_()   # 63 random bits each
    keep = (bits.view(torch.int16)[:n].view(x.shape) & 0x7FFF) >= round(p * 32768)  # 4 lanes of 15 bits
    return x * keep * (1.0 / (1.0 - p))


class Dropout(nn.Dropout):
    """`nn.Dropout` with the cheaper CPU mask above (same parameters, same state dict: none)."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)
