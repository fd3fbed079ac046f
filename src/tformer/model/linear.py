"""The linear layer, y = x Wᵀ + b, and how a CPU runs it fast while generating.

`Linear` is `nn.Linear` (same parameters, same state-dict names, same result) with one addition
for decoding on a CPU. Each decoding step multiplies a few rows (one per sequence) by every weight
matrix once, so its speed is how fast the kernel reads the weights. PyTorch's default CPU kernels
for so few rows (MKL's matrix-vector and small-M products) use one core here and read fp32 weights
at about half of what memory delivers (`python benchmarks/gemv_bandwidth.py`; BENCHMARKS.md,
"Kernels"). The remedies below; `plans.plan_decoding(model, rows)`, which generate() calls, gives each kind of
layer the one that runs it fastest on this CPU, timed once (or, with TFORMER_PLANS=rules, the rule each
bullet states: Linear.kind_of_plan):

- gemv (fp32 matrices from mid size, steps of up to 8 rows, where tformer's own kernel is built:
  AVX-512 or AVX2 CPUs, gemv.py): a copy of the weight packed for the kernel (in 2 MiB pages), read at the
  memory's full rate on all cores (oneDNN's packed kernel reads below it); it runs the prompts too (up
  to PROMPT_ROWS rows, where F.linear is slower on AMD CPUs). Mid-sized matrices (under PACK_MIN) take
  it at any step size: at 64 rows (Marian's beam search) it also beats split and packed.
- packed (large matrices; bf16 ones from mid size): oneDNN multiplies by a copy of the weight laid
  out for its kernel ("packed") on all cores, at batch 1 and at batch 8 alike. Its fixed cost per
  call is more than small matrices take.
- split (mid-sized fp32 matrices where the kernel is not built): the output features are cut into
  one slice per thread and the slices run as one batched product (`torch.bmm`), which PyTorch
  spreads over the threads.
- gemv on bf16 weights (GemvBf16, a bf16 model where the kernel is built): never by rule; where the timing
  finds it faster than oneDNN's packed bf16 (at a few rows on Intel AMX).
- neither for small matrices (under SPLIT_MIN weights): F.linear is fastest there.

A plan is used only when gradients are off, for inputs of at most MAX_ROWS rows (a gemv or packed
plan: PROMPT_ROWS), and only while the weight is the one it was made for (same storage, same version
counter): an optimizer step or load_state_dict makes it stale, the layer falls back to F.linear, and
the next generate() plans again. A plan is a plain attribute (`layer.plan`): state_dict and .to()
never see it, a deepcopy starts without one. A packed or gemv plan costs one more copy of its weight
in memory (skipped when the copies would take more than half of the memory still available); any
plan keeps the weight's storage alive until it is replaced.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels import gemv
from . import dense

MAX_ROWS = 64               # decoding steps and short prompts; longer inputs keep F.linear
PROMPT_ROWS = 2048          # ... except with a gemv or packed plan: prompts, the server's rows and chunks
SPLIT_MIN = 1 << 16         # weights per matrix from which a plan pays: split (fp32) ...
PACK_MIN = 1 << 20          # ... up to here, packed above (and for bf16); benchmarks/gemv_bandwidth.py


def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack weights of this dtype here (bf16 needs AVX-512 or AVX-NE-CONVERT)."""
    return torch.backends.mkldnn.is_available() and (dtype != torch.bfloat16
                                                     or torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Plan:
    """How one layer multiplies during decoding. Valid while its weight is the one it was made for
    (same storage, same version counter); a copied module starts without one (see __deepcopy__)."""

    def __init__(self, weight: Tensor, rows: int):
        # An inference tensor has no version counter (and changes only inside inference_mode).
        self.version = None if weight.is_inference() else weight._version
        self.rows, self.ptr = rows, weight.data_ptr()
        self.max_elems = MAX_ROWS * weight.size(1)

    def made_for(self, weight: Tensor) -> bool:
        version = None if weight.is_inference() else weight._version
        return weight.data_ptr() == self.ptr and version == self.version

    def usable(self, x: Tensor, weight: Tensor) -> bool:
        """No gradient, x in the weight's dtype and not under autocast (F.linear would multiply in its
        dtype), within the rows it serves, and the weight unchanged."""
        return (not torch.is_grad_enabled() and x.dtype == weight.dtype and x.numel() <= self.max_elems
                and not torch.is_autocast_enabled(x.device.type) and self.made_for(weight))

    def __deepcopy__(self, memo):
        return None            # a copy gets its own plan when it generates (and oneDNN's tensors cannot be copied)


class Packed(Plan):
    """F.linear by oneDNN on a copy of the weight in its own layout, chosen for about `rows` rows. It
    also runs prompts and the server's batches of decoding rows and prompt chunks, up to PROMPT_ROWS
    rows: at 128-512 rows it is 1.1-1.6x F.linear on a Zen 4 (MKL's kernels are slow on AMD CPUs;
    BENCHMARKS.md, "Kernels")."""

    def __init__(self, weight: Tensor, rows: int, max_rows: int = PROMPT_ROWS):
        super().__init__(weight, rows)
        self.max_elems = max_rows * weight.size(1)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)   # oneDNN's layout

    def __call__(self, x: Tensor, bias: Tensor | None, activation: str | None = None) -> Tensor:
        """x Wᵀ + b, then `activation` (a name of POST_OPS) inside oneDNN's product where given."""
        post, algorithm = POST_OPS[activation] if activation is not None else ("none", "")
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.size(-1)), self.packed, bias, post, [], algorithm)
        return y.view(*x.shape[:-1], y.size(-1))


