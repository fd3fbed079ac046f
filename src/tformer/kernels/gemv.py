"""tformer's kernels as PyTorch sees them: the weights packed for them, and the calls (the library: build.py).

A decoding step multiplies one row per sequence by every weight matrix, so its speed is how fast
the weights are read. oneDNN's packed kernel reads fp32 weights below the memory's rate, on AVX-512
and AVX2 EPYCs alike (BENCHMARKS.md, "Kernels"); `gemv_fp32.c` reads them at the full rate: the weight
is packed once into blocks of 16 output features (`pack`), which each thread streams front to back.
Where the library cannot run `available()` is False and linear.py keeps oneDNN's kernels.

    p = pack(w)                        # (N, K) -> (ceil(N / 16), K, 16), once per weight
    y = gemv(p, x, bias, w.size(0))    # x (M, K) -> (M, N) = x wᵀ + bias

The same library holds a bf16 variant (`pack(w, torch.bfloat16)`: half the bytes) and greedy decoding's
argmax through it (`argmax_bf16`, for linear.Gemv.argmax; gemv_bf16.c), an int8 product (`gemv8` on
`pack8(q, scales)`, for quant.Int8Linear; gemv_int8.c), decoding attention (`attend`: every row and head
in one call; attend.c), a GPT's whole decoding step built from these (`gpt_step`, for fused.GPTStep;
gpt_step.c), RMSNorm's forward and backward for training (`rms_norm`, `rms_norm_grad`, for
layers.RMSNorm; rmsnorm.c) and GELU's with tanh's approximation (`gelu_tanh`, `gelu_tanh_grad`, for
layers.gelu_tanh; gelu.c).
"""

from __future__ import annotations

import math
import mmap

import torch
import torch.nn.functional as F
from torch import Tensor

from .build import function, unsupported

__all__ = ["PLAN_ROWS", "BLOCK", "HUGE_PAGE", "MAX_HEAD", "MAX_KEYS", "available", "unsupported", "huge_page_empty",
           "pack", "pack8", "bf16_paired", "gemv", "argmax_bf16", "gemv8", "attend", "attend_whole", "attend_causal",
           "gpt_step", "rms_norm", "rms_norm_grad", "gelu_tanh", "gelu_tanh_grad"]

CHUNK_ROWS = 64       # rows per call of the kernel (8 or 4 at a time inside), so that they stay in the core's cache
PLAN_ROWS = 8         # Gemv plans for large matrices up to this many rows per step; above, oneDNN's packed
BLOCK = 16            # output features per block: one AVX-512 register of fp32, two AVX2 ones
HUGE_PAGE = 2 << 20   # x86-64 huge page: a packed weight at least this large lives in huge pages
MAX_HEAD = 256        # attend(): head sizes up to this (multiples of 16), and up to MAX_KEYS keys
MAX_KEYS = 16384


def available() -> bool:
    """Whether the kernel is built and can run here (unsupported() says why not, where it cannot)."""
    return function("tformer_gemv") is not None


def huge_page_empty(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """An uninitialised tensor in memory Linux is asked (madvise) to back with 2 MiB pages.

    Streaming a weight through 4 KiB pages costs a page walk every 4 KiB and stops the hardware prefetcher at
    each page's end; in huge pages the kernel reads GPT-2's weights faster (benchmarks/gemv_pages.py;
    BENCHMARKS.md, "Kernels"). PyTorch's allocator does this only when THP_MEM_ALLOC_ENABLE is set
    before its first allocation, so the memory is mapped here; the tensor keeps the mapping alive and
    unmaps it when freed (ordinary memory where the system grants no huge pages)."""
    nbytes = dtype.itemsize * math.prod(shape)
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_HUGEPAGE)                       # before the first touch, which allocates
    raw = torch.frombuffer(area, dtype=torch.uint8)        # holds `area` for the tensor's lifetime
    start = -raw.data_ptr() % HUGE_PAGE                     # huge pages need 2 MiB-aligned addresses
    return raw[start:start + nbytes].view(dtype).view(shape)


