"""tformer's kernel library: its C sources (this directory's *.c, with their shared *.h) compiled into one
shared library, and its functions loaded with ctypes.

The library is compiled on first use (or by `make`: `main()`), in one compiler call, for this CPU's widest
vectors (`flags()`), into a per-user cache: $TFORMER_CACHE/kernels, else $XDG_CACHE_HOME/tformer/kernels,
else ~/.cache/tformer/kernels. Its name is a hash of the sources and the flags, so an installed package
(pip, a wheel, an editable checkout) builds it once per version and CPU kind, never runs an old build, and
needs no build step of its own. Processes that start together build it once: the first takes a lock on
the folder, the others wait and load its library, written to a temporary file and renamed into place.

It is used only where it can run: x86-64 Linux with AVX-512 or AVX2, PyTorch on OpenMP (the library then
shares PyTorch's threads). Where it cannot be built (no compiler, a compiler error, a cache that cannot
be written) one warning line says why and what it costs; with TFORMER_NO_KERNEL_BUILD=1 nothing is
compiled (a library built before is still used). Either way `function()` gives None and the callers keep
PyTorch's kernels (gemv.available); `status()` says which, for `tformer info` and `tformer bench`.

    gemv_fp32.c   fp32 weights: x Wᵀ + b for a few rows, reading W once (gemv.gemv)
    gemv_bf16.c   the same on bf16 weights, and greedy decoding's argmax screened through them
    gemv_int8.c   int8 weights by 7-bit rows, summed exactly in integers (gemv.gemv8)
    attend.c      decoding attention: every row and head in one call (gemv.attend); an encoder's attention
                  on the real tokens of a padded batch (gemv.attend_whole); a prompt's causal attention after
                  its cached positions (gemv.attend_causal)
    gpt_step.c    a pre-LN GPT's whole decoding step, built from the above (gemv.gpt_step)
    rmsnorm.c     RMSNorm's forward and backward for training, one pass each (gemv.rms_norm)
    gelu.c        GELU (tanh's approximation) forward and backward, one pass each (gemv.gelu_tanh)
    dropout.c     dropout for training, forward and backward, one pass each (model/dropout.py)
    simd.h        the vectors they share (AVX-512 or AVX2);  kernels.h: the functions one calls in another
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..errors import warn

HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.c"))      # compiled together into one library
HEADERS = sorted(HERE.glob("*.h"))      # what they include: in the library's name too
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
VECTORS = {"AVX512": ["-mavx512f"], "AMX": ["-mavx512f"], "AVX2": ["-mavx2", "-mfma"]}   # by PyTorch's name for the CPU
NO_BUILD = "TFORMER_NO_KERNEL_BUILD"
COST = "decoding uses oneDNN's kernels, about 2x slower for batch 1"
STALE_DAYS = 30         # other builds in the cache older than this are removed when one is built
# /proc/cpuinfo's names for what the kernels and PyTorch's bf16 / int8 paths use
FEATURES = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def flags() -> list[str]:
    """The compiler's flags for this CPU's widest vectors: AVX-512 (with VNNI where it has it), else AVX2 + FMA."""
    cpu = torch.backends.cpu.get_cpu_capability()
    vnni = ["-mavx512vnni"] if cpu in ("AVX512", "AMX") and torch.cpu._is_vnni_supported() else []
    return FLAGS + VECTORS.get(cpu, []) + vnni


def cache_root() -> Path:
    """tformer's per-user cache: $TFORMER_CACHE, else $XDG_CACHE_HOME/tformer, else ~/.cache/tformer (the
    kernels here, the data sets built once in tformer.data)."""
    if os.environ.get("TFORMER_CACHE"):
        return Path(os.environ["TFORMER_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tformer"


def cache_dir() -> Path:
    """Where built libraries are kept: cache_root()/kernels."""
    return cache_root() / "kernels"


def library_path() -> Path:
    """Where the library built from these sources with these flags lives (the name is a hash of every
    source's and header's name and text and of the flags, so a changed file, or a cache shared with a CPU
    of other vectors, is never run from an old build)."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(flags()).encode())
    return cache_dir() / f"{digest.hexdigest()[:16]}.so"


