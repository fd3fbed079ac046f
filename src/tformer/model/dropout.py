"""Dropout: during training, zero each element with probability p and scale the rest by 1/(1-p).

On a CPU, `F.dropout` draws one 32-bit random number per element, which costs more than the
matmuls around it in a small model (BENCHMARKS.md, "What makes a CPU training step fast"). Here one
64-bit draw serves four elements, 15 random bits each, so p is rounded to a multiple of 1/32768:
cheaper than `F.dropout` forward + backward (same section).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":                      # GPUs draw random numbers in the same fused kernel
        return F.dropout(x, p)
    n = x.numel()
    bits = torch.empty((n + 3) // 4, dtype=torch.int64, device=x.device).random_()   # 63 random bits each
    keep = (bits.view(torch.int16)[:n].view(x.shape) & 0x7FFF) >= round(p * 32768)  # 4 lanes of 15 bits
    return x * keep * (1.0 / (1.0 - p))


class Dropout(nn.Dropout):
    """`nn.Dropout` with the cheaper CPU mask above (same parameters, same state dict: none)."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)
