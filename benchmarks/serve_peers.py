"""`tformer serve` side by side with llama.cpp's server and `transformers serve` (issue 48): same
weights, same precision (fp32), same machine, 16 clients (a benchmark, not a test).

    make llama-server                                   # llama.cpp's server, built from llama-cpp-python's
                                                        # source package (~10 minutes on 2 cores, once)
    .venv/bin/python benchmarks/serve_peers.py [--rounds 3] [--requests 48] [--max-tokens 64] [--json out.json]

The model: a Llama-shaped decoder of GPT-2-small's size (12 layers, width 768, 12 heads, SwiGLU 2,048,
rotary positions, untied output layer) with random weights, and a byte-level BPE tokenizer of 8,000
pieces trained on the shipped Hamlet. It is written three ways from the same tensors: tformer's
checkpoint, a GGUF file (`tformer.to_gguf`, F32) and a Hugging Face directory (`tformer.to_hf`,
LlamaForCausalLM); with `--dtype bf16` the tensors are rounded to bf16 once and all three store those (GGUF
BF16), and every engine multiplies in bf16. Each engine runs in its own process on 127.0.0.1 with its
documented settings for concurrent serving:

    tformer       tformer serve --max-batch 16 --dtype fp32|bf16
    llama.cpp     llama-server --parallel 16 --ctx-size 16384 (1,024 per slot, continuous batching is its
                  default) --threads N --threads-batch N (N = the cores); its KV cache is f16 unless
                  --llama-args '--cache-type-k f32 --cache-type-v f32' (tformer's: fp32, the model's dtype)
    transformers  transformers serve --continuous-batching --device cpu --dtype float32|bfloat16

The load: `--requests` prompts of 16-256 words of Hamlet (seeded; the same text for every engine),
streamed `/v1/completions`, greedy, `--max-tokens` new tokens each (llama.cpp: `ignore_eos`; the model
has no EOS in tformer's and HF's config, so none stops early), by 16 concurrent clients on one asyncio
event loop (aiohttp, as vLLM's benchmark_serving.py; before 2026-12-07 evening, 16 httpx threads, which took
~9x the CPU: BENCHMARKS.md, "Side by side"). Per engine:
aggregate generated tokens/s (completion tokens from the stream's usage, else the stream's chunks) and
time to first token (p50). Rounds alternate the engines, each round starting with the next (tformer,
llama.cpp, transformers; llama.cpp, transformers, tformer; ...), so load from other processes hits all alike
and none always runs right after the same one; printed: each round's figures and the ratios
tformer / peer per round, with their median and range.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parent.parent
LLAMA_SERVER = ROOT / ".venv" / "llama-server" / "llama-server"
CLIENTS = 16
HF_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}   # --dtype -> transformers serve --dtype
SHAPE = dict(n_layers=12, d_model=768, n_heads=12, d_ff=2048, positional="rope", norm="rmsnorm",
             activation="swiglu", bias=False, tie_embeddings=False, max_seq_len=1024, dropout=0.0, attn_dropout=0.0)


def build(work: Path, dtype: str = "fp32") -> dict[str, Path]:
    """The same random model as a tformer checkpoint, a GGUF file and a Hugging Face directory, in fp32 or
    rounded to bf16 (the same bf16 tensors in all three)."""
    import torch

    import tformer
    from tformer.data.files import read_text
    from tformer.data.tokenizers import Tokenizer
    from tformer.model.config import ModelConfig
    from tformer.model.models import Decoder

    text = read_text("hamlet")
    tokenizer = Tokenizer.train_bpe(text, 8000)
    torch.manual_seed(0)
    cfg = ModelConfig(kind="decoder", vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_id,
                      bos_token_id=tokenizer.bos_id, eos_token_id=None, **SHAPE)
    model = Decoder(cfg).eval()
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    paths = {"tformer": tformer.save(model, work / "tformer", tokenizer=tokenizer),
             "gguf": tformer.to_gguf(model, work / "model.gguf", tokenizer=tokenizer,
                                      type="bf16" if dtype == "bf16" else "f32"),
             "hf": tformer.to_hf(model, work / "hf", tokenizer=tokenizer)}
    words = text.split()
    rng = random.Random(0)
    prompts = []
    for _ in range(256):
        n, start = rng.randint(16, 256), rng.randrange(len(words) - 300)
        prompts.append(" ".join(words[start:start + n]))
    (work / "prompts.json").write_text(json.dumps(prompts))
    return paths


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(engine: str, work: Path, log, extra: list[str] = (), dtype: str = "fp32") -> tuple[subprocess.Popen, str]:
    port = free_port()
    cores = str(os.cpu_count())
    if engine == "tformer":
        cmd = [sys.executable, "-m", "tformer", "serve", "--model", str(work / "tformer"), "--port", str(port),
               "--max-batch", str(CLIENTS), "--max-queue", "1024", "--name", "model", "--dtype", dtype, *extra]
    elif engine == "llama.cpp":
        cmd = [str(LLAMA_SERVER), "-m", str(work / "model.gguf"), "--host", "127.0.0.1", "--port", str(port),
               "--parallel", str(CLIENTS), "--ctx-size", str(CLIENTS * SHAPE["max_seq_len"]),
               "--threads", cores, "--threads-batch", cores, "--alias", "model", *extra]
    else:
        cmd = [str(Path(sys.executable).parent / "transformers"), "serve", str(work / "hf"), "--host", "127.0.0.1",
               "--port", str(port), "--continuous-batching", "--device", "cpu", "--dtype", HF_DTYPES[dtype],
               "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TFORMER_API_KEY": ""})
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{engine} exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"{engine} did not start in 300 s; see {log.name}")


async def stream(session, base: str, engine: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if engine == "llama.cpp":
        body["ignore_eos"] = True
    out = {"start": time.perf_counter(), "first": None, "chunks": 0, "tokens": None, "error": None}
    try:
        async with session.post(f"{base}/v1/completions", json=body) as r:
            if r.status != 200:
                out["error"] = f"HTTP {r.status}: {(await r.read())[:300]!r}"
                return out
            async for line in r.content:                    # the stream's lines, as they arrive
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    out["first"] = out["first"] or time.perf_counter()
                    out["chunks"] += 1
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"].get("completion_tokens")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["end"] = time.perf_counter()
    return out


async def load(base: str, engine: str, model: str, prompts: list[str], max_tokens: int) -> dict:
    """CLIENTS concurrent streams on one event loop (as vLLM's benchmark_serving.py: aiohttp): the load
    generator shares the machine's cores with the server, so it must cost little (16 httpx threads took
    ~15% of a core on this load, which a server's threads then waited for; this client, ~1.5%)."""
    results, queue = [], list(prompts)       # force_close: a connection per request (llama-server drops idle ones)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900),
                                     connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        await stream(session, base, engine, model, prompts[0], 4)          # warm-up
        cpu0, t0 = time.process_time(), time.perf_counter()

        async def client():
            while queue:
                results.append(await stream(session, base, engine, model, queue.pop(0), max_tokens))

        await asyncio.gather(*(client() for _ in range(CLIENTS)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    ok = [r for r in results if r["error"] is None]
    tokens = sum(r["tokens"] if r["tokens"] is not None else r["chunks"] for r in ok)
    ttft = sorted(r["first"] - r["start"] for r in ok if r["first"])
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "client_cpu_s": cpu,
            "ttft_p50_s": statistics.median(ttft) if ttft else float("nan"),
            "errors": [r["error"] for r in results if r["error"]][:3], "n_errors": len(results) - len(ok)}


def model_name(base: str) -> str:
    return httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]


def cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--engines", default="tformer,llama.cpp,transformers")
    p.add_argument("--tformer-args", default="", help="more `tformer serve` flags, e.g. '--prefill-tokens 256'")
    p.add_argument("--llama-args", default="", help="more `llama-server` flags, e.g. '--cache-type-k f32 "
                   "--cache-type-v f32' (its KV cache is f16 by default; tformer's is the model's dtype)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="the weights every engine serves and multiplies: fp32, or bf16 (tformer serve --dtype bf16, "
                        "a bf16 GGUF, transformers serve --dtype bfloat16)")
    p.add_argument("--json", default=None)
    opts = p.parse_args()
    engines = opts.engines.split(",")
    if "llama.cpp" in engines and not LLAMA_SERVER.exists():
        raise SystemExit(f"{LLAMA_SERVER} is missing: run `make llama-server` first (or --engines without llama.cpp)")
    work = Path(tempfile.mkdtemp(prefix="serve-peers-"))
    try:
        build(work, opts.dtype)
        prompts = json.loads((work / "prompts.json").read_text())[:opts.requests]
        print(f"CPU: {cpu()}, {os.cpu_count()} cores; {opts.dtype}; {len(prompts)} requests x {opts.max_tokens} "
              f"tokens, {CLIENTS} clients; work in {work}", flush=True)
        rounds = []
        for k in range(opts.rounds):
            row = {}
            for engine in engines[k % len(engines):] + engines[:k % len(engines)]:     # each round starts with the next
                with open(work / f"{engine}.log", "a") as log:
                    extra = {"tformer": opts.tformer_args, "llama.cpp": opts.llama_args}.get(engine, "")
                    proc, base = start(engine, work, log, extra.split(), opts.dtype)
                    try:
                        row[engine] = asyncio.run(load(base, engine, model_name(base), prompts, opts.max_tokens))
                    finally:
                        proc.terminate()
                        try:
                            proc.wait(30)
                        except subprocess.TimeoutExpired:
                            proc.kill()
                r = row[engine]
                print(f"round {k + 1} {engine:12s} {r['tokens_per_s']:7.1f} tokens/s  TTFT p50 "
                      f"{r['ttft_p50_s'] * 1e3:7.0f} ms  {r['tokens']} tokens  client CPU {r['client_cpu_s']:.2f} s  "
                      f"errors {r['n_errors']} "
                      f"{r['errors'][:1]}", flush=True)
            rounds.append(row)
        summary = {}
        for peer in [e for e in engines if e != "tformer"] if "tformer" in engines else []:
            speed = [r["tformer"]["tokens_per_s"] / r[peer]["tokens_per_s"] for r in rounds]
            ttft = [r["tformer"]["ttft_p50_s"] / r[peer]["ttft_p50_s"] for r in rounds]
            summary[peer] = {"throughput_ratio": speed, "ttft_ratio": ttft}
            print(f"tformer / {peer}: tokens/s {statistics.median(speed):.2f}x ({min(speed):.2f}-{max(speed):.2f}), "
                  f"TTFT p50 {statistics.median(ttft):.2f}x ({min(ttft):.2f}-{max(ttft):.2f}) (below 1: tformer's "
                  f"first token sooner)")
        if opts.json:
            Path(opts.json).write_text(json.dumps({"cpu": cpu(), "dtype": opts.dtype, "rounds": rounds,
                                                   "summary": summary}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
