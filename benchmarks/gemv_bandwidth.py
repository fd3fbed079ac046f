"""How fast the CPU kernels for decoding-sized products read weights, against a plain sum of memory.

Decoding one token multiplies a few rows (batch 1 or 8) by every weight matrix once, so its speed
is the kernel's read speed. Part 1 times the 48 layer matrices of GPT-2 small (cold: 340 MB in
fp32, larger than the caches) three ways: F.linear (PyTorch's default: MKL / oneDNN unpacked),
tformer's split product and its oneDNN-packed weights (tformer.model.linear). Part 2 times one small
model's matrices per call, which sets where splitting and packing start to pay (SPLIT_MIN,
PACK_MIN in tformer/linear.py). Run: python benchmarks/gemv_bandwidth.py
"""

import time

import torch
import torch.nn.functional as F

from tformer.model.linear import Packed, Split

GPT2 = [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12   # qkv, out, up, down per layer


def timed(fn, repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def kernels(weights: list[torch.Tensor], rows: int) -> dict:
    """name -> function(x, w) for each way of multiplying; the plans are made here, once."""
    packed = {id(w): Packed(w, rows) for w in weights}
    ways = {"F.linear": F.linear,
            "packed (oneDNN)": lambda x, w: packed[id(w)](x, None)}
    if weights[0].dtype == torch.float32 and torch.get_num_threads() > 1:
        split = {id(w): Split(w, rows) for w in weights}
        ways["split (bmm)"] = lambda x, w: split[id(w)](x, None)
    return ways


def main() -> None:
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads")
    big = torch.randn(256 * 2**20 // 4)
    print(f"sum of 256 MiB: {big.numel() * 4 / timed(lambda: big.sum(), 5) / 1e9:.1f} GB/s")
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            weights = [torch.randn(o, i, dtype=dtype) for o, i in GPT2]
            nbytes = sum(w.numel() * w.element_size() for w in weights)
            for rows in (1, 8):
                x = {n: torch.randn(rows, n, dtype=dtype) for n in (768, 3072)}
                for name, fn in kernels(weights, rows).items():
                    s = timed(lambda: [fn(x[w.size(1)], w) for w in weights])
                    print(f"GPT-2 {str(dtype)[6:]:9} batch {rows}  {name:16} {s * 1e3:6.1f} ms  "
                          f"{nbytes / s / 1e9:5.1f} GB/s")
        for d in (128, 256, 512):
            weights = [torch.randn(o, i) for o, i in [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * 4]
            x = {n: torch.randn(1, n) for n in (d, 4 * d)}
            per_call = {name: timed(lambda: [fn(x[w.size(1)], w) for w in weights], 100) / len(weights) * 1e6
                        for name, fn in kernels(weights, 1).items()}
            print(f"4 layers of width {d} fp32 batch 1, µs per matrix: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in per_call.items()))


if __name__ == "__main__":
    main()