# Activations oneDNN applies to a packed product's output as it writes it (its "post-ops"), by tformer's
# names (layers.ACTIVATIONS): no second pass over an FFN's widest tensor, and no second tensor of its size.
POST_OPS = {"gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", ""), "silu": ("swish", "")}


class Split(Plan):
    """F.linear with the output features cut into one equal slice per thread, which torch.bmm runs
    in parallel. The weight must be row-major with out divisible by the thread count."""

    def __init__(self, weight: Tensor, rows: int):
        super().__init__(weight, rows)
        self.parts = p = torch.get_num_threads()
        self.w = weight.detach().view(p, weight.size(0) // p, weight.size(1)).transpose(1, 2)   # (P, in, out/P)

    def __call__(self, x: Tensor, bias: Tensor | None) -> Tensor:
        x2 = x.reshape(-1, x.size(-1)).expand(self.parts, -1, -1)               # (P, M, in), no copy
        y = (torch.bmm(x2, self.w) if bias is None                               # (P, M, out/P)
             else torch.baddbmm(bias.view(self.parts, 1, -1), x2, self.w))
        return y.transpose(0, 1).reshape(*x.shape[:-1], -1)


class Gemv(Plan):
    """tformer's own fp32 kernel (gemv.py) on a copy of the weight packed for it: planned for decoding
    steps of up to gemv.PLAN_ROWS rows (mid-sized matrices: up to MAX_ROWS), it also runs the prompts,
    up to PROMPT_ROWS rows (faster there than F.linear, whose MKL kernels are slow on AMD CPUs;
    BENCHMARKS.md, "Kernels"). An output layer asked for greedy tokens (`argmax`) also keeps a
    bf16 copy of its weight: half a copy more in memory."""

    def __init__(self, weight: Tensor, rows: int):
        super().__init__(weight, rows)
        self.max_elems = PROMPT_ROWS * weight.size(1)
        self.weight = weight.detach()
        self.packed = gemv.pack(self.weight)
        self.screen: Tensor | None = None            # argmax(): the weight in bf16, packed when first needed
        self.slack: Tensor | None = None

    def __call__(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if x.numel() == 0:
            return F.linear(x, self.weight, bias)
        return gemv.gemv(self.packed, x.reshape(-1, x.size(-1)), bias, self.weight.size(0)).view(*x.shape[:-1], -1)

    def argmax(self, x: Tensor, bias: Tensor | None) -> Tensor | None:
        """x (M, K), M <= gemv.PLAN_ROWS -> (M,): for each row the index of the largest output of
        self(x) (the first of equals), exactly, while reading half of W: a language model's output
        layer is the largest matrix of a decoding step (GPT-2: 154 of 500 MB), and greedy decoding
        needs only its argmax.

        1. Screen with W rounded to bf16 (`screen`, packed once): ỹ_j = x·w̃_j + b_j, each product exact in
           fp32, so |ỹ_j - y_j| <= Σ_k |x_k| |w_jk - w̃_jk| + the rounding of the two fp32 sums
           <= ‖x‖₁ e_j + r (‖x‖₁ a_j + |b_j|) = ‖x‖₁ s_j + r |b_j|: e_j and a_j the largest rounding error
           and |weight| of row j, r = 2 (K + 5) 2⁻²⁴ (two sums of K + 1 terms, 4 ulps for the
           comparisons), all padded by 1%.
        2. Only outputs with ỹ_j + reach_j >= max_i (ỹ_i - reach_i) can be the largest: usually a few.
        3. Their exact fp32 outputs, from the blocks that hold them (bit for bit those of self(x)),
           decide. None when x is not finite (the caller then takes all the outputs).
        All three in one call of the kernel (gemv.argmax_bf16): no PyTorch operation per step."""
        rounding = 1.01 * 2 * (self.weight.size(1) + 5) * 2.0 ** -24             # r, padded
        if self.screen is None:
            w = self.weight.float()
            rounded = w.bfloat16()
            error = (w - rounded.float()).abs().amax(dim=1)
            self.slack = 1.01 * error + rounding * (1 + 2.0 ** -8) * w.abs().amax(dim=1)   # s_j (|w̃| <= |w| (1 + 2⁻⁸))
            self.screen = gemv.pack(rounded, torch.bfloat16)
        return gemv.argmax_bf16(self.screen, self.packed, self.slack, x, bias, rounding, self.weight.size(0))


class GemvBf16(Plan):
    """tformer's kernel on a bf16 weight (its bf16 blocks, widened to fp32 inside: each product exact in fp32),
    for decoding steps of a bf16 model of up to MAX_ROWS rows: the input widened to fp32, the output rounded to
    bf16, as F.linear in bf16 rounds its own. Chosen only by timing (plans.py): at one row it ran GPT-2's layer
    matrices faster than oneDNN's packed bf16 on Intel AMX (decoding 1.01-1.08x), and lost from 8 rows."""

    def __init__(self, weight: Tensor, rows: int):
        super().__init__(weight, rows)
        self.packed = gemv.pack(weight.detach(), torch.bfloat16)
        self.out_features = weight.size(0)

    def __call__(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if x.numel() == 0:
            return x.new_zeros(*x.shape[:-1], self.out_features)
        y = gemv.gemv(self.packed, x.reshape(-1, x.size(-1)).float(), bias, self.out_features)
        return y.to(x.dtype).view(*x.shape[:-1], -1)


class Linear(nn.Linear):
    """nn.Linear that follows its decoding plan (see the module docstring) when one is usable."""

    plan: Plan | None = None

    def forward(self, x: Tensor) -> Tensor:
        plan, w = self.plan, self.weight
        if plan is not None and plan.usable(x, w):
            return plan(x, self.bias)
        if torch.is_grad_enabled():                       # training: its products by oneDNN where faster here
            return dense.linear(x, w, self.bias)
        return F.linear(x, w, self.bias)

    def activated(self, x: Tensor, activation: str, act: Callable[[Tensor], Tensor]) -> Tensor:
        """act(self(x)), `act` the function tformer names `activation`: in the product itself where the plan is
        oneDNN's packed weights and oneDNN has the activation (POST_OPS; an encoder's FFN on a CPU)."""
        plan = self.plan
        if isinstance(plan, Packed) and activation in POST_OPS and plan.usable(x, self.weight):
            return plan(x, self.bias, activation)
        return act(self(x))

    def argmax(self, x: Tensor) -> Tensor | None:
        """(B, in) -> (B,) the index of each row's largest output, the first of equals, without all
        the outputs where the plan can (Gemv.argmax); None where it cannot."""
        plan = self.plan
        if (isinstance(plan, Gemv) and plan.usable(x, self.weight) and x.dim() == 2
                and 1 <= x.size(0) <= gemv.PLAN_ROWS):
            return plan.argmax(x.contiguous(), self.bias)
        return None

    def kind_of_plan(self, rows: int = 1) -> type[Plan] | None:
        """The rule (TFORMER_PLANS=rules; plans.py times the candidates instead): which plan pays for this weight,
        for products of about `rows` rows (None: F.linear), as measured on Zen 3, Zen 4 and Intel AMX."""
        w = self.weight
        if not self.plannable():
            return None
        if w.dtype == torch.float32 and (rows <= gemv.PLAN_ROWS or w.numel() < PACK_MIN) and gemv.available():
            return Gemv
        if w.numel() < PACK_MIN and self.splittable():
            return Split
        return Packed if packs(w.dtype) else None

    def plannable(self) -> bool:
        """A CPU weight in fp32 or bf16 of at least SPLIT_MIN elements (smaller ones: F.linear is fastest)."""
        w = self.weight
        return (w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16) and not w.is_inference()
                and w.numel() >= SPLIT_MIN)

    def splittable(self) -> bool:
        """Whether Split can run this weight: fp32, row-major, its outputs cut evenly over more than one thread."""
        w, threads = self.weight, torch.get_num_threads()
        return w.dtype == torch.float32 and threads > 1 and w.is_contiguous() and w.size(0) % threads == 0

    def candidates(self, rows: int) -> list[type[Plan] | None]:
        """The plans that can run this weight here, for plans.py to time (None: F.linear). An fp32 weight at
        decoding steps of up to gemv.PLAN_ROWS rows, where tformer's kernel is built, keeps the kernel untimed:
        the fused GPT step (inference/fused.py) and the exact greedy argmax (Gemv.argmax) read its copy,
        gains a product's timing does not see."""
        w = self.weight
        if not self.plannable():
            return [None]
        if w.dtype == torch.float32 and rows <= gemv.PLAN_ROWS and gemv.available():
            return [Gemv]
        kinds: list[type[Plan] | None] = [None]
        if self.splittable():
            kinds.append(Split)
        if packs(w.dtype):
            kinds.append(Packed)
        if gemv.available():
            kinds.append(Gemv if w.dtype == torch.float32 else GemvBf16)
        return kinds

    def make_plan(self, rows: int, kind: type[Plan] | None) -> Plan | None:
        """Make a plan of `kind` (None: F.linear) for products of about `rows` rows, or keep a valid one."""
        old = self.plan
        if old is not None and old.rows == rows and type(old) is kind and old.made_for(self.weight):
            return old
        self.plan = None if kind is None else kind(self.weight, rows)
        return self.plan
