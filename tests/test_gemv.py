"""tformer.kernels.gemv, the fp32 kernel for decoding, and tformer.kernels.build, the library it is in: x Wᵀ + b
for any number of rows equals F.linear, the Gemv plan takes it where it is built, and it runs on PyTorch's own
OpenMP threads."""

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from test_attend_kernel import causal_reference, whole_reference
from test_fused import gpt, steps
from tformer.inference.quant import quantize_weight
from tformer.kernels import build, gemv
from tformer.model import linear, plans
from tformer.model.dropout import dropout
from tformer.model.linear import Gemv, Linear
from tformer.model.plans import plan_decoding

needs_kernel = pytest.mark.skipif(build.unsupported() is not None, reason=f"gemv: {build.unsupported()}")


@needs_kernel
def test_the_install_built_the_kernel_where_it_can_run():
    assert gemv.available(), "make builds it (tformer.kernels.build.main()); run it to see why it failed"


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
    assert plan_decoding(m, linear.MAX_ROWS) == 1 and isinstance(m.plan, Gemv)   # mid-sized: any step
    large = Linear(1024, 1024)                                    # from PACK_MIN: oneDNN's above PLAN_ROWS
    assert plan_decoding(large, gemv.PLAN_ROWS) == 1 and isinstance(large.plan, Gemv)
    assert plan_decoding(large, gemv.PLAN_ROWS + 1) == 1 and not isinstance(large.plan, Gemv)


@needs_kernel
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not built in")
@pytest.mark.parametrize("fastest", ["F.linear", "Packed", "Gemv"])
def test_a_timed_pass_gives_each_kind_of_layer_its_fastest_plan(monkeypatch, tmp_path, fastest):
    monkeypatch.setenv("TFORMER_PLANS", "timed")
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path))                # the choices are kept here (plans.json)
    monkeypatch.setattr(plans, "CHOICES", {})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)         # no Split: 1024 and 2048 outputs / 3
    rounds = []

    def fake(calls, rows):                        # which plans ran a pass: seconds made up
        rounds.append({(group, name) for group, name, *_ in calls})
        for _, _, product, w, b in calls:         # each candidate computes the product
            x = torch.randn(rows, w.size(1))
            torch.testing.assert_close(product(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
        made_up = {"F.linear": 2.0, "Packed": 3.0, "Gemv": 4.0, fastest: 1.0}
        return {group: made_up[name] for group, name, *_ in calls}

    monkeypatch.setattr(plans, "pass_times", fake)
    torch.manual_seed(0)
    model = torch.nn.Sequential(Linear(1024, 1024), Linear(1024, 2048), Linear(1024, 1024), Linear(64, 64))
    assert plan_decoding(model, 16) == (0 if fastest == "F.linear" else 3)
    assert len(rounds) == 3 and {kind for r in rounds for _, kind in r} == {"F.linear", "Packed", "Gemv"}
    assert all(len({kind for _, kind in r}) == 1 for r in rounds)        # a round: every group on one candidate
    want = plans.NAMES[fastest]
    assert all(type(m.plan) is type(None) if want is None else isinstance(m.plan, want) for m in model[:3])
    assert model[3].plan is None                                         # tiny: F.linear, untimed
    x = torch.randn(16, 1024)
    with torch.no_grad():
        torch.testing.assert_close(model[1](x), F.linear(x, model[1].weight, model[1].bias), atol=1e-4, rtol=1e-5)
    again = torch.nn.Sequential(Linear(1024, 1024), Linear(1024, 2048))
    assert plan_decoding(again, 16) == (0 if want is None else 2) and len(rounds) == 3   # decided once per shape
    monkeypatch.setattr(plans, "CHOICES", {})                          # another process reads the per-user cache
    plan_decoding(again, 16)
    assert len(rounds) == 3 and (again[0].plan is None if want is None else isinstance(again[0].plan, want))
    stored = json.loads((tmp_path / "plans.json").read_text())
    assert sorted(stored.values()) == [fastest, fastest] and all("|16|float32|" in k for k in stored)
    assert plan_decoding(model, gemv.PLAN_ROWS) == 3 and isinstance(model[0].plan, Gemv)   # <= 8 rows: the kernel
    assert len(rounds) == 3


@needs_kernel
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not built in")
def test_real_timings_choose_among_the_candidates_and_every_choice_computes_the_product(monkeypatch, tmp_path):
    monkeypatch.setenv("TFORMER_PLANS", "timed")
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path))
    monkeypatch.setattr(plans, "CHOICES", {})
    torch.manual_seed(0)
    for dtype, rows in ((torch.float32, 12), (torch.bfloat16, 1), (torch.bfloat16, 12)):
        model = torch.nn.Sequential(Linear(512, 768), Linear(768, 512)).to(dtype)
        plan_decoding(model, rows)
        for m in model:
            kind = plans.NAMES[plans.CHOICES[plans.key_of(m, rows)]]
            assert len(m.candidates(rows)) > 1 and kind in m.candidates(rows)
            assert m.plan is None if kind is None else type(m.plan) is kind
            x = torch.randn(rows, m.in_features).to(dtype)
            with torch.no_grad():
                want = F.linear(x.double(), m.weight.double(), m.bias.double())
                tol = 1e-4 if dtype == torch.float32 else 2e-2
                torch.testing.assert_close(m(x).double(), want, atol=tol, rtol=tol)


