"""Decode speed with and without the KV cache (a benchmark, not a test).

    .venv/bin/python benchmarks/bench_cache.py [--device cpu|cuda] [--new 128] [--repeats 3]

Without a cache every step runs the whole sequence so far through the model (O(T^2) work over a
generation); with it, step n runs one token and reads the cached keys/values of the n before it.
Both runs produce the same greedy tokens (checked). Figures are medians of interleaved runs, so a
burst of load from other processes hits both alike; compare the ratio, not absolute numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tformer


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--new", type=int, default=128, help="new tokens per generation")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    torch.manual_seed(0)
    cfg = tformer.preset("small", vocab_size=2048, max_seq_len=args.prompt + args.new)
    model = tformer.Decoder(cfg).to(args.device).eval()
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt), device=args.device)

    def run(use_cache: bool, n: int = args.new):
        return model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=[], use_cache=use_cache)

    same = torch.equal(run(True), run(False))                                # also the warm-up
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):
        for use_cache in (True, False):
            times[use_cache].append(timed(lambda: run(use_cache), args.device))
    rate = {k: args.batch * args.new / statistics.median(v) for k, v in times.items()}
    print(f"model: preset small (4 layers, d_model 256, vocab 2048), {args.device}, batch {args.batch}, "
          f"prompt {args.prompt} + {args.new} new tokens, greedy, median of {args.repeats}")
    print(f"with cache     {rate[True]:10.1f} tokens/s")
    print(f"without cache  {rate[False]:10.1f} tokens/s")
    print(f"speed-up       {rate[True] / rate[False]:10.2f}x   (same tokens: {same})")


if __name__ == "__main__":
    main()
