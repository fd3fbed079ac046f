"""tformer's kernel library: its C sources (this directory's *.c, with their shared *.h) compiled into one
shared library, and its functions loaded with ctypes.

The library is compiled once at install time (`main()`, which `make` runs), in one compiler call, next
to its sources (or under ~/.cache/tformer when the package directory is read-only), for the CPU's
widest vectors (`flags()`). It is used only where it can run: x86-64 Linux with AVX-512 or AVX2,
PyTorch on OpenMP (the library then shares PyTorch's threads), and a library built from these very
sources. Anywhere else `function()` gives None and the callers keep PyTorch's kernels (gemv.available).

    gemv_fp32.c   fp32 weights: x Wᵀ + b for a few rows, reading W once (gemv.gemv)
    gemv_bf16.c   the same on bf16 weights, and greedy decoding's argmax screened through them
    gemv_int8.c   int8 weights by 7-bit rows, summed exactly in integers (gemv.gemv8)
    attend.c      decoding attention: every row and head in one call (gemv.attend)
    gpt_step.c    a pre-LN GPT's whole decoding step, built from the above (gemv.gpt_step)
    simd.h        the vectors they share (AVX-512 or AVX2);  kernels.h: the functions one calls in another
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.c"))      # compiled together into one library
HEADERS = sorted(HERE.glob("*.h"))      # what they include: in the library's name too
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
VECTORS = {"AVX512": ["-mavx512f"], "AMX": ["-mavx512f"], "AVX2": ["-mavx2", "-mfma"]}   # by PyTorch's name for the CPU


def flags() -> list[str]:
    """The compiler's flags for this CPU's widest vectors: AVX-512 (with VNNI where it has it), else AVX2 + FMA."""
    cpu = torch.backends.cpu.get_cpu_capability()
    vnni = ["-mavx512vnni"] if cpu in ("AVX512", "AMX") and torch.cpu._is_vnni_supported() else []
    return FLAGS + VECTORS.get(cpu, []) + vnni


def library_path() -> Path:
    """Where the library built from these sources with these flags lives (the name carries a hash of
    every source's and header's name and text and of the flags, so a changed file, or a checkout moved
    to a CPU with other vectors, is never run from an old build)."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(flags()).encode())
    name = f"_gemv-{digest.hexdigest()[:12]}.so"
    if os.access(HERE, os.W_OK) or (HERE / name).exists():
        return HERE / name
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tformer" / name


def unsupported() -> str | None:
    """Why the library cannot run on this machine, or None."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"needs x86-64 Linux (this is {sys.platform} {platform.machine()})"
    if torch.backends.cpu.get_cpu_capability() not in VECTORS:
        return "the CPU has neither AVX-512 nor AVX2"
    if "OpenMP" not in torch.__config__.parallel_info():
        return "PyTorch is not built with OpenMP"
    return None


def build(compiler: str | None = None) -> Path:
    """Compile every source into library_path() in one call of the compiler (atomically: a half-written
    library is never loaded). Raises RuntimeError with the compiler's message when it cannot."""
    reason = unsupported()
    if reason:
        raise RuntimeError(reason)
    out = library_path()
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cc = compiler or os.environ.get("CC", "cc")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags(), *map(str, SOURCES), "-o", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}"
            raise RuntimeError(f"{cc} failed: {last}")
        os.replace(tmp, out)
        for old in out.parent.glob("_gemv-*.so"):          # builds of earlier sources
            if old != out:
                old.unlink(missing_ok=True)
    except FileNotFoundError:
        raise RuntimeError(f"no C compiler ({cc!r} not found; set CC)") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


# The library's entry points: their argument types and result type (ctypes' names)
PTR, I64, FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
FUNCTIONS = {
    "tformer_gemv": ([PTR] * 4 + [I64] * 3, None),                      # p, x, bias, y; M, N, K
    "tformer_gemv_bf16": ([PTR] * 4 + [I64] * 3, None),
    "tformer_gemv_int8": ([PTR] * 4 + [I64] * 3 + [PTR], None),         # ... and the scratch for x in bytes
    "tformer_attend": ([PTR, I64, I64] + [PTR] * 2 + [I64] * 6          # q + strides; k, v + strides
                       + [PTR] + [I64] * 3 + [PTR, I64, PTR]              # mask + strides; lineage; out
                       + [I64] * 6 + [FLOAT], None),                      # B, H, H_kv, T_k, hd, copies; scale
    "tformer_gpt_step": ([PTR, I64, PTR] + [I64] * 8 + [FLOAT, I64, FLOAT, PTR], None),
    "tformer_argmax_bf16": ([PTR] * 5 + [FLOAT] + [I64] * 3 + [PTR] * 2, ctypes.c_int),   # ...; r; M, N, K; rough, best
    "tformer_bf16_paired": ([], ctypes.c_int),
}


@functools.cache
def function(name: str):
    """The library's C function `name` (one of FUNCTIONS) with its argument and result types, or None
    where the library cannot run."""
    if unsupported() or not library_path().exists():
        return None
    argtypes, restype = FUNCTIONS[name]
    fn = getattr(ctypes.CDLL(str(library_path())), name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def main() -> None:
    """Build the library and say so (make runs it at install); a machine that cannot build it still
    installs, and decodes with oneDNN's kernels."""
    try:
        print(f"tformer.kernels: built {build()}")
    except RuntimeError as e:
        print(f"tformer.kernels: not built ({e}); decoding uses oneDNN's kernels")
