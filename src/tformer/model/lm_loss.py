"""The language-model loss of training: output layer + cross-entropy over the vocabulary, a block of rows
at a time, so that the (tokens x vocabulary) logits and their gradient never exist whole.

    loss = (1/n) Σ_{m: y_m ≠ ignore} ( log Σ_v exp z_mv  −  z_m,y_m )       z = h Wᵀ + b   (M, V)

`F.cross_entropy(head(h), y)` keeps the logits z and the log-probabilities, and its backward makes their
gradient and the logits' gradient: four (M, V) tensors (a GPT-2 batch of 4 x 128 tokens: 98 MB each in
fp32). Here each block of rows (BLOCK logits at most) computes its logits, its loss and at once its
gradients, as Liger-Kernel's fused linear cross-entropy does, then lets its logits go:

    dL/dz = (softmax(z) − onehot(y)) / n   (0 on ignored rows)
    dL/dh = dL/dz W        dL/dW = (dL/dz)ᵀ h        dL/db = Σ_m dL/dz_m

The forward keeps dL/dh (M, D) (and dL/dW, dL/db where they train); the backward scales them by the
loss's gradient. Each product is computed once, as autograd would (z, dL/dh, dL/dW where W trains).
The head's product goes through lora_adapter's base protocol (`base_product`, `base_grad`), every block's
logits into one buffer (lora_adapter.block_buffer): a float layer's by `Dense`, an int8 layer's its own
(inference/quant.py: its weight dequantised a block at a time); an output layer with adapters of its own runs
as a whole module, then F.cross_entropy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import dense
from .lora import LoRALinear
from .lora_adapter import block_buffer

IGNORE_INDEX = -100          # a label that trains nothing (F.cross_entropy's default ignore_index)
BLOCK = 1 << 23              # logits per block of rows: 32 MB in fp32 (4 blocks for GPT-2's 4 x 128 tokens)


def block_rows(rows: int, vocab: int) -> int:
    """Rows per block: at most BLOCK logits each, the rows split evenly over the blocks."""
    blocks = -(-rows * vocab // BLOCK)
    return max(1, -(-rows // max(1, blocks)))


def block_loss(z: Tensor, y: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """z (m, V) fp32 logits, overwritten with exp(z − max z); y (m,) labels (any column on ignored rows).
    -> (each row's loss (m,), 0 where ignored; each row's Σ exp(z − max z) (m, 1)).
    As log_softmax computes it: −(z_y − max − log Σ exp(z − max))."""
    top = z.amax(dim=1, keepdim=True)                                            # (m, 1)
    picked = z.gather(1, y[:, None]) - top                                       # (m, 1): z_y − max
    z.sub_(top).exp_()
    total = z.sum(dim=1, keepdim=True)
    loss = total.log().sub_(picked).squeeze(1)
    return loss.masked_fill_(~valid, 0.0), total


class LinearCrossEntropy(torch.autograd.Function):
    """apply(h (M, D), y (M,), base, W or None, b or None) -> the mean loss; W, b: the head's, where they train."""

    @staticmethod
    def forward(ctx, h, y, base, weight, bias):
        valid = y != IGNORE_INDEX
        n = valid.sum().float()
        weights = valid.float() / n.clamp(min=1)                                 # 1/n a trained row, 0 an ignored one
        y = y.masked_fill(~valid, 0)                                             # ignored rows read column 0
        step = block_rows(h.size(0), base.out_features)
        need_h, need_w, need_b = ctx.needs_input_grad[0], weight is not None, bias is not None
        gh = torch.zeros_like(h) if need_h else None
        gw = gb = None
        total = h.new_zeros((), dtype=torch.float32)
        scratch: list[Tensor] = []                                               # the blocks' logits, one buffer
        for start in range(0, h.size(0), step):
            rows = slice(start, start + step)
            hb, yb, wb = h[rows], y[rows], weights[rows]
            out = base.base_product(hb, scratch)                                 # (m, V); bf16 under autocast
            z = out.float()
            loss, sums = block_loss(z, yb, valid[rows])
            total += loss.sum()
            if not (need_h or need_w or need_b):
                continue
            z.mul_(wb[:, None] / sums)                                           # softmax / n, 0 on ignored rows
            z.index_put_((torch.arange(z.size(0)), yb), -wb, accumulate=True)    # − onehot / n: dL/dz
            dz = z.to(out.dtype)
            if need_h:
                gh[start:start + step] = base.base_grad(dz)                      # dL/dz W (m, D)
            if need_w:            # (V, D) += dL/dzᵀ h, summed in W's dtype (bf16 products under autocast)
                hb = hb.to(dz.dtype)
                if gw is None:
                    gw = dz.t().mm(hb).to(weight.dtype)
                elif gw.dtype == dz.dtype:
                    gw.addmm_(dz.t(), hb)
                else:
                    gw.add_(dz.t().mm(hb))
            if need_b:
                gb = z.sum(0) if gb is None else gb.add_(z.sum(0))
        # Kept on ctx, not saved: the backward hands them over and lets go, so that autograd can take
        # dL/dW as the weight's .grad instead of copying it (a saved tensor would still hold it).
        ctx.grads = [gh, gw, None if gb is None else gb.to(bias.dtype)]
        return total / n

    @staticmethod
    def backward(ctx, g):
        grads, ctx.grads = ctx.grads, None      # times the loss's gradient, in place (no test of g: no sync)
        gh, gw, gb = [None if t is None else t.mul_(g.to(t.dtype)) for t in grads]
        return gh, None, None, gw, gb


