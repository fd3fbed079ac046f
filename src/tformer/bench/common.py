"""Shared pieces of the benchmarks: timing, the machine's ceilings, and building both peers from
the same Hugging Face weights.

Method (DESIGN.md §5): every figure is a ratio of two peers timed side by side, interleaved, on the
same weights, after warm-up, as the median of several repeats; the machine's own limits (GEMM
GFLOP/s, memory read GB/s) are measured in the same run so utilisation is comparable too. A peer
engine with a runtime of its own (CTranslate2) runs in a process of its own (PeerProcess).
"""

from __future__ import annotations

import multiprocessing
import os
import platform
import statistics
import tempfile
import time
from typing import Callable

import torch

from ..kernels.build import status
from ..model.linear import Packed, packs


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_time(fn: Callable[[], object], device: str, repeats: int = 5, warmup: int = 1,
                min_time: float = 0.0) -> float:
    """Median wall time of fn() in seconds, after `warmup` untimed calls. With `min_time`, keeps
    repeating (at least `repeats` times) until that much time was spent, so fast calls get a
    stable median too."""
    for _ in range(warmup):
        fn()
    sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_times(fns: dict[str, Callable[[], object]], device: str, repeats: int = 3,
                      warmup: int = 1) -> dict[str, float]:
    """Median time of each fn, with the peers' runs interleaved (a, b, a, b, ...) so that a burst of
    load from other processes hits both peers alike."""
    return {name: statistics.median(t) for name, t in interleaved_samples(fns, device, repeats, warmup).items()}


def interleaved_samples(fns: dict[str, Callable[[], object]], device: str, repeats: int = 3,
                        warmup: int = 1) -> dict[str, list[float]]:
    """Every time of interleaved_times, in the order run: repeat i of each fn is entry i of its list."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


class PeerProcess:
    """A peer engine loaded and run in a child process, called like a function from the parent, so
    its calls still interleave with tformer's (interleaved_times) without sharing a process with it.

    Why: imported after torch, CTranslate2's OpenMP calls bind to torch's libgomp, whose two thread pools
    then outnumber the cores and stop spinning: both engines are slower in that process (BENCHMARKS.md,
    "In one process: the shared OpenMP runtime"); one process would measure the co-tenancy, not the
    engines. `factory(*args)` runs in the child and returns the function each call runs there; arguments
    and results travel by pipe."""

    def __init__(self, factory: Callable[..., Callable], *args):
        ctx = multiprocessing.get_context("spawn")        # a fresh interpreter: no torch state inherited
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve_peer, args=(child, factory, args), daemon=True)
        self._process.start()
        child.close()
        try:
            self._receive()                               # loaded (or the child's error)
        except RuntimeError:
            self.close()
            raise

    def __call__(self, *args):
        self._conn.send(args)
        return self._receive()

    def _receive(self):
        try:
            ok, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"peer process exited (code {self._process.exitcode})") from None
        if not ok:
            raise RuntimeError(f"peer process: {value}")
        return value

    def close(self) -> None:
        if self._process.is_alive():
            self._conn.send(None)
            self._process.join(timeout=60)
        self._conn.close()

    def __enter__(self) -> "PeerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serve_peer(conn, factory: Callable[..., Callable], args: tuple) -> None:
    """The child's side of PeerProcess: build the function, then run it for each call until None."""
    try:
        fn = factory(*args)
        conn.send((True, None))
    except Exception as e:                                 # reported to the parent, which raises it
        conn.send((False, f"{type(e).__name__}: {e}"))
        return
    while (call := conn.recv()) is not None:
        try:
            conn.send((True, fn(*call)))
        except Exception as e:
            conn.send((False, f"{type(e).__name__}: {e}"))


def machine_info(device: str) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": device,
            "cpu": _cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "kernel": status()}     # tformer's C kernels in use, or why not: `tformer info`'s line
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# --- ceilings ------------------------------------------------------------------------------------

