"""Load test of `tformer serve` on loopback (a benchmark, not a test).

    .venv/bin/python benchmarks/serve_load.py                       # 16 clients, 64 requests, then one at a time
    .venv/bin/python benchmarks/serve_load.py --soak 600 --soak-only  # 10 minutes at 16 clients: server memory
    .venv/bin/python benchmarks/serve_load.py --device cuda         # the server's model on a GPU
    .venv/bin/python benchmarks/serve_load.py --min-prompt 50 --max-prompt 1000 --requests 32 --sequential 0
                                                                    # issue 48's mix: inter-token p50 / p99

A random GPT-2-small-shaped decoder (124M parameters, fp32) with a word-level tokenizer of the
same vocabulary (every token is one word, so a prompt of N words is N tokens and every generated
token streams as one chunk) is saved to a temporary directory and served by `tformer serve` in a
subprocess on 127.0.0.1. 64 requests with prompts of 16-256 tokens (seeded) and 128 new tokens
(greedy, no EOS; fewer where the prompt leaves less of the 1,024-token context) are streamed by 16
concurrent clients, then the same requests one at a time. Printed: aggregate generated tokens/s,
time to first token and inter-token latency (p50/p99, measured by the clients on the stream),
errors, the concurrent/sequential throughput ratio, and the server's KV-cache bytes (its
tformer_kv_cache_bytes gauge, sampled: the running rows' pool, peak and mean, against the fixed
--max-batch x context reservation of a pool that does not grow).
`--soak S` then keeps 16 clients busy for S seconds and samples the server's resident memory.
Everything is bounded: --requests, --time-limit per phase, --soak.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

import tformer
from tformer import preset
from tformer.data.tokenizers import Tokenizer


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """A WordLevel tokenizer of `vocab_size` words ("w3", "w4", ...) after <pad> <bos> <eos>."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.decoder = decoders.WordPiece(prefix="##")      # joins words with spaces
    return Tokenizer(hf)


def build(directory: Path) -> Path:
    cfg = preset("gpt2-small", eos_token_id=None)
    model = tformer.Decoder(cfg).eval()
    return tformer.save(model, directory / "gpt2-small-random", tokenizer=word_tokenizer(cfg.vocab_size))


def start_server(path: Path, max_batch: int, device: str | None, extra=()) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "tformer", "serve", "--model", str(path), "--port", "0", "--max-batch",
           str(max_batch), "--max-queue", "1024", *(["--device", device] if device else []), *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "TFORMER_API_KEY": ""})
    line = proc.stderr.readline()
    match = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)
    if not match:
        proc.kill()
        raise SystemExit(f"the server did not start: {line}{proc.stderr.read()}")
    threading.Thread(target=proc.stderr.read, daemon=True).start()     # keep its stderr pipe drained
    return proc, match.group(1)


class Result:
    def __init__(self):
        self.start = self.first = None
        self.times: list[float] = []
        self.tokens = 0
        self.text = ""
        self.error: str | None = None


def one_request(base: str, prompt: str, max_tokens: int, model: str = "gpt2-small-random") -> Result:
    """Stream one greedy completion; record when each chunk (one token) arrives."""
    res = Result()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    res.start = time.perf_counter()
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                return res
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                elif chunk["choices"]:
                    res.times.append(time.perf_counter())
                    res.text += chunk["choices"][0]["text"]
                elif chunk.get("usage"):
                    res.tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    if res.error is None and res.tokens != max_tokens:
        res.error = f"{res.tokens} tokens instead of {max_tokens}"
    return res


def run_phase(base: str, prompts: list[str], max_tokens: list[int], clients: int,
              time_limit: float) -> tuple[list, float]:
    """`clients` threads take the requests in order (prompt i asks for max_tokens[i]); none starts after
    time_limit seconds."""
    results, lock, queue = [], threading.Lock(), list(enumerate(prompts))
    t0 = time.perf_counter()

    def worker():
        while time.perf_counter() - t0 < time_limit:
            with lock:
                if not queue:
                    return
                i, prompt = queue.pop(0)
            r = one_request(base, prompt, max_tokens[i])
            with lock:
                results.append(r)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else \
        (values[0] if values else float("nan"))


def report(name: str, results: list[Result], wall: float) -> float:
    ok = [r for r in results if r.error is None]
    tokens = sum(r.tokens for r in ok)
    ttft = [r.times[0] - r.start for r in ok if r.times]
    itl = [b - a for r in ok for a, b in zip(r.times, r.times[1:])]
    rate = tokens / wall
    print(f"{name}: {len(results)} requests in {wall:.1f} s, {tokens} tokens generated, {rate:.1f} tokens/s, "
          f"errors {len(results) - len(ok)}")
    if ttft:
        print(f"  time to first token  p50 {percentile(ttft, 50) * 1e3:8.0f} ms   "
              f"p99 {percentile(ttft, 99) * 1e3:8.0f} ms")
    if itl:
        print(f"  inter-token latency  p50 {percentile(itl, 50) * 1e3:8.1f} ms   "
              f"p99 {percentile(itl, 99) * 1e3:8.1f} ms")
    for r in results:
        if r.error:
            print(f"  error: {r.error}")
    return rate


