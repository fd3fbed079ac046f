"""tformer.gemv, the fp32 kernel for decoding: x Wᵀ + b for any number of rows equals F.linear, the Gemv
plan takes it where it is built, and it runs on PyTorch's own OpenMP threads."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tformer import gemv, linear
from tformer.linear import Gemv, Linear, plan_decoding

needs_kernel = pytest.mark.skipif(gemv.unsupported() is not None, reason=f"gemv: {gemv.unsupported()}")


@needs_kernel
def test_the_install_built_the_kernel_where_it_can_run():
    assert gemv.available(), "make builds it (tformer.gemv.main()); run it to see why it failed"


@needs_kernel
@pytest.mark.parametrize("n, k, rows", [(50257, 768, 1), (50257, 768, 8), (768, 3072, 3), (768, 3072, 64),
                                        (300, 256, 9), (300, 256, 31), (300, 256, 200),
                                        (33, 17, 2), (20, 7, 3), (16, 1, 5), (1, 5, 16)])
def test_gemv_equals_f_linear(n, k, rows):
    torch.manual_seed(rows)
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(rows, k)
    packed = gemv.pack(w)
    assert packed.shape == (-(-n // 16), k, 16)
    for bias in (None, b):
        exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        # fp32 sums of k + 1 terms in any order: |error| <= (k + 1)·u·Σ|terms|, u = 2^-24
        scale = x.abs() @ w.abs().T + (0 if bias is None else bias.abs())
        assert ((gemv.gemv(packed, x, bias, n) - exact).abs() <= (k + 1) * 2.0 ** -24 * scale).all()


@needs_kernel
def test_gemv_refuses_what_it_was_not_made_for():
    packed = gemv.pack(torch.randn(32, 8))
    for x in (torch.randn(0, 8), torch.randn(1, 9), torch.randn(1, 8, dtype=torch.float64)):
        with pytest.raises(ValueError, match="does not fit"):
            gemv.gemv(packed, x, None, 32)


@needs_kernel
def test_gemv_plan_for_decoding_steps_runs_prompts_too(monkeypatch):
    calls = []
    original = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda *a: calls.append(a[1].size(0)) or original(*a))
    torch.manual_seed(0)
    m = Linear(256, 300)
    assert plan_decoding(m, gemv.PLAN_ROWS) == 1 and isinstance(m.plan, Gemv)
    with torch.no_grad():
        for shape in ((1, 256), (2, 2, 256), (linear.PROMPT_ROWS, 256), (linear.PROMPT_ROWS + 1, 256), (0, 256)):
            x = torch.randn(shape)
            torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias), atol=1e-5, rtol=1e-5)
    assert calls == [1, 4, linear.PROMPT_ROWS]                   # more rows, or none: F.linear
    assert plan_decoding(m, gemv.PLAN_ROWS + 1) == 1 and not isinstance(m.plan, Gemv)


@needs_kernel
def test_decoding_with_the_kernel_matches_the_plain_forward(monkeypatch):
    from tformer.config import ModelConfig
    from tformer.models import Decoder
    torch.manual_seed(0)
    model = Decoder(ModelConfig(vocab_size=4096, d_model=256, n_heads=4, n_layers=2, max_seq_len=64)).eval()
    ids = torch.randint(0, 4096, (2, 12))
    planned = model.generate(ids, max_new_tokens=8)
    assert {type(m.plan) for m in model.modules() if isinstance(m, Linear)} == {Gemv}
    monkeypatch.setattr("tformer.generation.decoding.plan_decoding", lambda model, rows: 0)
    for m in model.modules():
        if isinstance(m, Linear):
            m.plan = None
    assert torch.equal(model.generate(ids, max_new_tokens=8), planned)


@needs_kernel
def test_one_openmp_runtime():
    """The library's libgomp.so.1 is the copy PyTorch loaded: one OpenMP runtime in the process."""
    w = torch.randn(4096, 512)
    gemv.gemv(gemv.pack(w), torch.randn(1, 512), None, 4096)
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes


def test_build_says_why_it_cannot(monkeypatch, tmp_path):
    monkeypatch.setattr(gemv, "library_path", lambda: tmp_path / "_gemv-test.so")
    reason = gemv.unsupported()
    with pytest.raises(RuntimeError, match=reason or "no C compiler"):
        gemv.build(compiler="no-such-cc")
    assert not list(tmp_path.iterdir())                          # nothing half-written left behind


def test_plans_without_the_kernel_are_onednns(monkeypatch):
    monkeypatch.setattr(linear.gemv, "available", lambda: False)
    m = Linear(1024, 1024)
    plan_decoding(m, 1)
    assert not isinstance(m.plan, Gemv)


def _huge_kib() -> int:
    return int(Path("/proc/self/smaps_rollup").read_text().split("AnonHugePages:")[1].split()[0])


def _huge_pages_on_request() -> bool:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return thp.exists() and "[never]" not in thp.read_text() and Path("/proc/self/smaps_rollup").exists()


@pytest.mark.skipif(not _huge_pages_on_request(), reason="no transparent huge pages on this system")
def test_large_packed_weights_live_in_huge_pages_until_freed():
    w = torch.randn(4096, 1024)                                            # 16 MiB
    before = _huge_kib()
    packed = gemv.pack(w)
    held = _huge_kib()
    assert packed.data_ptr() % gemv.HUGE_PAGE == 0
    assert held - before >= 8 * 1024, "at least half of the 16 MiB in 2 MiB pages"
    assert torch.equal(packed, w.view(256, 16, 1024).transpose(1, 2))   # P[b, k, j] = W[16 b + j, k]
    del packed
    assert _huge_kib() <= held - 8 * 1024, "the mapping goes with the tensor"