@needs_kernel
def test_the_bf16_kernel_plan_multiplies_within_bf16_rounding():
    torch.manual_seed(0)
    w, b = (torch.randn(300, 256) * 0.05).bfloat16(), torch.randn(300).bfloat16()
    plan = linear.GemvBf16(w, 4)
    for shape in ((1, 256), (4, 256), (2, 3, 256), (0, 256)):
        x = torch.randn(shape).bfloat16()
        exact = F.linear(x.double(), w.double(), b.double())
        y = plan(x, b)
        assert y.dtype == torch.bfloat16 and y.shape == exact.shape
        # each product exact in fp32, the sum in fp32, then one rounding to bf16 (8 bits): |error| <= 2^-8 |y| + sums
        assert ((y.double() - exact).abs() <= 2.0 ** -8 * exact.abs() + 1e-4).all()


@needs_kernel
def test_decoding_with_the_kernel_matches_the_plain_forward(monkeypatch):
    from tformer.model.config import ModelConfig
    from tformer.model.models import Decoder
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
    """The library's libgomp.so.1 is the copy PyTorch loaded: one OpenMP runtime in the process (a
    fresh one: a test that imported CTranslate2 here has loaded that wheel's own libgomp)."""
    code = ("import torch; from tformer.kernels import gemv; w = torch.randn(4096, 512); "
            "gemv.gemv(gemv.pack(w), torch.randn(1, 512), None, 4096); "
            "print(len({l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l or 'libiomp' in l}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1"]


