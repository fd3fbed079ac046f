"""Training through LoRA layers and frozen int8 layers (model/lora_adapter.py's autograd Function): the
same values and gradients as autograd gives op by op on the formula, and no fp32 copy of an int8 weight
kept for the backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import tformer
from tformer.inference import quant
from tformer.inference.quant import Int8Linear, quantize_int8
from tformer.model.lora import apply_lora, lora_layers, lora_state_dict


def reference(layer, x, base_weight, base_bias):
    """y = x Wᵀ + b + Σ s·B A dropout(x) in its rows, op by op (autograd's own gradients)."""
    y = F.linear(x, base_weight, base_bias)
    parts = []
    for adapter in layer.lora.values():
        d = F.linear(F.linear(adapter.dropout(x), adapter.a), adapter.b) * adapter.scaling
        parts.append(F.pad(d, (adapter.start, y.size(-1) - adapter.stop)))
    return y + sum(parts)


def grads(out, tensors, seed=0):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, tensors, g, allow_unused=True)


@pytest.mark.parametrize("targets, alpha, dropout, train_base", [
    (("q", "v"), 6.0, 0.0, False),       # two adapters on row ranges, s = 2
    (("qkv",), 3.0, 0.0, False),         # every row, s = 1.5 (not a power of two)
    (("k", "v"), 4.0, 0.25, False),      # dropout on each adapter's input
    (("q",), 2.0, 0.0, True),            # the base's W and b train too
])
def test_lora_layer_matches_autograd_on_the_formula(targets, alpha, dropout, train_base):
    torch.manual_seed(0)
    cfg = tformer.ModelConfig(vocab_size=30, d_model=32, n_heads=4, n_layers=1, max_seq_len=16, n_kv_heads=2)
    model = apply_lora(tformer.Decoder(cfg), r=2, alpha=alpha, dropout=dropout, targets=targets).train()
    layer = model.stack.layers[0].attn.qkv_proj
    for adapter in layer.lora.values():
        torch.nn.init.normal_(adapter.b)
    layer.weight.requires_grad_(train_base)
    layer.bias.requires_grad_(train_base)
    x = torch.randn(3, 5, 32, requires_grad=True)
    params = [p for a in layer.lora.values() for p in (a.a, a.b)] + ([layer.weight, layer.bias] if train_base else [])
    torch.manual_seed(1)
    want = reference(layer, x, layer.weight, layer.bias)
    torch.manual_seed(1)                         # the same dropout masks, drawn in the same order
    got = layer(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(grads(got, [x, *params]), grads(want, [x, *params])):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    layer.eval()
    with torch.no_grad():                        # the inference path (in place, no Function) agrees
        torch.testing.assert_close(layer(x), reference(layer, x, layer.weight, layer.bias), rtol=1e-6, atol=1e-6)


def test_an_input_that_needs_no_gradient_still_trains_the_adapter():
    torch.manual_seed(0)
    cfg = tformer.ModelConfig(vocab_size=30, d_model=16, n_heads=2, n_layers=1, max_seq_len=16)
    layer = apply_lora(tformer.Decoder(cfg), r=2, alpha=4, targets=("qkv",)).stack.layers[0].attn.qkv_proj
    torch.nn.init.normal_(layer.lora["qkv"].b)
    x = torch.randn(4, 16)                       # frozen embeddings upstream: no gradient wanted for x
    a = layer.lora["qkv"]
    got = grads(layer(x), [a.a, a.b])
    want = grads(reference(layer, x, layer.weight, layer.bias), [a.a, a.b])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk", [quant.CHUNK, 5 * 16])   # one block, and 5 rows of W at a time (7 blocks)
def test_a_frozen_int8_layer_trains_through_its_dequantised_weight_and_keeps_none(chunk, monkeypatch):
    monkeypatch.setattr(quant, "CHUNK", chunk)
    torch.manual_seed(0)
    layer = Int8Linear(torch.nn.Linear(16, 33))
    deq = layer.weight.float() * layer.scales[:, None]                 # s_n q_nk, by hand
    x = torch.randn(2, 7, 16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        got = layer(x)
    assert not any(t.is_floating_point() and t.numel() >= deq.numel() for t in saved)   # no fp32 W for backward
    want = F.linear(x, deq, layer.bias)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads(got, [x])[0], grads(want, [x])[0], rtol=1e-5, atol=1e-6)


def test_a_frozen_int8_layer_under_autocast_multiplies_in_the_autocast_dtype():
    """As F.linear on the dequantised weight under bf16 autocast: a bf16 output (bf16 products, not fp32 ones),
    and x's gradient in x's own dtype."""
    torch.manual_seed(0)
    layer = Int8Linear(torch.nn.Linear(64, 48))
    deq = layer.weight.float() * layer.scales[:, None]
    x = torch.randn(2, 7, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = layer(x), F.linear(x, deq, layer.bias)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(0)).bfloat16()
    gx, wx = (torch.autograd.grad(y, [x], g)[0] for y in (got, want))
    assert gx.dtype == wx.dtype == torch.float32
    torch.testing.assert_close(gx, wx, rtol=2e-2, atol=2e-2)


def test_lora_on_an_int8_model_gets_the_gradients_of_its_dequantised_twin(monkeypatch):
    """The whole model: an int8 decoder with adapters against its fp32 twin whose linear weights are s_n q_nk
    (weight-only, as training computes; embeddings as they were), with the same adapters."""
    monkeypatch.setattr(quant, "CHUNK", 64)                  # several blocks per layer
    torch.manual_seed(0)
    twin = tformer.Decoder(tformer.ModelConfig(vocab_size=40, d_model=32, n_heads=4, n_layers=2, max_seq_len=16))
    int8 = quantize_int8(copy.deepcopy(twin))
    for name, m in int8.named_modules():
        if isinstance(m, Int8Linear):                        # (the output layer is untied from the embedding)
            twin.get_submodule(name).weight = torch.nn.Parameter(m.weight.float() * m.scales[:, None])
    models = [apply_lora(m, r=2, alpha=4, targets=("v", "o", "lm_head")).train() for m in (int8, twin)]
    for layer in lora_layers(int8).values():
        for a in layer.lora.values():
            torch.nn.init.normal_(a.b)
    twin.load_state_dict(lora_state_dict(int8), strict=False)
    ids = torch.randint(0, 40, (2, 9))
    losses = [F.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()) for m in models]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    for loss in losses:
        loss.backward()
    got, want = (lora_state_dict(m) for m in models)
    assert got.keys() == want.keys()
    for name in got:
        param = [dict(m.named_parameters())[name] for m in models]
        torch.testing.assert_close(param[0].grad, param[1].grad, rtol=1e-4, atol=1e-5, msg=name)
