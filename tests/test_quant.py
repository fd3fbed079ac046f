"""Int8 quantisation (weight-only, and with int8 activations): the error stays within the bound the
rounding allows, and a quantised model still computes what the float model does (closely) through
every path."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tformer
from tformer.inference import quant
from tformer.inference.int8_plans import Gemv8, dynamic_int8_available
from tformer.inference.quant import Int8Linear, quantize_int8, quantize_weight
from tformer.kernels import gemv

needs_fbgemm = pytest.mark.skipif(not dynamic_int8_available(), reason="no FBGEMM in this PyTorch build")


def test_quantize_weight_uses_full_int8_range_per_row():
    torch.manual_seed(0)
    w = torch.randn(16, 32) * torch.logspace(-3, 1, 16)[:, None]               # rows of very different size
    q, s = quantize_weight(w)
    assert q.dtype == torch.int8 and s.shape == (16,)
    assert torch.equal(q.abs().amax(dim=1), torch.full((16,), 127, dtype=torch.int8))
    # Each weight is recovered to within half a quantisation step of its own row.
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_error_within_rounding_bound(bias):
    """Weight-only: |y - y_exact| <= (s_n / 2) * Σ_k |x_k| per output, the worst case of rounding each weight."""
    torch.manual_seed(1)
    linear = nn.Linear(64, 48, bias=bias)
    x = torch.randn(2, 5, 64)                                                    # (B, T, K): any leading dims
    exact = linear(x)
    approx = Int8Linear(linear, activations="float")(x)
    assert approx.shape == exact.shape and approx.dtype == exact.dtype
    _, s = quantize_weight(linear.weight)
    bound = s / 2 * x.abs().sum(-1, keepdim=True) + 1e-5                         # (B, T, N)
    assert ((approx - exact).abs() <= bound).all()
    assert not torch.equal(approx, exact)                                        # it really is quantised


def test_int8_kernel_equals_the_scaled_int8_matmul_formula():
    """The fast CPU kernel computes s_n · Σ_k x_k q_nk (the formula the fallback path uses)."""
    torch.manual_seed(2)
    linear = nn.Linear(96, 40, bias=False)
    layer = Int8Linear(linear, activations="float")
    x = torch.randn(7, 96)
    formula = F.linear(x, layer.weight.float()) * layer.scales
    torch.testing.assert_close(layer(x), formula, rtol=1e-5, atol=1e-5)
    xb = x.bfloat16()
    torch.testing.assert_close(layer.to(torch.bfloat16)(xb).float(), formula, rtol=2e-2, atol=2e-2)


@needs_fbgemm
@pytest.mark.parametrize("bias", [True, False])
def test_int8_activations_error_within_rounding_bound(bias, monkeypatch):
    """Int8 activations through FBGEMM (past KERNEL_ROWS rows, here from the first):
    |y_mn - y_exact_mn| <= (s_n / 2) Σ_k |x_mk| + (r_m·a / 2) Σ_k s_n |q_nk|, with r_m
    row m's largest magnitude and a the 7-bit step (max(x/r, 0) - min(x/r, 0)) / 127 of the scaled input."""
    monkeypatch.setattr(quant, "KERNEL_ROWS", 0)
    torch.manual_seed(5)
    linear = nn.Linear(64, 48, bias=bias)
    x = torch.randn(2, 5, 64) * torch.logspace(-1, 1, 64) * torch.logspace(-2, 2, 5)[:, None]  # varied features, rows
    with torch.no_grad():
        exact = linear(x)
        approx = Int8Linear(linear)(x)
    assert approx.shape == exact.shape and approx.dtype == exact.dtype
    q, s = quantize_weight(linear.weight)
    r = x.abs().amax(-1, keepdim=True)                                           # (B, T, 1)
    a = ((x / r).max().clamp(min=0) - (x / r).min().clamp(max=0)) / 127
    bound = (s / 2 * x.abs().sum(-1, keepdim=True) + r * a / 2 * (s[:, None] * q.abs()).sum(1)) * (1 + 1e-4) + 1e-5
    assert ((approx - exact).abs() <= bound).all()
    assert not torch.equal(approx, Int8Linear(linear, activations="float")(x))  # it really rounds the inputs


