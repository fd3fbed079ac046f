"""tformer.model.linear: Linear is nn.Linear; its decoding plans (packed oneDNN weights, split products)
give F.linear's result, are used only where they apply, and never outlive the weights they were made for."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tformer.model import linear, plans
from tformer.model.linear import Linear, Packed, Split
from tformer.model.plans import plan_decoding, plan_encoding

needs_mkldnn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not built in")


@pytest.fixture(autouse=True)
def without_own_kernel(monkeypatch):
    """The plans of a machine without tformer's fp32 kernel (that one: tests/test_gemv.py)."""
    monkeypatch.setattr(linear.gemv, "available", lambda: False)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def layer(n_in, n_out, dtype=torch.float32, bias=True, seed=0):
    torch.manual_seed(seed)
    return Linear(n_in, n_out, bias=bias).to(dtype)


def counting(monkeypatch, cls):
    calls = []
    original = cls.__call__

    def spy(self, *args):
        calls.append(cls.__name__)
        return original(self, *args)
    monkeypatch.setattr(cls, "__call__", spy)
    return calls


def test_linear_is_nn_linear_with_the_same_state_dict_and_result():
    ours, ref = layer(24, 40), nn.Linear(24, 40)
    ref.load_state_dict(ours.state_dict())
    assert isinstance(ours, nn.Linear) and list(ours.state_dict()) == ["weight", "bias"]
    x = torch.randn(3, 5, 24)
    assert torch.equal(ours(x), ref(x))


@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 96), (8, 96), (96,)])
def test_split_product_equals_f_linear(parts, bias, shape):
    torch.manual_seed(parts)
    w, b, x = torch.randn(120, 96), torch.randn(120) if bias else None, torch.randn(shape)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(parts)                              # one slice per thread
        split = Split(w, 1)
    finally:
        torch.set_num_threads(before)
    assert split.parts == parts
    torch.testing.assert_close(split(x, b), F.linear(x, w, b))


@needs_mkldnn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 8])
def test_packed_plan_gives_f_linear_and_is_used(monkeypatch, dtype, rows):
    if not linear.packs(dtype):
        pytest.skip("oneDNN cannot pack bf16 weights on this CPU")
    calls = counting(monkeypatch, Packed)
    m = layer(1024, 1024, dtype)                                  # 1M weights: packed
    assert plan_decoding(m, rows) == 1 and isinstance(m.plan, Packed)
    x = torch.randn(rows, 1, 1024, dtype=dtype)
    with torch.inference_mode():
        y = m(x)
    assert calls == ["Packed"]
    tol = {} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(y, F.linear(x, m.weight, m.bias), **tol)


def test_split_plan_for_mid_sized_fp32_packed_or_none_otherwise(monkeypatch, two_threads):
    calls = counting(monkeypatch, Split)
    mid = layer(256, 768)                                         # 196k weights: split
    assert plan_decoding(mid, 1) == 1 and isinstance(mid.plan, Split)
    x = torch.randn(1, 1, 256)
    with torch.no_grad():
        torch.testing.assert_close(mid(x), F.linear(x, mid.weight, mid.bias))
    assert calls == ["Split"]
    assert plan_decoding(layer(32, 96), 1) == 0                   # tiny: F.linear is fastest
    for other in (layer(256, 767), layer(256, 768, torch.bfloat16)):    # 767 outputs do not split in 2; bf16
        plan_decoding(other, 1)
        assert isinstance(other.plan, Packed if linear.packs(other.weight.dtype) else type(None))