def lm_loss(hidden: Tensor, head: nn.Module, labels: Tensor) -> Tensor:
    """The mean cross-entropy of head(hidden) against `labels`, rows labelled IGNORE_INDEX left out:
    hidden (..., D), labels (...) -> a scalar (fp32), equal to F.cross_entropy(head(hidden).float() ...)."""
    h, y = hidden.reshape(-1, hidden.size(-1)), labels.reshape(-1)
    if isinstance(head, LoRALinear) and head.lora and not head.merged:           # adapters on the output layer
        return F.cross_entropy(head(h).float(), y, ignore_index=IGNORE_INDEX)
    trained = [p if p is not None and p.requires_grad and torch.is_grad_enabled() else None
               for p in (head.weight, head.bias)]
    if not torch.is_grad_enabled():                                              # evaluation: the loss alone
        h = h.detach()
    base = Dense(head, h.device.type) if head.weight.is_floating_point() else head   # else int8 (quant.py)
    return LinearCrossEntropy.apply(h, y, base, *trained)


class Dense:
    """A float output layer's product and gradient, in the base protocol:

    - in fp32 where oneDNN multiplies faster than PyTorch's default (dense.takes: AMD CPUs, whose MKL runs
      AVX2), z = h Wᵀ + b and dL/dz W by oneDNN: 24 + 29 against 52 + 60 ms for a block of 128 rows of
      GPT-2's output layer on a Zen 5. Elsewhere (MKL):
    - in fp32, z = (W hᵀ)ᵀ, a transposed view of a (V, m) product: with V in the tens of thousands and m a
      block's rows, a CPU's fp32 GEMM computes W hᵀ about a third faster than h Wᵀ (measured on Zen 4, one
      and two threads); the softmax reads the view as it would a (m, V) tensor, and dL/dz W takes it as it
      is. In bf16 the two are as fast and dL/dz W is slower from the view: z = h Wᵀ, autocast's F.linear.
    - in fp32, every block's logits are written into one buffer (lora_adapter.block_buffer; an int8 output
      layer does the same): ~30 ms of a GPT-2-small LoRA step's ~1.2 s on Intel AMX (benchmarks/lora_cost.py).
    - under autocast, W (and b) converted to its dtype once, where autocast would convert a frozen W again
      for each block's product and gradient (it keeps only the casts of weights that train)."""

    def __init__(self, head: nn.Module, device_type: str):
        self.out_features = head.out_features
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        self.weight = head.weight.detach().to(dtype or head.weight.dtype)
        self.bias = None if head.bias is None else head.bias.detach().to(self.weight.dtype)

    def base_product(self, x: Tensor, scratch: list[Tensor] | None = None) -> Tensor:
        """(m, V) logits; in fp32 written into `scratch`'s buffer (lora_adapter.block_buffer)."""
        x = x.to(self.weight.dtype)
        if self.weight.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        if dense.takes(x, self.weight):                  # oneDNN, where faster: 24 against 52 ms a block on a Zen 5
            return dense.product(x, self.weight, self.bias)
        z = block_buffer(scratch, x.size(0) * self.out_features, x).view(self.out_features, x.size(0))
        z = torch.mm(self.weight, x.t(), out=z).t()                              # (m, V), stored (V, m)
        return z if self.bias is None else z.add_(self.bias)

    def base_grad(self, g: Tensor) -> Tensor:
        return dense.grad_input(g.to(self.weight.dtype), self.weight)           # (m, D) = dL/dz W
