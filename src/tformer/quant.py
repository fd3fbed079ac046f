"""Int8 weight-only quantisation, for faster decoding.

Decoding one token at batch 1 reads every weight once and does two FLOPs per weight read, so its
speed is set by memory bandwidth: tokens/s ≈ bandwidth / bytes of weights. Storing the weights of
the linear layers as int8 (1 byte instead of 2 in bf16 or 4 in fp32) cuts the bytes per token.
Activations stay in floating point ("weight-only"); nothing is quantised during training.

Per output channel (row n of W, shape (N, K)) one scale s_n = max_k |W_nk| / 127, and
q_nk = round(W_nk / s_n) in [-127, 127]. Because s_n is constant along the row,

    y_n = Σ_k x_k W_nk ≈ Σ_k x_k (q_nk s_n) = s_n · Σ_k x_k q_nk

so the matmul runs on q directly and the scale is applied once per output. The rounding error of
each weight is at most s_n / 2, hence |y_n - y_exact_n| <= (s_n / 2) · Σ_k |x_k| (the bound the
tests check).

    model = quantize_int8(model)     # in place: every nn.Linear (output layer included) -> Int8Linear

Embedding tables stay as they are: a lookup reads one row per token, not the whole table. Use
bf16 activations on CPU (`model.to(torch.bfloat16)` first): PyTorch's int8 kernel there is fast for
bf16 inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(N, K) float -> (q (N, K) int8, scales (N,) float32), symmetric per output channel."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127                         # (N,)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()  # row-major, for the kernel
    return q, scales


class Int8Linear(nn.Module):
    """A drop-in for nn.Linear holding int8 weights and one scale per output feature.
    forward(x (..., K)) -> (..., N) in x's dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scales = quantize_weight(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)                                     # (M, K)
        scales = self.scales.to(x.dtype)
        if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16, torch.float32):
            # PyTorch's weight-only int8 kernel: converts q row by row inside the dot product.
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.weight, scales)
        else:
            y = F.linear(x2, self.weight.to(x.dtype)) * scales                   # s_n · Σ_k x_k q_nk
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def quantize_int8(model: nn.Module, skip: tuple[str, ...] = ()) -> nn.Module:
    """Replace every nn.Linear in `model` (in place) by an Int8Linear, except those whose qualified
    name starts with one of `skip`. Returns the model. For inference only: Int8Linear has no
    trainable parameters."""
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not any(name.startswith(s) for s in skip)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear(linear))
    return model