@needs_mkldnn
def test_no_packing_when_memory_is_short(monkeypatch, two_threads):
    from tformer.model.config import ModelConfig
    from tformer.model.models import Decoder
    model = Decoder(ModelConfig(vocab_size=4096, d_model=256, n_heads=4, n_layers=1, max_seq_len=32))
    out_layer = 4096 * 256 * 4                                    # the one matrix that would be packed (bytes)
    monkeypatch.setattr(plans, "available_memory", lambda: 2 * out_layer - 1)
    plan_decoding(model, 1)
    assert model.lm_head.plan is None and isinstance(model.stack.layers[0].ffn.up.plan, Split)
    monkeypatch.setattr(plans, "available_memory", lambda: 2 * out_layer)
    plan_decoding(model, 1)
    assert isinstance(model.lm_head.plan, Packed)


@needs_mkldnn
def test_split_needs_more_than_one_thread():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        m = layer(256, 768)
        plan_decoding(m, 1)
        assert isinstance(m.plan, Packed)
    finally:
        torch.set_num_threads(before)


@needs_mkldnn
def test_plans_are_skipped_with_gradients_or_many_rows(monkeypatch):
    calls = counting(monkeypatch, Packed)
    m = layer(1024, 1024)
    plan_decoding(m, 1)
    x = torch.randn(1, 1024, requires_grad=True)
    m(x).sum().backward()                                         # training: the plan must not be used
    assert m.weight.grad is not None and x.grad is not None
    with torch.no_grad():
        m(torch.randn(linear.PROMPT_ROWS + 1, 1024))
    assert calls == []


@needs_mkldnn
def test_a_changed_weight_never_uses_a_stale_plan(monkeypatch):
    calls = counting(monkeypatch, Packed)
    m = layer(1024, 1024)
    plan_decoding(m, 1)
    x = torch.randn(1, 1024)
    with torch.no_grad():
        m.weight.mul_(2)                                          # in place: the version counter moves
        torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias))
        m.load_state_dict(layer(1024, 1024, seed=1).state_dict())
        torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias))
        m.to(torch.bfloat16)
        xb = x.bfloat16()
        torch.testing.assert_close(m(xb), F.linear(xb, m.weight, m.bias))
    assert calls == []
    plan_decoding(m, 1)                                           # planning again picks the new weights up
    with torch.no_grad():
        torch.testing.assert_close(m(xb), F.linear(xb, m.weight, m.bias), atol=2e-2, rtol=2e-2)
    assert calls == (["Packed"] if linear.packs(torch.bfloat16) else [])


@needs_mkldnn
def test_planned_layers_deepcopy_and_replan_only_when_needed():
    m = layer(1024, 1024)
    plan_decoding(m, 1)
    plan = m.plan
    twin = copy.deepcopy(m)                                       # a copy starts without a plan
    assert torch.equal(twin.weight, m.weight) and twin.plan is None
    plan_decoding(m, 1)
    assert m.plan is plan                                         # still valid: reused
    plan_decoding(m, 8)
    assert m.plan is not plan and m.plan.rows == 8


@needs_mkldnn
def test_decoding_with_plans_matches_the_plain_forward(monkeypatch, two_threads):
    from tformer.model.config import ModelConfig
    from tformer.model.models import Decoder
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=4096, d_model=256, n_heads=4, n_layers=2, max_seq_len=64, dropout=0.0)
    model = Decoder(cfg).eval()
    ids = torch.randint(0, 4096, (2, 12))
    with torch.no_grad():
        reference = model(ids)[:, -1]
        # per layer qkv, out, up, down (split); the output layer (packed)
        assert plan_decoding(model, 2) == 2 * 4 + 1
        assert {type(m.plan) for m in model.modules() if getattr(m, "plan", None)} == {Packed, Split}
        torch.testing.assert_close(model(ids)[:, -1], reference, atol=1e-4, rtol=1e-4)
    planned = model.generate(ids, max_new_tokens=8)
    monkeypatch.setattr("tformer.generation.decoding.plan_decoding", lambda model, rows: 0)
    for m in model.modules():
        if isinstance(m, Linear):
            m.plan = None
    assert torch.equal(model.generate(ids, max_new_tokens=8), planned)