@needs_fbgemm
def test_int8_activations_kernel_equals_the_integer_formula(monkeypatch):
    """FBGEMM's integer kernel (past KERNEL_ROWS rows, here from the first) computes
    r_m·a·s_n · Σ_k (u_mk - z) q_nk with r_m = max_k |x_mk|,
    u = clamp(round(x / r / a) + z, 0, 127), a = (max(x/r, 0) - min(x/r, 0)) / 127 and
    z = round(-min(x/r, 0) / a), written out here by hand."""
    monkeypatch.setattr(quant, "KERNEL_ROWS", 0)
    torch.manual_seed(6)
    linear = nn.Linear(96, 40, bias=False)
    layer = Int8Linear(linear)
    x = (torch.randn(7, 96) + 0.5) * torch.logspace(-1, 1, 7)[:, None]
    r = x.abs().amax(-1, keepdim=True)
    lo, hi = (x / r).min().clamp(max=0), (x / r).max().clamp(min=0)
    a = (hi - lo) / 127
    z = torch.round(-lo / a)
    u = (torch.round(x / r / a) + z).clamp(0, 127)
    formula = r * a * ((u - z) @ layer.weight.float().T) * layer.scales
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), formula, rtol=1e-4, atol=1e-4)
        xb = x.bfloat16()                                                        # bf16 in, bf16 out, same kernel
        torch.testing.assert_close(layer.to(torch.bfloat16)(xb).float(), layer.float()(xb.float()),
                                   rtol=1e-2, atol=1e-2)


needs_kernel = pytest.mark.skipif(not gemv.available(), reason=f"gemv: {gemv.unsupported() or 'not built'}")


def _kernel_formula(x, q, s, bias):
    """tformer's int8 kernel by hand: each row on its own range [lo, hi] (0 included), i = 128 / (hi - lo),
    z = round(-lo i), u = round(x i) + z in [0, 129], y = s_n (Σ_k u_k q_nk - z Σ_k q_nk) / i + b_n."""
    lo, hi = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
    i = 128 / (hi - lo)
    z = torch.round(-lo * i)
    u = torch.round(x * i) + z
    assert u.min() >= 0 and u.max() <= 129                  # 2 · 129 · 127 < 2^15: vpmaddubsw's pairs never saturate
    y = (u @ q.float().T - z * q.float().sum(1)) * s * (1 / i)
    return y if bias is None else y + bias


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_decoding_rows_take_tformers_int8_kernel(rows, bias):
    """Up to KERNEL_ROWS rows (beams x sentences), Int8Linear runs tformer's integer kernel (kernels/gemv_int8.c):
    each row rounded to 7 bits on its own range (the formula written out here), the error within |y - y_exact| <=
    (s_n / 2) Σ_k |x_k| + ((hi - lo) / 256) Σ_k s_n |q_nk|; K not a multiple of 4, N not of 16."""
    torch.manual_seed(rows)
    linear = nn.Linear(103, 37, bias=bias)
    x = torch.randn(rows, 103) * torch.logspace(-1, 1, 103) + 0.3
    layer = Int8Linear(linear)
    with torch.inference_mode():
        exact, got = linear(x), layer(x)
    q, s = quantize_weight(linear.weight)
    assert isinstance(layer.kernel, Gemv8)
    torch.testing.assert_close(got, _kernel_formula(x, q, s, linear.bias), rtol=1e-5, atol=1e-5)
    step = x.amax(-1, keepdim=True).clamp(min=0) - x.amin(-1, keepdim=True).clamp(max=0)
    bound = (s / 2 * x.abs().sum(-1, keepdim=True) + step / 256 * (s[:, None] * q.abs()).sum(1)) * (1 + 1e-4) + 1e-5
    assert ((got - exact).abs() <= bound).all()


@needs_kernel
def test_int8_kernel_keeps_a_bad_row_to_itself():
    """A NaN or an infinity in one row makes that row's outputs NaN, as the float product's would be;
    an all-zero row gives the bias."""
    linear = nn.Linear(64, 24)
    x = torch.randn(4, 64)
    x[1, 5], x[2, 7], x[3] = float("nan"), float("inf"), 0.0
    with torch.inference_mode():
        y = Int8Linear(linear)(x)
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all() and torch.isfinite(y[0]).all()
    torch.testing.assert_close(y[3], linear.bias.detach())


