"""Decoding attention: tformer's kernel (gemv.attend) against PyTorch's paths, at the shapes a
decoding step has. Marian's beam search (16 sentences x 4 beams = 64 rows, 8 heads of 64): self-
attention over a cache slice, cross-attention with 4 beams per source; GPT-2 at batch 1 and 8 (12
heads). Each path returns what the output projection reads, (B, 1, H·hd), and is checked against
the formula first; medians of 5 timings of 200 calls each, µs per call.

    python benchmarks/decode_attention.py
"""

import statistics
import time

import torch
import torch.nn.functional as F

from tformer.kernels import gemv
from tformer.model.attention import fold_copies, unfold_copies, unfused_attention

CASES = [  # name, rows, heads, keys, beams per source, cache length (None: cross-attention's K, V)
    ("Marian self-attention, 20 keys", 64, 8, 20, 1, 40),
    ("Marian cross-attention, 30 keys", 64, 8, 30, 4, None),
    ("GPT-2 b1, 100 keys", 1, 12, 100, 1, 160),
    ("GPT-2 b8, 100 keys", 8, 12, 100, 1, 160),
]


def per_call_us(fn, n: int = 200) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(times)


def main() -> None:
    if not gemv.available():
        raise SystemExit(f"error: the kernel is not built here ({gemv.unsupported() or 'run make'})")
    torch.manual_seed(0)
    hd = 64
    for name, B, H, t, copies, cache_len in CASES:
        q = torch.randn(B, 1, 3 * H * hd)[..., :H * hd].view(B, 1, H, hd).transpose(1, 2)   # as split from QKV
        if cache_len:
            k, v = (torch.randn(B // copies, H, cache_len, hd)[:, :, :t] for _ in range(2))
        else:
            kv = torch.randn(B // copies, t, 2 * H * hd)
            k, v = (x.view(B // copies, t, H, hd).transpose(1, 2) for x in kv.chunk(2, dim=-1))
        mask = torch.rand(B // copies, 1, 1, t) > 0.2
        mask[..., 0] = True

        def heads_side_by_side(out):
            return unfold_copies(out, copies).transpose(1, 2).reshape(B, 1, H * hd)

        paths = {
            "unfused (baddbmm)": lambda: heads_side_by_side(unfused_attention(fold_copies(q, copies), k, v, mask)),
            "SDPA": lambda: heads_side_by_side(F.scaled_dot_product_attention(fold_copies(q, copies), k, v,
                                                                               attn_mask=mask)),
            "gemv.attend": lambda: gemv.attend(q, k, v, mask, hd ** -0.5),
        }
        reference = paths["unfused (baddbmm)"]()
        for fn in paths.values():
            torch.testing.assert_close(fn(), reference, atol=1e-5, rtol=1e-5)
        print(f"{name:34s}" + "  ".join(f"{p} {per_call_us(fn):7.1f} µs" for p, fn in paths.items()), flush=True)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
