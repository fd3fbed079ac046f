"""tformer's C kernels built on first use into the per-user cache (tformer.kernels.build), as a `pip install`
gets them: built once by processes that start together, one warning line where they cannot be built (and the
same tokens without them), none when the build is turned off; and `tformer info` / `tformer bench` saying
which. Each case runs in a fresh interpreter on a fresh cache (TFORMER_CACHE), since a process opens the
library once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tformer
from tformer.bench import format_table
from tformer.bench.common import machine_info
from tformer.cli import main
from tformer.kernels import build, gemv

HERE = Path(__file__).parent
can_run = pytest.mark.skipif(build.unsupported() is not None, reason=f"kernels: {build.unsupported()}")


def greedy_tokens() -> list[list[int]]:
    """A seeded 2-layer GPT's greedy continuation of two prompts: fp32 layers the kernel plans where it is in use."""
    torch.manual_seed(0)
    model = tformer.Decoder(tformer.ModelConfig(vocab_size=4096, d_model=256, n_heads=4, n_layers=2,
                                                max_seq_len=64)).eval()
    ids = torch.randint(0, 4096, (2, 12))
    return model.generate(ids, max_new_tokens=12).tolist()


def python(code: str, cache: Path, **env: str) -> subprocess.Popen:
    """`code` in a fresh interpreter whose kernel cache is `cache` (CC and the opt-out as given, else unset)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("CC", build.NO_BUILD, "XDG_CACHE_HOME")}
    environ.update(TFORMER_CACHE=str(cache), PYTHONPATH=str(HERE), **env)
    return subprocess.Popen([sys.executable, "-c", code], env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> tuple[str, str]:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return out, err


RACE = """
import sys, time
from pathlib import Path
import torch, torch.nn.functional as F
from tformer.kernels import build, gemv
ready = Path(sys.argv[1]); ready.joinpath(sys.argv[2]).touch()
while len(list(ready.iterdir())) < 2:           # both processes here: then both ask for the kernel at once
    time.sleep(0.01)
available = gemv.available()
w, b, x = torch.randn(40, 24), torch.randn(40), torch.randn(3, 24)
right = available and torch.allclose(gemv.gemv(gemv.pack(w), x, b, 40), F.linear(x, w, b), atol=1e-5)
print(available, right, build.status())
"""


@can_run
@pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler")
def test_processes_that_start_together_build_the_library_once(tmp_path):
    cache, ready = tmp_path / "cache", tmp_path / "ready"
    ready.mkdir()
    procs = [python(RACE.replace("sys.argv[1]", repr(str(ready))).replace("sys.argv[2]", repr(str(i))), cache)
             for i in range(2)]
    results = [finish(p) for p in procs]
    assert [err for _, err in results] == ["", ""]                        # no warning, no other line
    lines = [out.strip() for out, _ in results]
    assert all(line.startswith("True True in use: ") for line in lines), lines
    assert sum(line.endswith("(built now)") for line in lines) == 1       # the other waited and loaded it
    built = list((cache / "kernels").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"                   # no temporary file left
    assert all(f"in use: {built[0]}" in line for line in lines)


@can_run
def test_a_broken_compiler_is_one_warning_line_and_the_same_tokens(tmp_path):
    code = ("import json; from test_kernel_cache import greedy_tokens; from tformer.kernels import gemv; "
            "from tformer.cli import main; tokens = greedy_tokens(); assert not gemv.available(); "
            "print(json.dumps(tokens)); main(['info'])")
    out, err = finish(python(code, tmp_path, CC="false"))
    assert err.count("\n") == 1 and err.startswith("warning: ")           # once, however often it is asked
    assert "false failed" in err and "about 2x slower for batch 1" in err
    tokens, *info = out.splitlines()
    assert "kernel: not in use: false failed: exit status 1; decoding uses oneDNN's kernels" in info[-1]
    assert json.loads(tokens) == greedy_tokens()                          # here: the kernel, where it is built
    assert not list((tmp_path / "kernels").iterdir())                     # nothing half-written left


def test_the_opt_out_builds_nothing_and_says_so_only_when_asked(tmp_path):
    code = "from tformer.kernels import build, gemv; print(gemv.available(), build.status())"
    out, err = finish(python(code, tmp_path, CC="false", **{build.NO_BUILD: "1"}))
    assert err == "" and out.startswith("False not in use: ")
    if build.unsupported() is None:
        assert f"not built ({build.NO_BUILD} is set)" in out
    assert not (tmp_path / "kernels").exists()


def test_info_names_the_versions_the_cpu_its_features_and_the_kernel(capsys):
    assert main(["info"]) == 0
    first, cpu, kernel = capsys.readouterr().out.splitlines()
    assert first.startswith(f"tformer {tformer.__version__}, ") and f"torch {torch.__version__} " in first
    assert cpu.endswith(f"torch's kernels: {torch.backends.cpu.get_cpu_capability()}")
    if Path("/proc/cpuinfo").exists():
        fields = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
                      if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        assert cpu.startswith(f"cpu: {fields['model name']} ")
        listed = cpu.split("; ")[1].split()
        for flag in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"):
            assert (flag in listed) == (flag in fields["flags"].split()), flag
    if gemv.available():
        assert kernel.startswith(f"kernel: in use: {build.library_path()}") and build.library_path().exists()
    else:
        assert kernel.startswith("kernel: not in use: ")


def test_bench_prints_the_kernel_line():
    machine = machine_info("cpu")
    assert machine["kernel"] == build.status()
    result = {"machine": machine, "ceilings": {"gemm_fp32_GFLOPs": 1.0, "gemm_bf16_GFLOPs": 1.0, "read_GBps": 1.0},
              "rows": [], "seconds": 1.0}
    assert f"kernel: {build.status()}" in format_table(result).splitlines()[:3]
