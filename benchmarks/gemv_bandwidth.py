"""How fast PyTorch's CPU matrix-vector products read weights, against a plain sum of memory.

Decoding one token at batch 1 multiplies a vector by every weight matrix once, so its speed is
the GEMV kernel's read speed. This times the 48 layer matrices of GPT-2 small (cold: 340 MB in
fp32, larger than the caches) in both layouts, and batch 8 against batch 1 (BENCHMARKS.md,
"Reading the tables"). Run: python benchmarks/gemv_bandwidth.py
"""

import time

import torch
import torch.nn.functional as F

SHAPES = [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12   # qkv, out, up, down per layer


def timed(fn, repeats: int = 10) -> float:
    for _ in range(2):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    torch.manual_seed(0)
    big = torch.randn(256 * 2**20 // 4)
    print(f"sum of 256 MiB: {big.numel() * 4 / timed(lambda: big.sum(), 5) / 1e9:.1f} GB/s")
    for dtype in (torch.float32, torch.bfloat16):
        rows = [torch.randn(o, i, dtype=dtype) for o, i in SHAPES]
        cols = [w.t().contiguous().t() for w in rows]                    # same values, column-major
        nbytes = sum(w.numel() * w.element_size() for w in rows)
        for batch in (1, 8):
            x = {n: torch.randn(batch, n, dtype=dtype) for n in (768, 3072)}
            for name, ws in (("row-major", rows), ("column-major", cols)):
                s = timed(lambda: [F.linear(x[w.size(1)], w) for w in ws])
                print(f"{str(dtype)[6:]:9} batch {batch}  {name:13} {s * 1e3:6.1f} ms  {nbytes / s / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