class KVWatch:
    """Samples the server's tformer_kv_cache_bytes gauge (each part) every 0.2 s while a phase runs."""

    def __init__(self, base: str):
        self.base, self.samples, self.stop = base, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.wait(0.2):
            try:
                text = httpx.get(f"{self.base}/metrics", timeout=10).text
            except httpx.HTTPError:
                continue
            self.samples.append({m.group(1): float(m.group(2)) for m in
                                 re.finditer(r'^tformer_kv_cache_bytes\{part="(\w+)"\} (\S+)$', text, re.M)})

    def report(self, reservation: float) -> None:
        running = [s["running"] for s in self.samples if "running" in s]
        if not running:
            print("  KV cache: the server reports no tformer_kv_cache_bytes")
            return
        peak = max(sum(s.values()) for s in self.samples)
        print(f"  KV cache, running rows' pool: peak {max(running) / 2**20:.0f} MiB, mean "
              f"{statistics.mean(running) / 2**20:.0f} MiB = {max(running) / reservation:.1%} / "
              f"{statistics.mean(running) / reservation:.1%} of the fixed reservation ({reservation / 2**20:.0f} MiB); "
              f"all parts (+ prefill, prefix cache) peak {peak / 2**20:.0f} MiB")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def soak(base: str, pid: int, prompts: list[str], max_tokens: list[int], clients: int, seconds: float,
         warmup: float) -> None:
    """`clients` clients send requests back to back for `seconds`; the server's RSS is sampled."""
    stop, errors, done, samples = time.perf_counter() + seconds, [], [0], []

    def worker(k: int):
        i = k
        while time.perf_counter() < stop:
            r = one_request(base, prompts[i % len(prompts)], max_tokens[i % len(prompts)])
            i += clients
            done[0] += 1
            if r.error:
                errors.append(r.error)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        samples.append((time.perf_counter() - t0, rss_mib(pid)))
        time.sleep(5)
    for t in threads:
        t.join()
    after = [m for t, m in samples if t >= warmup]
    base_rss, last, peak = after[0], after[-1], max(after)
    print(f"soak: {seconds:.0f} s at {clients} clients, {done[0]} requests, errors {len(errors)}; server RSS "
          f"{samples[0][1]:.0f} MiB at start, {base_rss:.0f} MiB after {warmup:.0f} s warm-up, {last:.0f} MiB at the "
          f"end (growth {100 * (last - base_rss) / base_rss:+.1f}%, peak {peak:.0f} MiB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--time-limit", type=float, default=1200, help="seconds per phase before no new request starts")
    ap.add_argument("--sequential", type=int, default=None, help="requests served one at a time (default: all; "
                    "0: none)")
    ap.add_argument("--prefill-tokens", default=None, help="the server's --prefill-tokens (default: its own)")
    ap.add_argument("--prefix-cache-mb", default=None, help="the server's --prefix-cache-mb (default: its own)")
    ap.add_argument("--soak", type=float, default=0, help="then seconds of continuous load, watching memory")
    ap.add_argument("--warmup", type=float, default=60, help="soak seconds before the memory baseline")
    ap.add_argument("--soak-only", action="store_true", help="skip the concurrent and one-at-a-time phases")
    ap.add_argument("--device", default=None, help="the server's --device (default: the CPU)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min_prompt, args.max_prompt) for _ in range(args.requests)]
    prompts = [" ".join(f"w{rng.randrange(3, 50257)}" for _ in range(n)) for n in lengths]
    context = preset("gpt2-small").max_seq_len
    max_tokens = [min(args.max_tokens, context - n) for n in lengths]
    flags = (("--prefill-tokens", args.prefill_tokens), ("--prefix-cache-mb", args.prefix_cache_mb))
    extra = [f for flag, value in flags if value is not None for f in (flag, value)]
    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp))
        proc, base = start_server(path, args.max_batch, args.device, extra)
        try:
            print(f"server: {base}, GPT-2-small shape (random weights, fp32), --max-batch {args.max_batch}, "
                  f"torch threads {os.cpu_count()} cores; prompts {args.min_prompt}-{args.max_prompt} tokens, "
                  f"up to {args.max_tokens} new tokens each; server flags {' '.join(extra) or '(defaults)'}")
            one_request(base, prompts[0], 4)                                   # warm-up
            if not args.soak_only:
                watch = KVWatch(base)
                watch.thread.start()
                results, wall = run_phase(base, prompts, max_tokens, args.clients, args.time_limit)
                watch.stop.set()
                concurrent = report(f"{args.clients} concurrent clients", results, wall)
                cfg = preset("gpt2-small")                          # fp32 K and V of every layer, per position
                watch.report(2 * cfg.n_layers * args.max_batch * cfg.d_model * context * 4)
                n_seq = len(prompts) if args.sequential is None else args.sequential
                if n_seq:
                    results, wall = run_phase(base, prompts[:n_seq], max_tokens, 1, args.time_limit)
                    sequential = report("one at a time", results, wall)
                    print(f"throughput ratio, concurrent / one at a time: {concurrent / sequential:.1f}x")
            if args.soak:
                soak(base, proc.pid, prompts, max_tokens, args.clients, args.soak, args.warmup)
        finally:
            proc.terminate()
            proc.wait(120)


if __name__ == "__main__":
    main()
