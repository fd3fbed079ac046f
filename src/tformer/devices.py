"""Which device to run on, and how much memory it has: plain probes of the machine.

This module sits below every other: it imports only torch and the leaf `errors` module, so the
model core (linear.py), the resource checks (limits.py) and training can all use it. Also the one
neighbour known to slow decoding down from inside the process (`warn_shared_openmp`).
"""

from __future__ import annotations

import functools
import os
import shutil
import sys

import torch

from .errors import ConfigError, warn


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """--device auto/cpu/cuda -> a torch.device (cuda: this process's GPU, `local_rank`)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA GPU is available (use --device cpu)")
        return torch.device("cuda", local_rank)
    if name != "cpu":
        raise ConfigError(f"--device {name!r}: choose auto, cpu or cuda")
    return torch.device("cpu")


def device_memory(device: torch.device | str) -> int:
    """Total bytes of memory of `device`: the GPU's, or the machine's RAM (within a cgroup limit)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:  # a container's memory limit (cgroup v2), when lower than the machine's
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def available_memory() -> int | None:
    """Bytes of RAM the kernel says can still be used without swapping (MemAvailable), or None
    where /proc/meminfo does not exist."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 itself: a GPU with bf16 units, or a CPU with AVX-512 BF16 or
    AMX. Elsewhere bf16 is emulated and far slower than fp32 (BENCHMARKS.md, "bf16 on an AVX2 CPU")."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return False


def amx() -> bool:
    """Whether this CPU has AMX tiles: PyTorch's CPU attention then multiplies bf16 by them (its flash kernel's
    brgemm), and tformer's attention kernels, which sum bf16 in fp32 vectors, leave bf16 queries to it."""
    return torch.cpu._is_amx_tile_supported()


def cxx_compiler() -> str | None:
    """The C++ compiler torch.compile would use on a CPU ($CXX, else g++, clang++ or c++), or None."""
    for name in ([os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "clang++", "c++"]):
        if found := shutil.which(name):
            return found
    return None


SHARED_OPENMP = ("ctranslate2 was imported after torch: its OpenMP calls run on torch's runtime, and once it has run, "
                 "the two thread pools outnumber the cores and stop spinning: both engines decode up to a third "
                 "slower; import ctranslate2 before torch and tformer (BENCHMARKS.md, \"In one process\")")


def shares_openmp(modules: list[str] | None = None) -> bool:
    """Whether CTranslate2 was imported after torch (`modules`: the import order, sys.modules' by default)."""
    names = list(sys.modules) if modules is None else modules
    return "ctranslate2" in names and "torch" in names and names.index("torch") < names.index("ctranslate2")


def warn_shared_openmp() -> None:
    """SHARED_OPENMP as one warning line, once per process, where it applies (checked at every call:
    CTranslate2 may come later)."""
    if shares_openmp():
        warn_once(SHARED_OPENMP)


@functools.cache
def warn_once(message: str) -> None:
    warn(message)
