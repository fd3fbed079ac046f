"""How an int8 layer (quant.Int8Linear) multiplies, by the rows it is given: plans made from its int8 weight q
and scales s when first needed, each valid while the weight is the one it was made for (a plain attribute:
state_dict and deepcopy never see it).

- Gemv8: tformer's integer kernel, decoding steps of up to quant.KERNEL_ROWS rows (and the fused GPT step).
- Packed8: FBGEMM's dynamic int8 linear, up to quant.INT8_MAX_ROWS rows.
- WideBf16: oneDNN's bf16 product on the dequantised weight, past INT8_MAX_ROWS rows on a CPU with bf16 units.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

from ..kernels import gemv
from ..model.linear import POST_OPS, Plan
from ..model.plans import ENCODE_ROWS


@functools.cache
def dynamic_int8_available() -> bool:
    """Whether this PyTorch build has FBGEMM's dynamic int8 linear (x86 CPUs); asked once (each
    Int8Linear call checks it, 49 calls a GPT-2 token, and asking PyTorch each time cost measurable
    time; BENCHMARKS.md, "Kernels")."""
    return "fbgemm" in torch.backends.quantized.supported_engines


class Packed8(Plan):
    """FBGEMM's copy of q and the scales, in its own layout; valid while the int8 weight is the one
    it was made for (a plain attribute: state_dict and deepcopy never see it)."""

    def __init__(self, weight: Tensor, scales: Tensor):
        super().__init__(weight, rows=0)
        zero = torch.zeros(weight.size(0), dtype=torch.long)
        with warnings.catch_warnings():          # PyTorch warns that quantized tensors are deprecated
            warnings.simplefilter("ignore", UserWarning)
            qw = torch._make_per_channel_quantized_tensor(weight, scales.double(), zero, 0)
            self.packed = torch.ops.quantized.linear_prepack(qw, None)

    def __call__(self, x: Tensor) -> Tensor:
        return torch.ops.quantized.linear_dynamic(x, self.packed, True)        # reduce_range: 7-bit inputs


class Gemv8(Plan):
    """tformer's int8 kernel (kernels/gemv_int8.c: 7-bit inputs by int8 weights, summed exactly in integers) on its
    own copy of q and the scales (gemv.pack8), for decoding steps of up to KERNEL_ROWS rows: it
    reads the weights faster than FBGEMM's call (BENCHMARKS.md, "Kernels"), and the fused GPT step
    (fused.py) runs whole layers with it, without a Python call per product."""

    def __init__(self, weight: Tensor, scales: Tensor):
        super().__init__(weight, rows=0)
        self.packed = gemv.pack8(weight, scales.float())
        self.out_features = weight.size(0)

    def __call__(self, x: Tensor, bias: Tensor | None) -> Tensor:
        return gemv.gemv8(self.packed, x, bias, self.out_features)


class WideBf16(Plan):
    """oneDNN's packed copy of the dequantised weight rounded to bf16, bf16(s_n q_nk), for inputs of more than
    INT8_MAX_ROWS rows on a CPU with bf16 units (AMX, AVX-512 BF16): one call multiplies and adds the bias.
    It costs twice the int8 weight's memory, kept while the layer lives (as a packed fp32 plan costs a copy of
    its weight), made only by the first input of that many rows (an encoder's batch, a long prompt)."""

    def __init__(self, weight: Tensor, scales: Tensor):
        super().__init__(weight, rows=0)
        dequantised = (weight.float() * scales.float()[:, None]).bfloat16()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(dequantised, ENCODE_ROWS)

    def __call__(self, x: Tensor, bias: Tensor | None, activation: str | None = None) -> Tensor:
        post, algorithm = POST_OPS[activation] if activation is not None else ("none", "")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, post, [], algorithm)
