"""attention(): the seeds' element-wise formula; fused == reference; MultiHeadAttention == torch.nn."""

import math

import pytest
import torch
from torch import nn

from tformer.model.attention import MultiHeadAttention, attention, fused_attention, unfused_attention
from tformer.model.masks import causal_mask, combine, padding_mask


def hand_attention(q, k, v, allowed, bias=None, scale=None):
    """s_ij = q_i·k_j/√d_k (+ b_ij); α_ij = exp(s_ij)/Σ_j' exp(s_ij') over allowed keys; o_i = Σ_j α_ij v_j.
    Plain Python loops over one head; `allowed[i][j]` is True where query i may see key j."""
    t_q, t_k, d_k = q.shape[0], k.shape[0], q.shape[1]
    scale = 1 / math.sqrt(d_k) if scale is None else scale
    out = torch.zeros(t_q, v.shape[1], dtype=torch.float64)
    alpha = torch.zeros(t_q, t_k, dtype=torch.float64)
    for i in range(t_q):
        s = {j: sum(float(q[i, c]) * float(k[j, c]) for c in range(d_k)) * scale
             + (float(bias[i][j]) if bias is not None else 0.0)
             for j in range(t_k) if allowed[i][j]}
        z = sum(math.exp(x) for x in s.values())
        for j, x in s.items():
            alpha[i, j] = math.exp(x) / z
            out[i] += alpha[i, j] * v[j].double()
    return out, alpha


def qkv(b=2, h=3, h_kv=None, t_q=5, t_k=5, hd=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    h_kv = h_kv or h
    return (torch.randn(b, h, t_q, hd, generator=g), torch.randn(b, h_kv, t_k, hd, generator=g),
            torch.randn(b, h_kv, t_k, hd, generator=g))


@pytest.mark.parametrize("causal", [False, True])
def test_reference_equals_hand_formula(causal):
    q, k, v = qkv(b=1, h=2, t_q=4, t_k=6, hd=3)
    mask = causal_mask(4, 6) if causal else None
    out, alpha = attention(q, k, v, mask, return_weights=True)
    allowed = mask.tolist() if causal else [[True] * 6] * 4
    for head in range(2):
        o_hand, a_hand = hand_attention(q[0, head], k[0, head], v[0, head], allowed)
        torch.testing.assert_close(alpha[0, head].double(), a_hand, atol=1e-6, rtol=0)
        torch.testing.assert_close(out[0, head].double(), o_hand, atol=1e-6, rtol=0)


def test_bias_and_scale_enter_the_hand_formula():
    """T5's attention: s_ij = q_i·k_j + b_ij (no 1/√d_k), causal."""
    q, k, v = qkv(b=1, h=2, t_q=4, t_k=6, hd=3)
    bias = torch.randn(1, 2, 4, 6, generator=torch.Generator().manual_seed(1))
    out, alpha = attention(q, k, v, is_causal=True, return_weights=True, bias=bias, scale=1.0)
    allowed = causal_mask(4, 6).tolist()
    for head in range(2):
        o_hand, a_hand = hand_attention(q[0, head], k[0, head], v[0, head], allowed, bias[0, head], scale=1.0)
        torch.testing.assert_close(alpha[0, head].double(), a_hand, atol=1e-6, rtol=0)
        torch.testing.assert_close(out[0, head].double(), o_hand, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["none", "causal", "padding", "combined", "is_causal"])
def test_fused_and_unfused_equal_reference_with_a_bias(kind):
    q, k, v = qkv(b=2, h=3, t_q=6, t_k=6, hd=8)
    mask = masks_for(2, 6).get(kind)
    bias = torch.randn(1, 3, 6, 6, generator=torch.Generator().manual_seed(2))
    bias.requires_grad_()                                             # T5 learns its bias table through it
    kw = dict(is_causal=kind == "is_causal", bias=bias, scale=0.5)
    ref = attention(q, k, v, mask, **kw)
    (ref_grad,) = torch.autograd.grad(ref.pow(2).sum(), bias)
    for path in (fused_attention, unfused_attention):
        out = path(q, k, v, mask, **kw)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.autograd.grad(out.pow(2).sum(), bias)[0], ref_grad, atol=1e-5, rtol=0)


