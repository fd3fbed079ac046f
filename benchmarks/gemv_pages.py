"""Does it pay to keep packed weights in 2 MiB pages? tformer's fp32 kernel (tformer.kernels.gemv) on GPT-2
small's 49 matrices (the 48 layer matrices and the tied 50,257 x 768 output layer, 0.5 GB), called
back to back as one decoding step calls them, from weights packed into ordinary 4 KiB pages and from
the same weights in huge pages (`gemv.pack`), interleaved so that both see the same machine.

    python benchmarks/gemv_pages.py [--rows 1] [--rounds 15]
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

from tformer.kernels import gemv

GPT2 = [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12 + [(50257, 768)]


def huge_kib() -> int:
    return int(Path("/proc/self/smaps_rollup").read_text().split("AnonHugePages:")[1].split()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1, help="rows per product (batch size; default 1)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    args = ap.parse_args()
    if not gemv.available():
        raise SystemExit(f"error: the kernel is not built here ({gemv.unsupported() or 'run make'})")
    torch.manual_seed(0)
    before = huge_kib()
    huge = [gemv.pack(torch.randn(n, k)) for n, k in GPT2]
    print(f"packed weights: {sum(p.numel() for p in huge) * 4 / 2**20:.0f} MiB; the process's huge pages "
          f"grew by {(huge_kib() - before) / 1024:.0f} MiB")
    small = [torch.empty(p.shape).copy_(p) for p in huge]                      # same values, 4 KiB pages
    xs = {k: torch.randn(args.rows, k) for k in (768, 3072)}
    nbytes = sum(p.numel() * 4 for p in huge)
    rates = {"4 KiB pages": [], "2 MiB pages": []}
    for _ in range(args.rounds):
        for name, weights in zip(rates, (small, huge)):
            t = time.perf_counter()
            for p, (n, k) in zip(weights, GPT2):
                gemv.gemv(p, xs[k], None, n)
            rates[name].append(nbytes / (time.perf_counter() - t) / 1e9)
    for name, r in rates.items():
        print(f"{name}: median {statistics.median(r):.1f} GB/s (range {min(r):.1f}-{max(r):.1f}), "
              f"rows {args.rows}, {args.rounds} rounds")


if __name__ == "__main__":
    main()