@needs_mkldnn
def test_an_encoder_planned_for_whole_texts_gives_the_plain_forward(monkeypatch):
    """plan_encoding: packed weights for every large enough matrix, used at any number of rows (here more
    than a decoding plan's PROMPT_ROWS), F.linear's result; kept while valid, dropped with the weight."""
    from tformer.model.config import ModelConfig
    from tformer.model.models import Encoder
    torch.manual_seed(0)
    model = Encoder(ModelConfig(kind="encoder", vocab_size=1000, d_model=256, n_heads=4, n_layers=2, d_ff=1024,
                                max_seq_len=512, dropout=0.0)).eval()
    ids, mask = torch.randint(0, 1000, (8, 400)), torch.ones(8, 400, dtype=torch.long)
    mask[1:, 300:] = 0                                            # 2,500 real tokens: the packed rows
    large = [m for m in model.modules() if isinstance(m, Linear) and m.weight.numel() >= linear.SPLIT_MIN]
    assert len(large) == 2 * 4                                    # qkv, out, up, down per layer (by hand)
    with torch.no_grad():
        reference = model(ids, mask)
        assert plan_encoding(model) == len(large) and all(isinstance(m.plan, Packed) for m in large)
        calls = counting(monkeypatch, Packed)
        torch.testing.assert_close(model(ids, mask), reference, atol=1e-4, rtol=1e-4)
        assert len(calls) == len(large)
        kept = [m.plan for m in large]
        assert plan_encoding(model) == len(large) and [m.plan for m in large] == kept
        large[0].weight.add_(0.5)                                 # a changed weight: its plan is stale
        calls.clear()
        model(ids, mask)
        assert len(calls) == len(large) - 1
        plan_encoding(model)
        assert large[0].plan is not kept[0] and [m.plan for m in large[1:]] == kept[1:]
    fresh = Encoder(model.cfg)
    monkeypatch.setattr(plans, "available_memory", lambda: 0)     # no room for the copies: F.linear
    assert plan_encoding(fresh) == 0 and all(m.plan is None for m in fresh.modules() if isinstance(m, Linear))


@needs_mkldnn
@pytest.mark.parametrize("activation", sorted(linear.POST_OPS))
def test_the_activation_inside_the_packed_product_is_the_activation_after_it(monkeypatch, activation):
    """An encoder's FFN planned by plan_encoding: oneDNN applies the activation as it writes the up-projection
    (POST_OPS), and the encoder gives what it gives without plans (the activation after F.linear: tformer's
    own functions); where the up-projection carries unmerged LoRA adapters, their sum comes first (the plan
    set on it by plan_encoding is not taken as the whole product)."""
    from tformer.model.config import ModelConfig
    from tformer.model.lora import apply_lora
    from tformer.model.models import Encoder
    torch.manual_seed(0)
    model = Encoder(ModelConfig(kind="encoder", vocab_size=100, d_model=256, n_heads=4, n_layers=2, d_ff=512,
                                max_seq_len=64, dropout=0.0, activation=activation)).eval()
    ids, mask = torch.randint(0, 100, (4, 40)), torch.ones(4, 40, dtype=torch.long)
    mask[1:, 25:] = 0
    with torch.no_grad():
        reference = model(ids, mask)
        plan_encoding(model)
        calls = []
        original = Packed.__call__
        monkeypatch.setattr(Packed, "__call__",
                            lambda self, x, b, act=None: calls.append(act) or original(self, x, b, act))
        torch.testing.assert_close(model(ids, mask), reference, atol=1e-4, rtol=1e-4)
        assert calls.count(activation) == 2                           # each layer's up-projection
        apply_lora(model.requires_grad_(False), r=4, alpha=8, targets=("up",))
        for p in model.parameters():
            if p.requires_grad:                                       # the adapters: B made non-zero
                p.normal_(std=0.05)
        for m in model.modules():
            if isinstance(m, Linear):
                m.plan = None
        adapted = model(ids, mask)
        assert (adapted - reference).abs().max() > 1e-2
        plan_encoding(model)
        calls.clear()
        torch.testing.assert_close(model(ids, mask), adapted, atol=1e-4, rtol=1e-4)
        assert activation not in calls