def test_build_says_why_it_cannot(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "library_path", lambda: tmp_path / "_gemv-test.so")
    reason = build.unsupported()
    with pytest.raises(RuntimeError, match=reason or "no C compiler"):
        build.build(compiler="no-such-cc")
    assert not list(tmp_path.iterdir())                          # nothing half-written left behind


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64", reason="x86-64 Linux only")
@pytest.mark.parametrize("cpu, vnni", [("AVX2", False), ("AVX512", False), ("AVX512", True)])
def test_source_builds_for_each_vector_width(monkeypatch, tmp_path, cpu, vnni):
    """The library compiles for AVX-512 (with and without VNNI's int8 products) and for AVX2 whichever
    CPU runs the tests (only the ones it has can run the result), into a library of its own name, from
    every source in the package: each entry point the loader knows is in it."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: cpu)
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: vnni)
    monkeypatch.setattr(build, "library_path", lambda: tmp_path / f"_gemv-{cpu}-{vnni}.so")
    assert set(build.VECTORS[cpu]) <= set(build.flags()) and ("-mavx512vnni" in build.flags()) == vnni
    here = Path(build.__file__).parent
    assert build.SOURCES == sorted(here.glob("*.c")) and len(build.SOURCES) >= 5 and build.HEADERS
    library = build.build()
    defined = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True,
                             check=True).stdout.split()
    assert set(build.FUNCTIONS) <= set(defined)
    assert {name for name in defined if name.startswith("tformer_")} == set(build.FUNCTIONS)   # no more, none hidden


def test_the_library_name_covers_every_source_and_header(monkeypatch, tmp_path):
    """A change to any one file the library is built from gives it another name: never an old build."""
    copies = []
    for path in build.SOURCES + build.HEADERS:
        (tmp_path / path.name).write_bytes(path.read_bytes())
        copies.append(tmp_path / path.name)
    monkeypatch.setattr(build, "SOURCES", [c for c in copies if c.suffix == ".c"])
    monkeypatch.setattr(build, "HEADERS", [c for c in copies if c.suffix == ".h"])
    names = {build.library_path().name}
    for copy in copies:
        copy.write_bytes(copy.read_bytes() + b"\n")
        names.add(build.library_path().name)
    assert len(names) == len(copies) + 1


def _runs(cpu: str) -> bool:
    have = torch.backends.cpu.get_cpu_capability()
    return build.unsupported() is None and (cpu == "AVX2" or have in ("AVX512", "AMX"))


@pytest.mark.parametrize("cpu", sorted(set(build.VECTORS) - {"AMX"}))
def test_each_vector_width_multiplies_right(monkeypatch, tmp_path, cpu):
    """Each build the CPU can run (an AVX-512 CPU runs both) gives the product, fp32 and bf16 (whose
    blocks the AVX2 build reads in pairs: gemv.pack lays them out for the library loaded), the
    screened argmax (AVX2 passes 4 rows at a time, so 8 rows take two), and the int8 product bit for
    bit as the library built for this CPU gives it (AVX2's integer pairs and VNNI's sum the same), RMSNorm
    and its gradients as PyTorch's, dropout's mask as this CPU's build draws it, and a GPT's fused step as its
    layers give it."""
    if not _runs(cpu):
        pytest.skip(f"this CPU cannot run the {cpu} build")
    torch.manual_seed(1)
    q, scales = quantize_weight(torch.randn(37, 103))
    int8_x = [torch.randn(rows, 103) for rows in (1, 3, 8, 64)]
    int8_here = [gemv.gemv8(gemv.pack8(q, scales), x, None, 37) for x in int8_x] if gemv.available() else None
    drop_x = torch.randn(3, 1001)
    torch.manual_seed(2)
    dropped_here = dropout(drop_x, 0.3) if gemv.available() else None
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: cpu)
    monkeypatch.setattr(build, "library_path", lambda: tmp_path / f"_gemv-{cpu}.so")
    build.function.cache_clear()
    try:
        build.build()
        assert gemv.bf16_paired() == (cpu == "AVX2")
        torch.manual_seed(0)
        n, k = 100, 40
        w, b = torch.randn(n, k), torch.randn(n)
        for rows in (1, 3, 8):
            x = torch.randn(rows, k)
            assert torch.allclose(gemv.gemv(gemv.pack(w), x, b, n), F.linear(x, w, b), atol=1e-5)
            rounded = w.bfloat16().float()
            assert torch.allclose(gemv.gemv(gemv.pack(w, torch.bfloat16), x, b, n), F.linear(x, rounded, b), atol=1e-5)
            head = _head(1000, 128, rows)
            assert plan_decoding(head, rows) == 1
            with torch.no_grad():
                for x in (torch.randn(rows, 128), torch.stack([head.weight[[3, 41, 5][i % 3]] for i in range(rows)])):
                    assert torch.equal(head.argmax(x), head(x).argmax(dim=-1))
        for x, expected in zip(int8_x, int8_here or []):
            assert torch.equal(gemv.gemv8(gemv.pack8(q, scales), x, None, 37), expected)
        if dropped_here is not None:                     # dropout's mask: integer hashing, the same in every build
            torch.manual_seed(2)
            assert torch.equal(dropout(drop_x, 0.3), dropped_here)
        for d in (37, 128):                              # RMSNorm for training: a vector tail, whole vectors
            x, w, g = torch.randn(5, d), torch.randn(d), torch.randn(5, d)
            y, r = gemv.rms_norm(x, w, 1e-6)
            dx, dw = gemv.rms_norm_grad(x, w, r, g)
            xr = x.requires_grad_()
            expected = F.rms_norm(xr, (d,), w.requires_grad_(), 1e-6)
            torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
            for ours, theirs in zip((dx, dw), torch.autograd.grad(expected, (xr, w), g)):
                torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-4)
        lengths = [5, 1, 40]                             # an encoder's attention on packed texts (8 keys a vector)
        qkv = torch.randn(sum(lengths), 3 * 2 * 16)
        whole = gemv.attend_whole(qkv, F.pad(torch.tensor(lengths).cumsum(0), (1, 0)), 2, 2, 16, 0.25)
        torch.testing.assert_close(whole.double(), whole_reference(qkv, lengths, 2, 2, 16), atol=1e-5, rtol=1e-5)
        q, kv = torch.randn(19, 2, 16), torch.randn(2, 2, 30, 16)         # a prompt's causal attention, 11 cached
        torch.testing.assert_close(gemv.attend_causal(q, kv[0], kv[1], 0.25).double(),
                                   causal_reference(q, kv[0], kv[1], 0.25), atol=1e-5, rtol=1e-5)
        model = gpt(d_ff=520)                            # GPT-2's GELU (tanh) in vectors, and a tail of 8
        for rows in (1, 3):
            ids = torch.randint(0, 300, (rows, 5), generator=torch.Generator().manual_seed(rows))
            torch.testing.assert_close(steps(model, ids, 3, True), steps(model, ids, 3, False), rtol=1e-4, atol=1e-4)
    finally:
        build.function.cache_clear()


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


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_bf16_packed_weights_multiply_exactly_in_fp32(rows):
    torch.manual_seed(rows)
    n, k = 300, 96
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(rows, k)
    rounded = w.bfloat16().double()
    exact = x.double() @ rounded.T + b.double()                   # only the weights rounded, products exact
    scale = x.abs().double() @ rounded.abs().T + b.abs().double()
    assert ((gemv.gemv(gemv.pack(w, torch.bfloat16), x, b, n) - exact).abs() <= (k + 1) * 2.0 ** -24 * scale).all()


def _head(n: int, k: int, seed: int) -> Linear:
    """An output layer whose rows hold exact duplicates and near-duplicates (closer than bf16 can
    tell apart), so that the screen passes several candidates and the exact products, from several
    pairs of blocks (the last one partial), must decide."""
    torch.manual_seed(seed)
    head = Linear(k, n)
    with torch.no_grad():
        for tie in (7, 100, n - 2):                                # ties, in pairs of blocks of their own
            head.weight[tie], head.bias[tie] = head.weight[3], head.bias[3]      # too: the first index wins
        head.weight[40] = head.weight[41] * (1 + 2.0 ** -12)       # equal in bf16, not in fp32
        head.weight[n - 1] = head.weight[5] * (1 - 2.0 ** -12)
    return head


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_screened_argmax_is_the_argmax_of_the_whole_output(rows):
    head = _head(1000, 128, rows)
    assert plan_decoding(head, rows) == 1 and isinstance(head.plan, Gemv)
    with torch.no_grad():
        for trial in range(20):
            x = torch.randn(rows, 128)
            if trial % 2:                                          # steer every row to the tied / close rows
                x = torch.stack([head.weight[[3, 41, 5][i % 3]] for i in range(rows)]) * 4
            got = head.argmax(x)
            expected = head(x).argmax(dim=-1)                      # the first of equals, as torch documents
            assert torch.equal(got, expected), trial
        assert head.argmax(torch.full((rows, 128), float("nan"))) is None
        assert head.argmax(torch.randn(gemv.PLAN_ROWS + 1, 128)) is None          # more rows: no screen
    assert head.plan.screen.dtype == torch.bfloat16


@needs_kernel
def test_greedy_decoding_through_the_screen_matches_the_logits(monkeypatch):
    from tformer.model.config import ModelConfig
    from tformer.model.models import Decoder
    torch.manual_seed(0)
    model = Decoder(ModelConfig(vocab_size=4096, d_model=256, n_heads=4, n_layers=2, max_seq_len=64)).eval()
    ids = torch.randint(0, 4096, (3, 12))
    calls = []
    original = Linear.argmax
    monkeypatch.setattr(Linear, "argmax", lambda self, x: calls.append(1) or original(self, x))
    screened = model.generate(ids, max_new_tokens=16)
    assert len(calls) == 16 and model.lm_head.plan.screen is not None
    monkeypatch.setattr(Linear, "argmax", lambda self, x: None)
    assert torch.equal(model.generate(ids, max_new_tokens=16), screened)
    assert torch.equal(model.generate(ids, max_new_tokens=16, repetition_penalty=1.0), screened)
