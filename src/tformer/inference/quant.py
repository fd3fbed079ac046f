"""Int8 quantisation of the linear layers, for faster inference on a CPU.

Per output channel (row n of W, shape (N, K)) one scale s_n = max_k |W_nk| / 127, and
q_nk = round(W_nk / s_n) in [-127, 127]. Because s_n is constant along the row,

    y_n = Σ_k x_k W_nk ≈ Σ_k x_k (q_nk s_n) = s_n · Σ_k x_k q_nk

so the matmul runs on q directly and the scale is applied once per output. Two ways to run it:

- activations="int8" (the default; CPU, float inputs): each call also rounds its input to 7-bit
  integers and multiplies integers by integers (FBGEMM's dynamic int8 linear, as CTranslate2 and
  ONNX Runtime's dynamic int8 do). Each row m (token) is first divided by its own largest
  magnitude r_m, so that one token's outliers do not coarsen every other token's step; FBGEMM then
  rounds the whole (M, K) input with one step a = (max(x/r, 0) - min(x/r, 0)) / 127 <= 2/127:
  x_mk ≈ r_m·a·(u_mk - z), u in [0, 127]. 7 bits, not 8: the AVX2 instruction that multiplies u8
  by s8 adds pairs into int16, which 8-bit inputs can overflow. Integer products need no
  conversion of the weights, so this is fast for decoding at any batch or beam count (one row:
  reading the int8 weights; tens of rows: integer instead of float arithmetic; BENCHMARKS.md,
  "Against CTranslate2 and ONNX Runtime").
  Decoding steps of up to KERNEL_ROWS rows take tformer's own integer kernel instead where it is
  built (`Gemv8`, kernels/gemv_int8.c): each row is rounded on its own range [min(x, 0), max(x, 0)] with a step
  of (max - min) / 128 (FBGEMM's for one row: / 127); it reads the weights faster than FBGEMM's
  call, needs none of the PyTorch ops around it (a Marian beam search takes less time), and a GPT's
  fused step (fused.py) runs whole int8 layers in C (BENCHMARKS.md, "Kernels").
  Inputs of more than INT8_MAX_ROWS rows (encoders, prompts: compute-bound) are not rounded to 7
  bits, which would cost accuracy there (MiniLM's embeddings; BENCHMARKS.md, "Int8 quality"). On a
  CPU with bf16 units they multiply in bf16, in one call of oneDNN on its packed copy of the
  dequantised weight rounded to bf16, bf16(s_n q_nk), the bias added in the product (`WideBf16`, made
  when first needed): x, the weight and the sum are each rounded to bf16 (relative u = 2^-8), so
  |error| <= 3u·Σ_k |x_mk| s_n |q_nk| (to first order) on top of the weights' (each input's error
  relative to itself, where 7-bit inputs' is relative to the row's largest), at bf16's speed, with no
  conversion of q nor pass for the scales and the bias per call (an encoder kept in bf16 around them,
  quantize_int8, has no conversion at all; BENCHMARKS.md, "Against CTranslate2 and ONNX Runtime").
  Elsewhere they multiply by the dequantised weight, as in weight-only mode.
- activations="float" (weight-only): x stays in floating point; for a few rows on a CPU PyTorch's
  `_weight_int8pack_mm` converts q inside the dot product (fast for bf16 inputs on CPUs with
  AVX-512), otherwise the product uses the dequantised weight s_n·q_nk. Without FBGEMM (GPU,
  other CPUs) both modes take this path.

Error, per output (the bound the tests check): rounding each weight moves it by at most s_n / 2,
and rounding each input of row m by at most r_m·a / 2, so

    |y_mn - y_exact_mn| <= (s_n / 2) · Σ_k |x_mk|  +  (r_m·a / 2) · Σ_k s_n |q_nk|

(the second term only with int8 activations; with tformer's kernel r_m·a = (max - min) / 128).

    model = quantize_int8(model)     # in place: every nn.Linear (output layer included) -> Int8Linear

Embedding tables stay as they are: a lookup reads one row per token, not the whole table (a frozen base
under LoRA adapters, `--lora-int8`, has them int8 too: int8_embedding.py). With int8 activations on a
CPU the rest of the model is converted to fp32, the dtype the kernels take and return, whatever the
model's dtype was — except an encoder on a CPU with bf16 units, which runs in bf16 around its int8
layers (quantize_int8); with weight-only int8 it keeps its dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..devices import native_bf16
from ..errors import ConfigError
from ..kernels import gemv
from ..model import dense
from ..model.linear import POST_OPS, packs
from ..model.lora import LoRALinear, refuse_adapters
from ..model.lora_adapter import block_buffer, lora_product
from .int8_plans import Gemv8, Packed8, WideBf16, dynamic_int8_available

ACTIVATIONS = ("int8", "float")
# Past this many rows (long prompts, encoders) a product is compute-bound, and the int8 one is
# hardly faster than the float GEMM on AVX2 while rounding the inputs costs accuracy (MiniLM's
# embeddings, BENCHMARKS.md, "Int8 quality"): such inputs multiply by the dequantised weight (weight-only error).
INT8_MAX_ROWS = 256
# Up to this many rows (decoding steps: a batch's rows, beams x sentences) tformer's int8 kernel runs
# the product where it is built (Gemv8): FBGEMM's call costs more per product in the PyTorch ops around
# it (each row's range), and the kernel's integer products are as fast (BENCHMARKS.md, "Kernels").
KERNEL_ROWS = 64
# Training through a frozen int8 layer dequantises its weight this many values at a time (8 MB in fp32),
# forward and backward, and keeps none of it: the whole fp32 weight, kept for the backward, cost more
# memory than the fp32 model itself (BENCHMARKS.md, "LoRA: memory, step time and adapter size").
CHUNK = 1 << 21


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(N, K) float -> (q (N, K) int8, scales (N,) float32), symmetric per output channel."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127                         # (N,)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()  # row-major, for the kernel
    return q, scales


class Int8Linear(nn.Module):
    """A drop-in for nn.Linear holding int8 weights and one scale per output feature.
    forward(x (..., K)) -> (..., N) in x's dtype. `activations`: see the module docstring."""

    plan: Packed8 | None = None
    kernel: Gemv8 | None = None
    wide: WideBf16 | None = None

    def __init__(self, linear: nn.Linear, activations: str = "int8"):
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations={activations!r}: choose one of {ACTIVATIONS}")
        q, scales = quantize_weight(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.activations = activations
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and x.requires_grad:      # training through the frozen layer (LoRA below it)
            return lora_product(x, self, ())
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)                                     # (M, K)
        rows = x2.size(0)
        if 1 <= rows <= KERNEL_ROWS and self._integer_path(x) and self.gemv_plan() is not None:
            y = self.kernel(x2.float(), self.bias).to(x.dtype)                   # bias added in the kernel
            return y.reshape(*shape[:-1], self.out_features)
        if rows <= INT8_MAX_ROWS and self._integer_path(x):
            # In place where it can be: a fresh (M, N) tensor costs page faults, as much as the product here.
            xf = x2.float()
            if rows == 1:                # one row: FBGEMM's per-tensor range is the row's own
                y = self._packed()(xf).to(x.dtype)
            else:                        # (abs().amax is far faster than aminmax on these shapes)
                r = xf.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30)         # (M, 1): each row's own range
                y = self._packed()(xf / r).mul_(r).to(x.dtype)                   # r_m·a·s_n · Σ_k (u_mk - z) q_nk
        elif rows <= 4 and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16, torch.float32):
            # PyTorch's weight-only int8 kernel: converts q row by row inside the dot product.
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.weight, self.scales.to(x.dtype))
        elif self._wide_path(x, rows):
            return self._wide_product(x2, None).to(x.dtype).reshape(*shape[:-1], self.out_features)
        else:
            # Many rows: the weight, converted once, costs little against the product itself.
            y = F.linear(x2, self.weight.to(x.dtype) * self.scales.to(x.dtype)[:, None])   # Σ_k x_k (s_n q_nk)
        if self.bias is not None:
            y = y.add_(self.bias.to(x.dtype))
        return y.reshape(*shape[:-1], self.out_features)

    def activated(self, x: Tensor, activation: str, act: Callable[[Tensor], Tensor]) -> Tensor:
        """act(self(x)) (Linear.activated): inside the product where it is oneDNN's bf16 one (many rows)."""
        x2 = x.reshape(-1, self.in_features)
        training = torch.is_grad_enabled() and x.requires_grad
        if activation in POST_OPS and not training and self._wide_path(x, x2.size(0)):
            return self._wide_product(x2, activation).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return act(self(x))

    def _wide_path(self, x: Tensor, rows: int) -> bool:
        return rows > INT8_MAX_ROWS and self._integer_path(x) and native_bf16(x.device) and packs(torch.bfloat16)

    def _wide_product(self, x2: Tensor, activation: str | None) -> Tensor:
        """Many rows, bf16 units: (x rounded to bf16) · bf16(s_n q_nk) + b (then the activation), in one call."""
        bias = None if self.bias is None else self.bias.bfloat16()
        return self.wide_plan()(x2.bfloat16(), bias, activation)

    def dequantised(self, start: int, stop: int, out: Tensor) -> Tensor:
        """Rows [start, stop) of W as s_n·q_nk, written into the first rows of `out` (in its dtype): a buffer
        reused block after block, one allocation for a whole product."""
        q = self.weight[start:stop]
        return out[:q.size(0)].copy_(q).mul_(self.scales[start:stop].to(out.dtype)[:, None])

    def chunks(self) -> range:
        return range(0, self.out_features, max(1, CHUNK // self.in_features))

    def base_product(self, x: Tensor, scratch: list[Tensor] | None = None) -> Tensor:
        """x (M, K) -> (M, N) = Σ_k x_k (s_n q_nk) + b, weight-only (lora_adapter.lora_product's forward in
        training, lm_loss's output layer), a block of output features at a time into one output (in `scratch`,
        lora_adapter.block_buffer): no fp32 copy of W. Under autocast in the autocast dtype, as F.linear would
        be (x converted; its gradient then comes back in it too)."""
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        y = block_buffer(scratch, x.size(0) * self.out_features, x).view(x.size(0), self.out_features)
        step = self.chunks().step
        block = x.new_empty(min(step, self.out_features), self.in_features)
        for n in self.chunks():
            dense.product_into(y[:, n:n + step], x, self.dequantised(n, n + step, block))
        return y if self.bias is None else y.add_(self.bias.to(x.dtype))

    def base_grad(self, g: Tensor) -> Tensor:
        """dL/dx = g W (M, N) -> (M, K), from the int8 weight a block at a time."""
        gx, step = g.new_zeros(g.size(0), self.in_features), self.chunks().step
        block = g.new_empty(min(step, self.out_features), self.in_features)
        for n in self.chunks():
            dense.add_grad_input(gx, g[:, n:n + step], self.dequantised(n, n + step, block))
        return gx

    def _integer_path(self, x: Tensor) -> bool:
        return (self.activations == "int8" and x.device.type == "cpu" and x.is_floating_point()
                and not (torch.is_grad_enabled() and x.requires_grad) and dynamic_int8_available())

    def gemv_plan(self) -> Gemv8 | None:
        """tformer's int8 kernel on this layer's weight (made when first needed), for int8 inputs on a
        CPU where the kernel is built; None elsewhere."""
        if self.activations != "int8" or self.weight.device.type != "cpu" or not gemv.available() or (
                self.bias is not None and self.bias.dtype != torch.float32):
            return None
        if self.kernel is None or not self.kernel.made_for(self.weight):
            self.kernel = Gemv8(self.weight, self.scales)
        return self.kernel

    def wide_plan(self) -> WideBf16:
        if self.wide is None or not self.wide.made_for(self.weight):
            self.wide = WideBf16(self.weight, self.scales)
        return self.wide

    def _packed(self) -> Packed8:
        if self.plan is None or not self.plan.made_for(self.weight):
            self.plan = Packed8(self.weight, self.scales.float())
        return self.plan

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel, "
                f"activations={self.activations}")

    def with_adapters(self) -> Int8LoRALinear:
        """This layer as the frozen base of LoRA adapters (tformer.model.lora.add_adapter calls it)."""
        return Int8LoRALinear(self)


class Int8LoRALinear(LoRALinear):
    """LoRA on a frozen int8 base (QLoRA on a CPU): y = Int8Linear(x) + s·B A dropout(x), the adapters in
    fp32. Merging is refused: W + s·B A rounded to int8 again is not what was trained (peft #2321);
    tformer.model.lora.merge on the fp32 base (load it without --lora-int8) is the way to a plain model."""

    def __init__(self, base: Int8Linear):
        nn.Module.__init__(self)                 # no fp32 weight: the base holds int8 ones
        self.in_features, self.out_features = base.in_features, base.out_features
        self.base, self.lora, self.merged = base, nn.ModuleDict(), False

    weight = property(lambda self: self.base.weight)
    bias = property(lambda self: self.base.bias)

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled():              # training: the base's weight-only product, no fp32 W kept
            return lora_product(x, self.base, list(self.lora.values()))
        y = self.base(x)
        for adapter in self.lora.values():
            y = adapter.add_to(y, x)
        return y

    def make_plan(self, rows: int, kind: type | None) -> None:
        return None                              # the base plans its own products

    def argmax(self, x: Tensor) -> None:
        return None                              # greedy decoding takes the whole output

    def merge(self) -> None:
        raise ConfigError("LoRA: cannot merge adapters into an int8-quantised base (rounding W + s·B A to int8 "
                          "again changes the outputs, peft #2321); merge them on the fp32 base instead")


def quantize_int8(model: nn.Module, skip: tuple[str, ...] = (), activations: str = "int8",
                  dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every nn.Linear in `model` (in place) by an Int8Linear, except those whose qualified
    name starts with one of `skip`. Returns the model. For inference only: Int8Linear has no
    trainable parameters.

    With int8 activations on a CPU the rest of the model (embeddings, norms, skipped linears; the
    int8 layers' scales and biases stay fp32) comes out in `dtype`, whatever its dtype was: each linear is
    converted to fp32 before it is quantised (a bf16 or fp16 weight is exact there), the rest after.
    dtype=None chooses:
    - fp32 for a model that decodes (decoder, encoder-decoder) or any model on a CPU without bf16 units:
      the int8 kernels take and return fp32, and the fused GPT step and the attention kernel read fp32
      norms, biases and caches: a bf16 model kept in bf16 around its int8 layers would decode on none of them;
    - bf16 for an encoder on a CPU with bf16 units: its products of many rows multiply in bf16 anyway
      (WideBf16), and the rest in bf16 costs half, with no conversion around each product (all-MiniLM-L6-v2
      on short texts: ~1.6x the sentences per second of the same model in fp32; BENCHMARKS.md, "Against
      CTranslate2 and ONNX Runtime").
    A bf16 model thus gives the very model its fp32 copy gives. With weight-only int8 (or off the CPU) the
    model keeps its dtype (`dtype` is not used)."""
    refuse_adapters(model, "quantise", merged_ok=True)    # Int8Linear would keep W and drop the adapters
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not any(name.startswith(s) for s in skip)]
    on_cpu = activations == "int8" and all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])
    if on_cpu and dtype is None:
        encoder = getattr(model, "kind", None) == "encoder" and native_bf16(torch.device("cpu"))
        dtype = torch.bfloat16 if encoder and packs(torch.bfloat16) else torch.float32
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if on_cpu:
            linear.float()                 # one layer at a time: the model is never held twice in fp32
        setattr(parent, child, Int8Linear(linear, activations))
    if not on_cpu:
        return model
    kept = [(m, m.scales, m.bias) for m in model.modules() if isinstance(m, Int8Linear)]
    model.to(dtype)
    for m, scales, bias in kept:             # fp32, as the kernels read them
        m.scales, m.bias = scales, bias
    return model