def gemm_gflops(m: int, k: int, n: int, dtype: torch.dtype, device: str, min_time: float = 0.3) -> float:
    """Measured GFLOP/s of one (m, k) @ (k, n) product: the faster of torch.matmul and, on a CPU, oneDNN's
    product on packed weights (the one tformer's plans use: on a Zen 5 MKL's torch.matmul in fp32 ran at
    ~205 GFLOP/s and oneDNN's at ~480, so a ceiling of torch.matmul alone was half the machine's)."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    products = [lambda: torch.matmul(a, b)]
    if device == "cpu" and packs(dtype):
        packed = Packed(b.t().contiguous(), m)
        products.append(lambda: packed(a, None))
    seconds = min(median_time(f, device, repeats=3, warmup=2, min_time=min_time) for f in products)
    return 2 * m * k * n / seconds / 1e9


class ReadProbe:
    """Memory read bandwidth sampled alongside a benchmark: timed as one more peer in its
    interleaved runs, so a roofline uses what memory delivered at that moment (on a shared machine
    it can change by half between the start of the bench and the decode runs)."""

    def __init__(self, device: str, mbytes: int = 1024, sums: int = 3):
        self.x, self.sums = torch.ones(mbytes * 2**20 // 4, device=device), sums

    def __call__(self) -> None:
        for _ in range(self.sums):
            self.x.sum()

    def gbps(self, seconds: float) -> float:
        return self.sums * self.x.numel() * 4 / seconds / 1e9


def share_of_reads_around(seconds: list[float], nbytes: float, before: list[float], after: list[float]) -> float:
    """Median over runs i of the bytes/s run i read (`nbytes` in seconds[i]) as a share of the read
    rate sampled right before and right after it (GB/s, averaged): a roofline of the same moment."""
    return statistics.median(nbytes / t / 1e9 / ((b + a) / 2) for t, b, a in zip(seconds, before, after, strict=True))


def read_bandwidth(device: str, mbytes: int = 512, min_time: float = 0.3) -> float:
    """Measured memory read GB/s: summing a tensor far larger than the caches reads every byte once."""
    probe = ReadProbe(device, mbytes, sums=1)
    return probe.gbps(median_time(probe, device, repeats=3, warmup=1, min_time=min_time))


def measure_ceilings(device: str, quick: bool) -> dict:
    """GEMM peaks at the shapes the benchmarks run (a training-step GEMM and a square one), fp32 and
    bf16, and memory read bandwidth."""
    size = 512 if quick else 1024
    t = 0.1 if quick else 0.3
    out = {"read_GBps": read_bandwidth(device, 256 if quick else 1024, t)}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        square = gemm_gflops(size, size, size, dtype, device, t)
        train = gemm_gflops(4096 if not quick else 1024, 384, 1536, dtype, device, t)
        out[f"gemm_{name}_GFLOPs"] = max(square, train)
    return out


# --- peers from the same weights ----------------------------------------------------------------

def from_hf_model(hf_model) -> torch.nn.Module:
    """The tformer model holding exactly the weights of `hf_model`, converted by `tformer.from_hf`
    (the same path users take: save_pretrained, then import the directory)."""
    from tformer import from_hf

    with tempfile.TemporaryDirectory() as tmp:
        hf_model.save_pretrained(tmp)
        return from_hf(tmp)


def hf_gpt2(n_layers: int, d_model: int, n_heads: int, vocab: int, n_positions: int, seed: int = 0):
    """A randomly initialised Hugging Face GPT2LMHeadModel of the given shape, in eval mode, no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layers, n_embd=d_model, n_head=n_heads, vocab_size=vocab,
                     n_positions=n_positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def param_count(model: torch.nn.Module) -> int:
    """Parameters, each shared tensor counted once (tied embeddings)."""
    seen = {p.data_ptr(): p.numel() for p in model.parameters()}
    return sum(seen.values())


def weight_bytes(model: torch.nn.Module) -> int:
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    seen.update({b.data_ptr(): b.numel() * b.element_size() for b in model.buffers()})
    return sum(seen.values())


def engine_row(case: str, unit: str, ours: float, peer: float, peer_name: str, **extra) -> dict:
    """One row of the engines bench: tformer vs a peer (ratio = tformer / peer speed)."""
    return {"bench": "engines", "case": case, "unit": unit, "tformer": ours, "peer": peer, "peer_name": peer_name,
            "ratio": ours / peer, **extra}


def peer_threads() -> int:
    """The peers run with as many threads as torch (--threads)."""
    return torch.get_num_threads()


def pad_rows(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) ids and their 1/0 mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    return ids, mask