def pack(weight: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """(N, K) -> (ceil(N / 16), K, 16) fp32 (or bf16: the weights rounded, half the bytes): block b
    holds output features 16b .. 16b + 15 (bf16 for AVX2: in the order 0, 8, 1, 9, ..., 7, 15, which
    the kernel widens to fp32 without crossing its vectors' halves)."""
    n, k = weight.shape
    w = F.pad(weight.detach().to(dtype), (0, 0, 0, -n % BLOCK))                   # zero rows up to 16·blocks
    blocks = w.view(-1, BLOCK, k)
    if dtype == torch.bfloat16 and bf16_paired():
        blocks = blocks[:, torch.arange(BLOCK).view(2, -1).t().reshape(-1)]
    packed = huge_page_empty(w.size(0) // BLOCK, k, BLOCK, dtype=dtype)
    return packed.copy_(blocks.transpose(1, 2))


def pack8(q: Tensor, scales: Tensor) -> Tensor:
    """An int8 weight q (N, K) and its scales (N,) (quant.quantize_weight) -> one int8 tensor as the
    int8 kernel reads it (gemv_int8.c): blocks of 16 output features by groups of 4 k, then each
    output's Σ_k q (int32) and scale (fp32), 16·ceil(N / 16) of each."""
    n, k = q.shape
    if q.dtype != torch.int8 or scales.shape != (n,):
        raise ValueError(f"pack8: needs q (N, K) int8 and scales (N,), got {q.dtype} {tuple(q.shape)}, "
                         f"{tuple(scales.shape)}")
    blocks, groups = -(-n // BLOCK), -(-k // 4)
    w = F.pad(q.detach(), (0, 4 * groups - k, 0, BLOCK * blocks - n))               # zeros past N and K
    body = w.view(blocks, BLOCK, groups, 4).transpose(1, 2)                          # (blocks, G, 16, 4)
    ends = torch.zeros(2, BLOCK * blocks, dtype=torch.int32)
    ends[0, :n] = q.sum(dim=1, dtype=torch.int32)
    ends[1, :n] = scales.detach().float().view(torch.int32)
    packed = huge_page_empty(body.numel() + ends.numel() * 4, dtype=torch.int8)
    packed[:body.numel()].view(body.shape).copy_(body)
    packed[body.numel():].view(torch.int32).view(ends.shape).copy_(ends)
    return packed


def bf16_paired() -> bool:
    """Whether the built kernel reads bf16 blocks in pairs (AVX2; see pack)."""
    return (fn := function("tformer_bf16_paired")) is not None and bool(fn())


def gemv(packed: Tensor, x: Tensor, bias: Tensor | None, n: int) -> Tensor:
    """x (M, K) fp32, M >= 1 -> (M, n) = x Wᵀ + bias, W the weight `packed` was made from (fp32, or
    bf16: each product exact in fp32, only W rounded)."""
    x = x.contiguous()
    m, k = x.shape
    if m < 1 or packed.shape[1:] != (k, BLOCK) or x.dtype != torch.float32 or packed.dtype not in (
            torch.float32, torch.bfloat16):
        raise ValueError(f"gemv: x {tuple(x.shape)} {x.dtype} does not fit packed {tuple(packed.shape)}")
    bias = None if bias is None else bias.float().contiguous()                # kept alive through the call
    y = torch.empty(m, n, dtype=torch.float32)
    b = None if bias is None else bias.data_ptr()
    kernel = function("tformer_gemv" if packed.dtype == torch.float32 else "tformer_gemv_bf16")
    p, xp, yp = packed.data_ptr(), x.data_ptr(), y.data_ptr()
    for start in range(0, m, CHUNK_ROWS):                                     # rows are contiguous in x and y
        kernel(p, xp + 4 * start * k, b, yp + 4 * start * n, min(CHUNK_ROWS, m - start), n, k)
    return y


def argmax_bf16(screen: Tensor, packed: Tensor, slack: Tensor, x: Tensor, bias: Tensor | None, rounding: float,
                n: int) -> Tensor | None:
    """x (M, K) fp32, M <= PLAN_ROWS -> (M,) int64, each row's index of its largest output of x Wᵀ + bias (the
    first of equals), from `screen` (pack(w, torch.bfloat16)), `packed` (pack(w)) and the screen's error bound
    (`slack` (N,), `rounding`: linear.Gemv.argmax); None where x or the screen is not finite."""
    x, bias = x.contiguous(), None if bias is None else bias.float().contiguous()
    m, fits = x.size(0), screen.shape == packed.shape == (packed.size(0), x.size(1), BLOCK)
    if not 1 <= m <= PLAN_ROWS or x.dtype != torch.float32 or not fits or screen.dtype != torch.bfloat16:
        raise ValueError(f"argmax_bf16: x {tuple(x.shape)} {x.dtype} does not fit packed {tuple(packed.shape)}")
    rough, best = torch.empty(m, n), torch.empty(m, dtype=torch.int64)     # rough: the screen's outputs
    status = function("tformer_argmax_bf16")(screen.data_ptr(), packed.data_ptr(), slack.data_ptr(), x.data_ptr(),
                                             None if bias is None else bias.data_ptr(), rounding, m, n, x.size(1),
                                             rough.data_ptr(), best.data_ptr())
    return best if status == 0 else None


def gemv8(packed: Tensor, x: Tensor, bias: Tensor | None, n: int) -> Tensor:
    """x (M, K) fp32, M >= 1 -> (M, n) = x Wᵀ + bias, W = scales · q as pack8(q, scales) holds it: each
    row of x rounded to 7 bits on its own range, the products summed exactly in integers (gemv_int8.c)."""
    x = x.contiguous()
    m, k = x.shape
    blocks, groups = -(-n // BLOCK), -(-k // 4)
    if m < 1 or x.dtype != torch.float32 or packed.dtype != torch.int8 or packed.numel() != blocks * BLOCK * (
            4 * groups + 8):
        raise ValueError(f"gemv8: x {tuple(x.shape)} {x.dtype} does not fit an int8 weight ({n}, {k}) packed "
                         f"in {packed.numel()} {packed.dtype} elements")
    bias = None if bias is None else bias.float().contiguous()                # kept alive through the call
    y = torch.empty(m, n, dtype=torch.float32)
    scratch = torch.empty(min(m, CHUNK_ROWS) * 4 * groups, dtype=torch.uint8)   # x rounded, CHUNK_ROWS rows a time
    function("tformer_gemv_int8")(packed.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(),
                                  y.data_ptr(), m, n, k, scratch.data_ptr())
    return y


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
           lineage: Tensor | None = None) -> Tensor | None:
    """Decoding attention in one call: q (B, H, 1, hd) fp32, k and v (B / c, H_kv, T_k, hd) fp32 or both bf16
    (c beams of one source share its keys), mask bool broadcastable to (B / c', 1, 1, T_k) or None -> the
    attention output (B, 1, H·hd), heads side by side as the output projection wants them; None
    where the kernel does not take these inputs. `lineage` (B, T_k) int32 (rows contiguous; c = 1):
    position j of row b is held by row lineage[b, j] of k and v (kv_cache.KVCache)."""
    B, H, t, hd = q.shape
    Bk, H_kv, T_k = k.shape[:3]
    kernel = function("tformer_attend")
    if (t != 1 or hd % 16 or hd > MAX_HEAD or T_k > MAX_KEYS or B % Bk or H % H_kv or kernel is None
            or q.dtype != torch.float32 or k.dtype not in (torch.float32, torch.bfloat16) or v.dtype != k.dtype
            or any(x.stride(-1) != 1 for x in (q, k, v))):
        return None
    lineage_args = (None, 0)
    if lineage is not None:
        if Bk != B or lineage.shape != (B, T_k) or lineage.dtype != torch.int32 or lineage.stride(1) != 1:
            return None
        lineage_args = (lineage.data_ptr(), lineage.stride(0))
    mask_args = (None, 0, 0, 1)
    if mask is not None:
        if mask.dim() != 4 or mask.size(1) != 1 or mask.size(2) != 1 or B % mask.size(0) or mask.dtype != torch.bool:
            return None
        m = mask.expand(mask.size(0), 1, 1, T_k)
        mask_args = (m.data_ptr(), m.stride(0), m.stride(3), B // m.size(0))
    out = torch.empty(B, 1, H * hd, dtype=torch.float32)
    kernel(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(),
           k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
           *mask_args, *lineage_args, out.data_ptr(), B, H, H_kv, T_k, hd, B // Bk, int(k.dtype == torch.bfloat16),
           scale)
    return out


def attend_whole(qkv: Tensor, starts: Tensor, heads: int, kv_heads: int, head_dim: int, scale: float) -> Tensor | None:
    """Self-attention of whole texts without a mask, in one call: qkv (N, (H + 2·H_kv)·hd) fp32 or bf16 (rows
    contiguous: Q, K, V side by side as a fused projection gives them), text b its rows starts[b] ..
    starts[b + 1] - 1 (starts (B + 1,) int64), each of its tokens attending to all of them -> (N, H·hd) in
    qkv's dtype, heads side by side; None where the kernel does not take these inputs."""
    kernel = function("tformer_attend_whole")
    n = heads * head_dim + 2 * kv_heads * head_dim
    if (kernel is None or qkv.dim() != 2 or qkv.size(1) != n or qkv.stride(1) != 1 or head_dim % 16
            or head_dim > MAX_HEAD or heads % kv_heads or qkv.dtype not in (torch.float32, torch.bfloat16)
            or starts.dtype != torch.int64 or not starts.is_contiguous() or starts.numel() < 2
            or int(starts[-1]) > qkv.size(0) or int((starts[1:] - starts[:-1]).max()) > MAX_KEYS):
        return None
    out = torch.empty(qkv.size(0), heads * head_dim, dtype=qkv.dtype)
    kernel(qkv.data_ptr(), qkv.stride(0), heads * head_dim, (heads + kv_heads) * head_dim, starts.data_ptr(),
           out.data_ptr(), out.stride(0), starts.numel() - 1, heads, kv_heads, head_dim,
           int(qkv.dtype == torch.bfloat16), scale)
    return out


def attend_causal(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor | None:
    """Causal self-attention of one sequence's T new queries after the positions cached before them, in one
    call: q (T, H, hd) fp32 or bf16 (any strides, the head dimension contiguous), k and v (H_kv, L, hd) fp32 or
    both bf16, L >= T, the last T positions the queries' own -> (T, H·hd) in q's dtype, heads side by side;
    query i attends to keys 0 .. L - T + i. None where the kernel does not take these inputs."""
    kernel = function("tformer_attend_causal")
    if kernel is None or q.dim() != 3 or k.dim() != 3:
        return None
    (T, H, hd), (H_kv, L) = q.shape, k.shape[:2]
    if (k.shape != v.shape or k.size(2) != hd or L < T or T == 0 or hd % 16 or hd > MAX_HEAD or H % H_kv
            or q.dtype not in (torch.float32, torch.bfloat16) or v.dtype != k.dtype
            or k.dtype not in (torch.float32, torch.bfloat16) or any(x.stride(-1) != 1 for x in (q, k, v))):
        return None
    out = torch.empty(T, H * hd, dtype=q.dtype)
    kernel(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1),
           v.stride(0), v.stride(1), out.data_ptr(), out.stride(0), T, L - T, H, H_kv, hd,
           int(q.dtype == torch.bfloat16), int(k.dtype == torch.bfloat16), scale)
    return out


def gpt_step(table: Tensor, x: Tensor, heads: int, kv_heads: int, head_dim: int, ffn: int, max_len: int,
             pos: int, eps: float, act: int, scale: float) -> None:
    """One decoding step through every pre-LN block of a GPT in one call (gpt_step.c):
    x (M, D) fp32 contiguous, the residual stream, updated in place; `table` (L, 18) int64 the addresses
    of each layer's norms, packed weights (fp32 by pack, or int8 by pack8) and their types, biases and
    K, V caches (fused.py builds it); position `pos` of the caches is written. The caller checks that
    everything fits (fused.GPTStep)."""
    m, d = x.shape
    floats = m * (d + (heads + 2 * kv_heads) * head_dim + heads * head_dim + ffn)     # h, qkv, attention, up
    scratch = torch.empty(floats + m * (max(d, heads * head_dim, ffn) + 3) // 4 + 1, dtype=torch.float32)
    function("tformer_gpt_step")(table.data_ptr(), table.size(0), x.data_ptr(), m, d, heads, kv_heads, head_dim,
                                 ffn, max_len, pos, eps, act, scale, scratch.data_ptr())


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor] | None:
    """x (..., d) fp32, weight (d,) fp32 -> (x / rms(x) · weight, each row's 1 / rms (rows,) for the backward);
    None where the kernel does not take these inputs (it is not built, or another dtype or device)."""
    kernel = function("tformer_rmsnorm")
    if kernel is None or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu":
        return None
    x, weight, d = x.contiguous(), weight.contiguous(), x.size(-1)              # kept alive through the call
    y, r = torch.empty_like(x), torch.empty(x.numel() // max(d, 1), dtype=torch.float32)
    kernel(x.data_ptr(), weight.data_ptr(), y.data_ptr(), r.data_ptr(), r.numel(), d, eps)
    return y, r


def rms_norm_grad(x: Tensor, weight: Tensor, r: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """The gradients of rms_norm's output, g (like x), as (dL/dx like x, dL/dweight (d,)); x, weight and r as
    rms_norm took and gave them (the kernel built)."""
    x, weight, g, d = x.contiguous(), weight.contiguous(), g.contiguous().float(), x.size(-1)
    threads = max(1, min(torch.get_num_threads(), r.numel()))
    dx, parts = torch.empty_like(x), torch.zeros(threads, d, dtype=torch.float32)
    function("tformer_rmsnorm_grad")(x.data_ptr(), weight.data_ptr(), r.data_ptr(), g.data_ptr(),
                                     dx.data_ptr(), parts.data_ptr(), r.numel(), d, threads)
    return dx, parts.sum(dim=0)


def gelu_tanh(x: Tensor) -> Tensor | None:
    """GELU with tanh's approximation of x (fp32, CPU), as F.gelu(x, approximate="tanh") within a few ulps;
    None where the kernel does not take x (it is not built, or another dtype or device)."""
    kernel = function("tformer_gelu_tanh")
    if kernel is None or x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    x = x.contiguous()                                                           # kept alive through the call
    y = torch.empty_like(x)
    kernel(x.data_ptr(), y.data_ptr(), x.numel())
    return y


def gelu_tanh_grad(x: Tensor, g: Tensor) -> Tensor:
    """dL/dx of gelu_tanh(x) given dL/dy = g (like x); x as gelu_tanh took it (the kernel built)."""
    x, g = x.contiguous(), g.contiguous().float()
    dx = torch.empty_like(x)
    function("tformer_gelu_tanh_grad")(x.data_ptr(), g.data_ptr(), dx.data_ptr(), x.numel())
    return dx