def masks_for(b, t):
    hf = torch.ones(b, t, dtype=torch.long)
    hf[0, -2:] = 0                                                    # right padding in row 0
    hf[1, :1] = 0                                                     # left padding in row 1
    return {"none": None, "causal": causal_mask(t), "padding": combine(padding_mask(hf)),
            "combined": combine(causal_mask(t), padding_mask(hf))}


@pytest.mark.parametrize("kind", ["none", "causal", "padding", "combined"])
@pytest.mark.parametrize("h_kv", [3, 1])
def test_fused_equals_reference(kind, h_kv):
    q, k, v = qkv(b=2, h=3, h_kv=h_kv, t_q=6, t_k=6, hd=8)
    mask = masks_for(2, 6)[kind]
    torch.testing.assert_close(fused_attention(q, k, v, mask), attention(q, k, v, mask), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["none", "causal", "padding", "combined"])
@pytest.mark.parametrize("h_kv", [3, 1])
def test_unfused_equals_reference_values_and_gradients(kind, h_kv):
    """The bf16 training path: same outputs and gradients as the reference, in fp32 and in bf16."""
    mask = masks_for(2, 6)[kind]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        q, k, v = (t.to(dtype).requires_grad_() for t in qkv(b=2, h=3, h_kv=h_kv, t_q=6, t_k=6, hd=8))
        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
        out = unfused_attention(q, k, v, mask, is_causal=kind == "none")
        ref = attention(q32, k32, v32, mask, is_causal=kind == "none")
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=0)
        grad = torch.randn_like(ref)
        out.backward(grad.to(dtype))
        ref.backward(grad)
        for ours, theirs in ((q, q32), (k, k32), (v, v32)):
            torch.testing.assert_close(ours.grad.float(), theirs.grad, atol=4 * tol, rtol=0)


