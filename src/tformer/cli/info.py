"""`tformer info`: what this installation runs on, for a bug report or before a benchmark.

    tformer info

    tformer 0.1.0, python 3.12.3, torch 2.13.0+cpu (2 threads)
    cpu: AMD EPYC (family 25, model 17), 2 cores; avx2 fma avx512f avx512_vnni avx512_bf16; torch's kernels: AVX512
    kernel: in use: /home/me/.cache/tformer/kernels/0261f6da76b3012e.so

The kernel line is tformer.kernels.build.status(), as `tformer bench` prints it: the library's path (built on
this first call where it is not yet), or why decoding runs on oneDNN's kernels instead.
"""

from __future__ import annotations

from tformer.cli import COMMANDS


def register(sub) -> None:
    p = sub.add_parser("info", help=COMMANDS["info"], description=(
        "show tformer's and torch's versions, the CPU with the features the kernels use (AVX2, AVX-512, VNNI, "
        "bf16, AMX), and whether tformer's C kernels are in use (the library's path; built now where it is not "
        "yet) or why not"))
    p.set_defaults(func=run)


def run(args) -> int:
    import os
    import platform

    import torch

    from tformer import __version__
    from tformer.kernels import build

    name, features = build.cpu()
    print(f"tformer {__version__}, python {platform.python_version()}, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads)")
    print(f"cpu: {name}, {os.cpu_count()} cores; {' '.join(features) or 'none of ' + ' '.join(build.FEATURES)}; "
          f"torch's kernels: {torch.backends.cpu.get_cpu_capability()}")
    print(f"kernel: {build.status()}")
    return 0