@needs_mkldnn
def test_plans_step_aside_under_autocast(monkeypatch):
    """Under autocast F.linear multiplies in the autocast dtype; an fp32 plan would not: it is not used."""
    m = layer(256, 512)
    plan_decoding(m, 1)
    calls = counting(monkeypatch, Packed)
    x = torch.randn(4, 256)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
        assert calls == [] and y.dtype == torch.bfloat16
        m(x)
    assert calls == ["Packed"]


def test_ctranslate2_imported_after_torch_is_one_warning_line(monkeypatch, capsys):
    """The import order decides whether CTranslate2 shares torch's OpenMP runtime (BENCHMARKS.md, "In one
    process"): after torch, one warning line however often plans are made; before torch or absent, none."""
    from tformer import devices
    assert devices.shares_openmp(["sys", "torch", "numpy", "ctranslate2"])
    assert not devices.shares_openmp(["sys", "ctranslate2", "torch"]) and not devices.shares_openmp(["torch"])
    devices.warn_once.cache_clear()
    monkeypatch.setattr(devices, "shares_openmp", lambda: True)
    for _ in range(3):
        plan_decoding(layer(64, 64), 1)
    assert capsys.readouterr().err == f"warning: {devices.SHARED_OPENMP}\n"
    monkeypatch.setattr(devices, "shares_openmp", lambda: False)
    devices.warn_once.cache_clear()
    plan_decoding(layer(64, 64), 1)
    assert capsys.readouterr().err == ""


def test_a_stored_choice_this_process_cannot_run_keeps_the_rule(monkeypatch, tmp_path):
    """plans.json, written where the kernel was built, names it; here it is not built: the rule, not a crash,
    and no timing again."""
    monkeypatch.setenv("TFORMER_PLANS", "timed")
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path))
    m = Linear(1024, 2048)
    monkeypatch.setattr(plans, "CHOICES", {plans.key_of(m, 16): "Gemv"})
    monkeypatch.setattr(plans, "kind_times", lambda *a: pytest.fail("timed again"))
    plan_decoding(m, 16)
    rule = m.kind_of_plan(16)
    assert rule is not linear.Gemv and (m.plan is None if rule is None else type(m.plan) is rule)


@needs_mkldnn
def test_plan_encoding_packs_only_the_kinds_a_timed_pass_finds_faster_packed(monkeypatch, tmp_path):
    monkeypatch.setenv("TFORMER_PLANS", "timed")
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path))
    monkeypatch.setattr(plans, "CHOICES", {})
    rounds = []

    def fake(calls, rows):                        # made up: packed wins for 512 x 256, F.linear for 256 x 512
        assert rows == plans.ENCODE_ROWS
        rounds.append(sorted({name for _, name, *_ in calls}))
        return {group: (1.0 if (name == "Packed") == ("(512, 256)" in group) else 2.0) for group, name, *_ in calls}

    monkeypatch.setattr(plans, "pass_times", fake)
    model = nn.Sequential(Linear(256, 512), Linear(512, 256), Linear(256, 512))
    assert plan_encoding(model) == 2
    assert rounds == [["F.linear"], ["Packed"]]                     # the two candidates, every kind in each pass
    assert isinstance(model[0].plan, Packed) and isinstance(model[2].plan, Packed) and model[1].plan is None
    x = torch.randn(3, 7, 256)
    with torch.no_grad():
        torch.testing.assert_close(model(x), F.linear(F.linear(F.linear(x, model[0].weight, model[0].bias),
                                                               model[1].weight, model[1].bias),
                                                      model[2].weight, model[2].bias), atol=1e-4, rtol=1e-5)
    assert plan_encoding(model) == 2 and len(rounds) == 2                  # decided once