def test_int8_linear_takes_an_empty_batch():
    with torch.inference_mode():
        assert Int8Linear(nn.Linear(32, 16))(torch.randn(0, 5, 32)).shape == (0, 5, 16)


@needs_kernel
def test_int8_kernel_repacks_after_its_weight_changes():
    layer, other = Int8Linear(nn.Linear(32, 16)), Int8Linear(nn.Linear(32, 16))
    x = torch.randn(1, 32)
    with torch.inference_mode():
        layer(x)
        layer.load_state_dict(other.state_dict())
        torch.testing.assert_close(layer(x), other(x))


@pytest.mark.parametrize("activations", ["int8", "float"])
def test_many_rows_are_not_rounded_to_integers(activations):
    """Past INT8_MAX_ROWS rows (an encoder's tokens) the inputs are not rounded to 7 bits. Weight-only:
    the weight-only bound holds. Int8 mode on a CPU with bf16 units: x, the dequantised weight and the sum
    are rounded to bf16 (u = 2^-8 each), so the bound gains 3u·Σ_k |x_k| s_n |q_nk| (elsewhere: the
    weight-only one)."""
    from tformer.devices import native_bf16
    from tformer.inference.quant import INT8_MAX_ROWS
    torch.manual_seed(7)
    linear = nn.Linear(64, 48)
    x = torch.randn(INT8_MAX_ROWS + 1, 64) * torch.logspace(-1, 1, 64)
    with torch.inference_mode():
        exact, approx = linear(x), Int8Linear(linear, activations)(x)
    q, s = quantize_weight(linear.weight)
    bound = s / 2 * x.abs().sum(-1, keepdim=True) + 1e-5
    if activations == "int8" and native_bf16(x.device):
        u = 2.0 ** -8
        bound = bound + 3.02 * u * (x.abs() @ (s[:, None] * q.abs().float()).T + linear.bias.abs())
    assert ((approx - exact).abs() <= bound).all()


def test_int8_linear_refuses_an_unknown_activation_mode():
    with pytest.raises(ValueError, match="activations='int4'"):
        Int8Linear(nn.Linear(4, 4), activations="int4")


def test_int8_linear_repacks_after_its_weight_changes():
    """The FBGEMM copy of the weight follows the weight (load_state_dict), and a deep copy starts without one."""
    import copy
    layer = Int8Linear(nn.Linear(32, 16))
    other = Int8Linear(nn.Linear(32, 16))
    x = torch.randn(3, 32)
    with torch.inference_mode():
        layer(x)
        layer.load_state_dict(other.state_dict())
        torch.testing.assert_close(layer(x), other(x))
        assert copy.deepcopy(layer).plan is None


def _tiny_decoder():
    torch.manual_seed(3)
    cfg = tformer.preset("tiny", vocab_size=97, max_seq_len=64)
    return tformer.Decoder(cfg).eval()


def test_quantize_int8_replaces_every_linear_but_skipped_ones():
    model = quantize_int8(_tiny_decoder(), skip=("lm_head",))
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    int8 = [n for n, m in model.named_modules() if isinstance(m, Int8Linear)]
    assert linears == ["lm_head"]
    assert len(int8) == 4 * model.cfg.n_layers                                  # qkv, out, up, down per layer


def test_quantised_decoder_logits_close_and_generation_consistent():
    model = _tiny_decoder()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        ref = model(ids)
        quantize_int8(model)
        got = model(ids)
    # Every weight moves by at most half a step of 1/254 of its row's range: logits move little.
    rel = (got - ref).norm() / ref.norm()
    assert 0 < rel < 0.02
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    # The quantised model runs through the cached decode path and agrees with full recomputation.
    cached = model.generate(ids, max_new_tokens=8, eos_token_id=[])
    uncached = model.generate(ids, max_new_tokens=8, eos_token_id=[], use_cache=False)
    assert torch.equal(cached, uncached)
    assert model.new_cache(1, 8).layers[0].k.dtype == torch.float32