def unsupported() -> str | None:
    """Why the library cannot run on this machine, or None."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"needs x86-64 Linux (this is {sys.platform} {platform.machine()})"
    if torch.backends.cpu.get_cpu_capability() not in VECTORS:
        return "the CPU has neither AVX-512 nor AVX2"
    if "OpenMP" not in torch.__config__.parallel_info():
        return "PyTorch is not built with OpenMP"
    return None


@contextlib.contextmanager
def locked(folder: Path):
    """An exclusive lock on `folder` (flock on the folder itself: no lock file left behind), held by one
    process at a time; released when the block ends or the process dies."""
    import fcntl
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def build(compiler: str | None = None) -> Path:
    """Compile every source into library_path() in one call of the compiler, unless it is there already
    (atomically, and once among processes that build at the same time: a half-written library is never
    loaded). Raises RuntimeError saying why when it cannot."""
    compile_once(compiler)
    return library_path()


def compile_once(compiler: str | None = None) -> bool:
    """build(): True when this call compiled the library, False when it was there (or another process
    built it while this one waited for the lock)."""
    reason = unsupported()
    if reason:
        raise RuntimeError(reason)
    out = library_path()
    if out.exists():
        return False
    cc = compiler or os.environ.get("CC") or "cc"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with locked(out.parent):
            if out.exists():
                return False
            compile_into(out, cc)
            return True
    except OSError as e:
        raise RuntimeError(f"cannot write {out.parent}: {e.strerror or e} (set TFORMER_CACHE to a folder "
                           f"that can be written)") from None


def compile_into(out: Path, cc: str) -> None:
    """One call of `cc` on every source into a temporary file beside `out`, renamed to `out` when whole;
    then builds of other sources older than STALE_DAYS are removed (another checkout may still use a newer one)."""
    fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        try:
            done = subprocess.run([cc, *flags(), *map(str, SOURCES), "-o", tmp], capture_output=True, text=True)
        except FileNotFoundError:
            raise RuntimeError(f"no C compiler ({cc!r} not found; set CC)") from None
        if done.returncode != 0:
            last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}"
            raise RuntimeError(f"{cc} failed: {last}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for old in [*out.parent.glob("*.so"), *out.parent.glob("*.tmp")]:    # a killed build leaves its .tmp
        with contextlib.suppress(OSError):
            if old != out and time.time() - old.stat().st_mtime > STALE_DAYS * 86400:
                old.unlink()


@functools.cache
def open_library(path: Path) -> tuple[ctypes.CDLL | None, str]:
    """The library at `path`, built there first where it is not yet, and how it came: "built now", "" (built
    before), or why it is not in use. Once per process and path: a library that cannot be built is one
    warning line, however many callers ask."""
    if reason := unsupported():
        return None, reason
    how = ""
    if not path.exists():
        if os.environ.get(NO_BUILD, "") not in ("", "0"):
            return None, f"not built ({NO_BUILD} is set)"
        try:
            how = "built now" if compile_once() else ""
        except RuntimeError as e:
            warn(f"tformer's C kernels are not in use ({e}): {COST} ({NO_BUILD}=1 silences this)")
            return None, str(e)
    try:
        return ctypes.CDLL(str(path)), how
    except OSError as e:
        warn(f"tformer's C kernels are not in use ({path} cannot be loaded: {e}): {COST}")
        return None, f"{path} cannot be loaded: {e}"


def status() -> str:
    """One line for `tformer info` and `tformer bench`: the kernels in use and the library's path, or why not."""
    library, how = open_library(library_path())
    if library is None:
        return f"not in use: {how}; {COST}"
    return f"in use: {library_path()}" + (f" ({how})" if how else "")


def cpu() -> tuple[str, list[str]]:
    """This CPU's model name (with its family and model numbers: "AMD EPYC" names several generations) and
    which of FEATURES it has, from the first processor of /proc/cpuinfo; elsewhere the platform's name and none."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    name = fields.get("model name") or platform.processor() or "unknown"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    have = set(fields.get("flags", "").split())
    return name, [f for f in FEATURES if f in have]


# The library's entry points: their argument types and result type (ctypes' names)
PTR, I64, FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
FUNCTIONS = {
    "tformer_gemv": ([PTR] * 4 + [I64] * 3, None),                      # p, x, bias, y; M, N, K
    "tformer_gemv_bf16": ([PTR] * 4 + [I64] * 3, None),
    "tformer_gemv_int8": ([PTR] * 4 + [I64] * 3 + [PTR], None),         # ... and the scratch for x in bytes
    "tformer_attend": ([PTR, I64, I64] + [PTR] * 2 + [I64] * 6          # q + strides; k, v + strides
                       + [PTR] + [I64] * 3 + [PTR, I64, PTR]              # mask + strides; lineage; out
                       + [I64] * 7 + [FLOAT], None),                      # B, H, H_kv, T_k, hd, copies, bf16; scale
    "tformer_attend_whole": ([PTR] + [I64] * 3 + [PTR] * 2         # qkv, stride, k_off, v_off; starts, out
                             + [I64] * 6 + [FLOAT], None),          # out_stride, B, H, H_kv, hd, bf16; scale
    "tformer_attend_causal": ([PTR, I64, I64] + [PTR] * 2 + [I64] * 4     # q + strides; k, v + strides
                              + [PTR] + [I64] * 8 + [FLOAT], None),   # out; os, T, offset, H, H_kv, hd, 2 bf16s; scale
    "tformer_gpt_step": ([PTR, I64, PTR] + [I64] * 8 + [FLOAT, I64, FLOAT, PTR], None),
    "tformer_argmax_bf16": ([PTR] * 5 + [FLOAT] + [I64] * 3 + [PTR] * 2, ctypes.c_int),   # ...; r; M, N, K; rough, best
    "tformer_bf16_paired": ([], ctypes.c_int),
    "tformer_rmsnorm": ([PTR] * 4 + [I64] * 2 + [FLOAT], None),            # x, w, y, r; rows, d; eps
    "tformer_rmsnorm_grad": ([PTR] * 6 + [I64] * 3, None),                 # x, w, r, g, dx, dw parts; rows, d, threads
    "tformer_gelu_tanh": ([PTR] * 2 + [I64], None),                        # x, y; n
    "tformer_dropout": ([PTR] * 3 + [I64] * 3 + [FLOAT, I64], None),      # x, y, keep; n, seed, threshold; s, bf16
    "tformer_dropout_grad": ([PTR] * 3 + [I64, FLOAT, I64], None),        # g, dx, keep; n; s, bf16
    "tformer_gelu_tanh_grad": ([PTR] * 3 + [I64], None),                   # x, g, dx; n
}


@functools.cache
def function(name: str):
    """The library's C function `name` (one of FUNCTIONS) with its argument and result types (the library
    built on the first call where it is not yet), or None where it cannot run or be built."""
    library, _ = open_library(library_path())
    if library is None:
        return None
    argtypes, restype = FUNCTIONS[name]
    fn = getattr(library, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def main() -> None:
    """Build the library and say so (make runs it); a machine that cannot build it still installs, and
    decodes with oneDNN's kernels."""
    try:
        print(f"tformer.kernels: built {build()}")
    except RuntimeError as e:
        print(f"tformer.kernels: not built ({e}); {COST}")
