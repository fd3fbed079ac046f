"""Blocks against torch.nn's Transformer layers, the FFN / norms by hand, positional encodings by formula."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tformer.kernels import gemv
from tformer.model.config import ModelConfig
from tformer.model.layers import ACTIVATIONS, DecoderLayer, EncoderLayer, FeedForward, make_norm
from tformer.model.masks import causal_mask, combine, padding_mask
from tformer.model.positional import LearnedPositions, RotaryEmbedding, SinusoidalPositions, sinusoidal_table

D, H, FF = 16, 4, 32


def cfg_for(norm_position, activation, kind="encoder"):
    return ModelConfig(kind=kind, vocab_size=10, d_model=D, n_heads=H, d_ff=FF, dropout=0.0,
                       norm_position=norm_position, activation=activation)


def copy_linear(dst: nn.Linear, weight, bias):
    dst.weight.copy_(weight)
    dst.bias.copy_(bias)


def copy_norm(dst: nn.LayerNorm, src: nn.LayerNorm):
    dst.weight.copy_(src.weight)
    dst.bias.copy_(src.bias)


def copy_mha(ours, ref: nn.MultiheadAttention, cross=False):
    if cross:
        copy_linear(ours.q_proj, ref.in_proj_weight[:D], ref.in_proj_bias[:D])
        copy_linear(ours.kv_proj, ref.in_proj_weight[D:], ref.in_proj_bias[D:])
    else:
        copy_linear(ours.qkv_proj, ref.in_proj_weight, ref.in_proj_bias)
    copy_linear(ours.out_proj, ref.out_proj.weight, ref.out_proj.bias)


def randomise(module: nn.Module):
    """Non-trivial norm weights/biases too, so a swapped norm would be caught."""
    torch.manual_seed(3)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 and p.numel() == D else 0.0))


def hf_mask(b, t):
    m = torch.ones(b, t, dtype=torch.long)
    m[0, -2:] = 0
    return m


# train() mode with dropout 0 keeps torch.nn off its inference fast path (which zeroes padded rows)
@pytest.mark.parametrize("norm_position", ["post", "pre"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_equals_torch(norm_position, activation):
    ref = nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, activation=activation, batch_first=True,
                                     norm_first=norm_position == "pre").train()
    randomise(ref)
    ours = EncoderLayer(cfg_for(norm_position, activation))
    with torch.no_grad():
        copy_mha(ours.attn, ref.self_attn)
        copy_linear(ours.ffn.up, ref.linear1.weight, ref.linear1.bias)
        copy_linear(ours.ffn.down, ref.linear2.weight, ref.linear2.bias)
        copy_norm(ours.attn_residual.norm, ref.norm1)
        copy_norm(ours.ffn_residual.norm, ref.norm2)
    x, pad = torch.randn(2, 6, D), hf_mask(2, 6)
    expected = ref(x, src_key_padding_mask=pad == 0)
    out, _ = ours(x, combine(padding_mask(pad)))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    out_w, weights = ours(x, combine(padding_mask(pad)), need_weights=True)
    torch.testing.assert_close(out_w, expected, atol=1e-5, rtol=1e-5)
    assert weights.shape == (2, H, 6, 6) and (weights[0, :, :, -2:] == 0).all()


@pytest.mark.parametrize("norm_position", ["post", "pre"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_decoder_layer_with_cross_equals_torch(norm_position, activation):
    ref = nn.TransformerDecoderLayer(D, H, FF, dropout=0.0, activation=activation, batch_first=True,
                                     norm_first=norm_position == "pre").train()
    randomise(ref)
    ours = DecoderLayer(cfg_for(norm_position, activation, "encoder-decoder"), cross=True)
    with torch.no_grad():
        copy_mha(ours.attn, ref.self_attn)
        copy_mha(ours.cross_attn, ref.multihead_attn, cross=True)
        copy_linear(ours.ffn.up, ref.linear1.weight, ref.linear1.bias)
        copy_linear(ours.ffn.down, ref.linear2.weight, ref.linear2.bias)
        copy_norm(ours.attn_residual.norm, ref.norm1)
        copy_norm(ours.cross_residual.norm, ref.norm2)
        copy_norm(ours.ffn_residual.norm, ref.norm3)
    x, memory = torch.randn(2, 5, D), torch.randn(2, 7, D)
    tgt_pad, src_pad = hf_mask(2, 5), hf_mask(2, 7)
    expected = ref(x, memory, tgt_mask=~causal_mask(5), tgt_key_padding_mask=tgt_pad == 0,
                   memory_key_padding_mask=src_pad == 0)
    mask = combine(causal_mask(5), padding_mask(tgt_pad))
    out, _, _ = ours(x, mask, memory=memory, memory_mask=combine(padding_mask(src_pad)))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # No explicit mask: the layer asks the fused kernel for plain causal attention.
    expected = ref(x, memory, tgt_mask=~causal_mask(5))
    out, _, _ = ours(x, memory=memory)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_feedforward_swiglu_by_hand():
    torch.manual_seed(0)
    ffn = FeedForward(D, FF, "swiglu", bias=False)
    assert ffn.up.weight.shape == (2 * FF, D) and ffn.up.bias is None
    w_gate, w_up = ffn.up.weight[:FF], ffn.up.weight[FF:]
    x = torch.randn(3, 4, D)
    expected = (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ ffn.down.weight.T
    torch.testing.assert_close(ffn(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("activation,fn", [("relu", F.relu), ("gelu", F.gelu), ("silu", F.silu),
                                           ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"))])
def test_feedforward_plain_by_hand(activation, fn):
    ffn = FeedForward(D, FF, activation)
    x = torch.randn(2, 3, D)
    expected = fn(x @ ffn.up.weight.T + ffn.up.bias) @ ffn.down.weight.T + ffn.down.bias
    torch.testing.assert_close(ffn(x), expected, atol=1e-5, rtol=1e-5)


def test_norm_choices_by_hand():
    x = torch.randn(2, 3, D) * 3 + 1
    rms = make_norm(ModelConfig(d_model=D, n_heads=H, norm="rmsnorm", norm_eps=1e-6))
    with torch.no_grad():
        rms.weight.copy_(torch.randn(D))
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * rms.weight
    torch.testing.assert_close(rms(x), expected, atol=1e-5, rtol=1e-5)
    assert not any(n == "bias" for n, _ in rms.named_parameters())     # RMSNorm: no mean, no bias

    ln = make_norm(ModelConfig(d_model=D, n_heads=H, norm="layernorm", norm_eps=1e-12))
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    torch.testing.assert_close(ln(x), (x - mean) / torch.sqrt(var + 1e-12), atol=1e-5, rtol=1e-5)
    assert make_norm(ModelConfig(d_model=D, n_heads=H, bias=False)).bias is None


@pytest.mark.skipif(not gemv.available(), reason="tformer's kernel library is not built here")
@pytest.mark.parametrize("shape", [(16, 128, 128), (3, 5, 37), (1, 8), (7, 771), (2, 0, 16)])
@pytest.mark.parametrize("threads", [1, 2])
def test_rmsnorm_kernel_trains_as_the_formula(shape, threads):
    """Training through tformer's RMSNorm kernel (kernels/rmsnorm.c): the output and both gradients of
    the formula in float64, on widths that are and are not whole vectors, one or more rows a thread."""
    torch.manual_seed(len(shape) + shape[-1])
    d = shape[-1]
    x = (torch.randn(*shape) * 3 + 1).requires_grad_()
    norm = make_norm(ModelConfig(d_model=d, n_heads=1, norm="rmsnorm", norm_eps=1e-6))
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d))
    g = torch.randn(*shape)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert gemv.rms_norm(x.detach(), norm.weight.detach(), 1e-6) is not None     # the kernel takes them
        y = norm(x)
        dx, dw = torch.autograd.grad(y, (x, norm.weight), g)
    finally:
        torch.set_num_threads(before)
    x64, w64 = x.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    y64 = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), g.double())
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.double(), dw64, rtol=1e-5, atol=1e-4)
    with torch.no_grad():                                                # not training: PyTorch's own
        assert torch.equal(norm(x), F.rms_norm(x, (d,), norm.weight, 1e-6))


@pytest.mark.skipif(not gemv.available(), reason="tformer's kernel library is not built here")
@pytest.mark.parametrize("n", [4 * 128 * 3072, 37, 5])
@pytest.mark.parametrize("threads", [1, 2])
def test_gelu_tanh_kernel_as_the_formula(n, threads):
    """GPT-2's GELU by tformer's kernel (kernels/gelu.c), forward and backward: within a few fp32 ulps of
    the formula in float64 — closer than PyTorch's own fp32 tanh GELU, whose error bounds the test —
    on lengths that are and are not whole vectors, and where e^(-2u) is huge or tiny (|x| up to 90)."""
    torch.manual_seed(n)
    x = torch.cat([torch.randn(n) * 4, torch.tensor([0.0, -20.0, 20.0, -90.0, 90.0, -5.0, 1e-30])])
    x = x.requires_grad_()                                                       # n + 7: a tail past the vectors
    g = torch.randn_like(x)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert gemv.gelu_tanh(x.detach()) is not None                            # the kernel takes it
        y = ACTIVATIONS["gelu_tanh"](x)
        (dx,) = torch.autograd.grad(y, x, g)
        y_torch = F.gelu(x, approximate="tanh")
        (dx_torch,) = torch.autograd.grad(y_torch, x, g)
    finally:
        torch.set_num_threads(before)
    x64 = x.detach().double().requires_grad_()
    y64 = 0.5 * x64 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3)))
    (dx64,) = torch.autograd.grad(y64, x64, g.double())
    scale = y64.abs().clamp(min=1)
    assert ((y.double() - y64).abs() / scale).max() <= max(2e-7, ((y_torch.double() - y64).abs() / scale).max())
    assert (dx.double() - dx64).abs().max() <= max(1e-6, (dx_torch.double() - dx64).abs().max())
    assert y.grad_fn is not None and "GeluTanh" in type(y.grad_fn).__name__     # through the kernel


# --- positional encodings -----------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["interleaved", "split"])
def test_sinusoidal_table_is_the_2017_formula(layout):
    n, dim = 12, 8
    table = sinusoidal_table(n, dim, layout)
    for pos in range(n):
        for i in range(dim // 2):
            angle = pos / 10000 ** (2 * i / dim)
            sin_at, cos_at = (2 * i, 2 * i + 1) if layout == "interleaved" else (i, dim // 2 + i)
            assert math.isclose(table[pos, sin_at], math.sin(angle), abs_tol=1e-6)
            assert math.isclose(table[pos, cos_at], math.cos(angle), abs_tol=1e-6)
    module = SinusoidalPositions(n, dim, layout)
    assert torch.equal(module(torch.tensor([[3, 0]])), table[[3, 0]][None])
    assert "table" not in module.state_dict()                          # a formula, not a weight


def test_learned_positions_offset():
    pos = LearnedPositions(5, 4, offset=2)
    assert pos.weight.shape == (7, 4)
    assert torch.equal(pos(torch.tensor([0, 3])), pos.weight[[2, 5]])


def test_rope_rotate_half_by_hand():
    hd, theta = 6, 10000.0
    rope = RotaryEmbedding(hd, 16, theta)
    x = torch.randn(1, 1, 3, hd)
    positions = torch.tensor([0, 5, 11])
    out = rope(x, positions)
    half = hd // 2
    for t, pos in enumerate(positions.tolist()):
        for i in range(half):
            a = pos * theta ** (-2 * i / hd)
            x1, x2 = float(x[0, 0, t, i]), float(x[0, 0, t, i + half])
            assert math.isclose(out[0, 0, t, i], x1 * math.cos(a) - x2 * math.sin(a), abs_tol=1e-5)
            assert math.isclose(out[0, 0, t, i + half], x2 * math.cos(a) + x1 * math.sin(a), abs_tol=1e-5)


def test_rope_preserves_norm_and_depends_on_relative_offset():
    torch.manual_seed(0)
    rope = RotaryEmbedding(8, 64)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    at = lambda x, p: rope(x, torch.tensor([p]))                         # noqa: E731
    for p in (0, 7, 40):
        torch.testing.assert_close(at(q, p).norm(), q.norm())
    dot = lambda m, n: float((at(q, m) * at(k, n)).sum())                # noqa: E731
    for m, n in ((3, 1), (9, 4)):
        for shift in (1, 17, 50):
            assert math.isclose(dot(m, n), dot(m + shift, n + shift), abs_tol=1e-4)
    assert not math.isclose(dot(3, 1), dot(4, 1), abs_tol=1e-3)        # but it does depend on the offset
    # Per-row positions (B, T) give the same as the shared (T,) form row by row.
    x = torch.randn(2, 2, 3, 8)
    per_row = rope(x, torch.tensor([[0, 1, 2], [4, 5, 6]]))
    torch.testing.assert_close(per_row[1], rope(x[1:], torch.tensor([4, 5, 6]))[0])