def test_multihead_trains_through_the_unfused_path_in_bf16():
    """Under bf16 autocast with gradients on a CPU, MultiHeadAttention takes unfused_attention; its
    output matches the fused path within bf16 rounding."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4)
    x = torch.randn(2, 7, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trained, _ = mha(x, is_causal=True)
        with torch.no_grad():
            fused, _ = mha(x, is_causal=True)
    torch.testing.assert_close(trained.float(), fused.float(), atol=3e-2, rtol=0)


def test_is_causal_flag_equals_explicit_mask():
    q, k, v = qkv(t_q=5, t_k=5)
    expected = attention(q, k, v, causal_mask(5))
    torch.testing.assert_close(attention(q, k, v, is_causal=True), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(fused_attention(q, k, v, is_causal=True), expected, atol=1e-5, rtol=0)


def test_gqa_equals_repeated_heads():
    """Grouped-query attention = ordinary attention with each K/V head copied to its group of Q heads."""
    q, k, v = qkv(h=4, h_kv=2)
    k_full, v_full = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(attention(q, k, v), attention(q, k_full, v_full))
    torch.testing.assert_close(fused_attention(q, k, v), attention(q, k_full, v_full), atol=1e-5, rtol=0)


def test_fully_padded_rows_give_no_nan():
    q, k, v = qkv(b=2, t_q=4, t_k=4)
    hf = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]])                  # row 1: nothing to attend to at all
    mask = combine(causal_mask(4), padding_mask(hf))
    for out in (attention(q, k, v, mask), fused_attention(q, k, v, mask)):
        assert not out.isnan().any()
    # The raw reference formula with a fully masked row (no combine) still gives zeros, not NaN.
    raw = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    out, alpha = attention(q, k, v, raw, return_weights=True)
    assert not out.isnan().any() and (alpha == 0).all()


# --- MultiHeadAttention vs torch.nn.MultiheadAttention -----------------------------------------

def copy_from_nn(ours: MultiHeadAttention, ref: nn.MultiheadAttention) -> None:
    d = ref.embed_dim
    with torch.no_grad():
        if ours.cross:
            ours.q_proj.weight.copy_(ref.in_proj_weight[:d])
            ours.q_proj.bias.copy_(ref.in_proj_bias[:d])
            ours.kv_proj.weight.copy_(ref.in_proj_weight[d:])
            ours.kv_proj.bias.copy_(ref.in_proj_bias[d:])
        else:
            ours.qkv_proj.weight.copy_(ref.in_proj_weight)
            ours.qkv_proj.bias.copy_(ref.in_proj_bias)
        ours.out_proj.weight.copy_(ref.out_proj.weight)
        ours.out_proj.bias.copy_(ref.out_proj.bias)


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_equals_torch_nn(cross, need_weights):
    torch.manual_seed(0)
    d, h, b, t, s = 16, 4, 3, 5, 7
    ref = nn.MultiheadAttention(d, h, batch_first=True).eval()
    ours = MultiHeadAttention(d, h, cross=cross).eval()
    copy_from_nn(ours, ref)
    x = torch.randn(b, t, d)
    ctx = torch.randn(b, s, d) if cross else x
    t_k = ctx.size(1)
    hf = torch.ones(b, t_k, dtype=torch.long)
    hf[1, -3:] = 0
    hf[2, :2] = 0
    if cross:                                         # cross-attention: key padding only
        mask = padding_mask(hf)
        nn_kwargs = dict(key_padding_mask=hf == 0)
    else:                                             # self-attention: causal AND key padding
        hf[2, :2] = 1                                 # keep every query row with at least one key
        mask = combine(causal_mask(t), padding_mask(hf))
        nn_kwargs = dict(key_padding_mask=hf == 0, attn_mask=~causal_mask(t))  # nn: True = masked out
    expected, expected_w = ref(x, ctx, ctx, average_attn_weights=False, **nn_kwargs)
    out, weights = ours(x, context=ctx if cross else None, mask=mask, need_weights=need_weights)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    if need_weights:
        torch.testing.assert_close(weights, expected_w, atol=1e-6, rtol=0)
    else:
        assert weights is None


@pytest.mark.parametrize("need_weights", [False, True])
def test_cross_attention_of_beams_equals_torch_nn_on_the_repeated_context(need_weights):
    """Beams of one source share its context: x has c rows per context row (beam search passes the
    encoder output once per source). Same result as torch.nn given the context repeated per beam."""
    torch.manual_seed(2)
    d, h, b, c, t, s = 16, 4, 2, 3, 2, 6
    ref = nn.MultiheadAttention(d, h, batch_first=True).eval()
    ours = MultiHeadAttention(d, h, cross=True).eval()
    copy_from_nn(ours, ref)
    x, ctx = torch.randn(b * c, t, d), torch.randn(b, s, d)
    keep = torch.ones(b, s, dtype=torch.long)
    keep[1, -2:] = 0
    expected, expected_w = ref(x, ctx.repeat_interleave(c, 0), ctx.repeat_interleave(c, 0),
                               key_padding_mask=keep.repeat_interleave(c, 0) == 0, average_attn_weights=False)
    out, weights = ours(x, context=ctx, mask=padding_mask(keep), need_weights=need_weights)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    if need_weights:
        torch.testing.assert_close(weights, expected_w, atol=1e-6, rtol=0)


def test_multihead_no_mask_and_is_causal():
    torch.manual_seed(1)
    ref = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    ours = MultiHeadAttention(8, 2).eval()
    copy_from_nn(ours, ref)
    x = torch.randn(2, 6, 8)
    torch.testing.assert_close(ours(x)[0], ref(x, x, x)[0], atol=1e-5, rtol=0)
    causal = ref(x, x, x, attn_mask=~causal_mask(6))[0]
    torch.testing.assert_close(ours(x, is_causal=True)[0], causal, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours(x, is_causal=True, need_weights=True)[0], causal, atol=1e-5, rtol=0)


def test_multihead_gqa_shapes_and_projection_sizes():
    mha = MultiHeadAttention(16, 4, n_kv_heads=2)
    assert mha.qkv_proj.out_features == 16 + 2 * 8                  # Q: 4 heads, K and V: 2 heads of size 4
    out, w = mha(torch.randn(2, 3, 16), need_weights=True)
    assert out.shape == (2, 3, 16) and w.shape == (2, 4, 3, 3)


def test_decoding_steps_of_a_batch_take_the_unfused_path_and_equal_torch_nn(monkeypatch):
    """A decoding step of many rows x heads (decoding_a_batch): self-attention of one new token over a
    left-padded cache, and cross-attention of 4 beams per source; both equal torch.nn on full inputs."""
    import sys

    from tformer.model.kv_cache import KVCache
    A = sys.modules["tformer.model.attention"]
    calls = []
    monkeypatch.setattr(A, "unfused_attention", lambda *a, **k: calls.append(1) or unfused_attention(*a, **k))
    torch.manual_seed(3)
    d, h, b, t = 32, 8, 32, 6
    ref = nn.MultiheadAttention(d, h, batch_first=True).eval()
    ours = MultiHeadAttention(d, h).eval()
    copy_from_nn(ours, ref)
    x = torch.randn(b, t, d)
    keep = torch.ones(b, t, dtype=torch.long)
    keep[3, :2] = 0                                              # left padding in one row
    with torch.no_grad():
        expected, _ = ref(x, x, x, key_padding_mask=keep == 0, attn_mask=~causal_mask(t))
        cache = KVCache(b, h, t + 2, d // h)
        ours(x[:, :-1], cache=cache, mask=combine(causal_mask(t - 1), padding_mask(keep[:, :-1])))
        assert not calls                                         # the prompt: the fused kernel
        step, _ = ours(x[:, -1:], cache=cache, mask=padding_mask(keep)[:, :, :, :t])
    assert calls == [1]
    torch.testing.assert_close(step[:, 0], expected[:, -1], atol=1e-5, rtol=0)

    cross = MultiHeadAttention(d, h, cross=True).eval()
    copy_from_nn(cross, ref)
    beams, ctx = 4, torch.randn(b, 5, d)
    y = torch.randn(b * beams, 1, d)
    with torch.no_grad():
        expected, _ = ref(y, ctx.repeat_interleave(beams, 0), ctx.repeat_interleave(beams, 0))
        out, _ = cross(y, context=ctx)
    assert calls == [1, 1]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("in_place", [False, True])
def test_cache_reorder_keeps_the_chosen_rows_step_after_step(monkeypatch, in_place):
    """Copied into the spare buffers (no decoding kernel), or recorded in the lineage (with it)."""
    from tformer.kernels import gemv
    from tformer.model.kv_cache import KVCache, follow_lineage
    if in_place and not gemv.available():
        pytest.skip("the decoding kernel is not built here")
    monkeypatch.setattr(gemv, "available", lambda: in_place)
    torch.manual_seed(4)
    cache, rows = KVCache(4, 2, 6, 3), []
    for step in range(4):
        k, v = torch.randn(4, 2, 1, 3), torch.randn(4, 2, 1, 3)
        rows = [torch.cat([r, n], dim=2) for r, n in zip(rows, (k, v))] if rows else [k, v]
        cache.update(k, v)
        index = torch.randint(0, 4, (4,))
        cache.reorder(index)
        rows = [r.index_select(0, index) for r in rows]
        keys, values = cache.k[:, :, :step + 1], cache.v[:, :, :step + 1]
        assert (cache.lineage is not None) == in_place
        if in_place:
            keys, values = follow_lineage(keys, values, cache.lineage[:, :step + 1])
        assert torch.equal(keys, rows[0]) and torch.equal(values, rows[1])
    cache.reorder(torch.tensor([2, 0]))                           # fewer rows: a plain gather
    assert cache.k.shape[0] == 2 and torch.equal(cache.k[:, :, :4], rows[0][[2, 0]])
