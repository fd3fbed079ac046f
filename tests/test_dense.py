"""tformer.model.dense: training's fp32 products by oneDNN where it is faster than PyTorch's default (MKL) —
the same values and gradients as F.linear's, and F.linear wherever oneDNN does not take the tensors."""

import pytest
import torch
import torch.nn.functional as F

from tformer.model import dense
from tformer.model.linear import Linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not built in")


@pytest.fixture
def onednn(monkeypatch):
    """oneDNN for every fp32 product, whatever the timing found on this CPU."""
    monkeypatch.setattr(dense, "onednn_faster", lambda threads: True)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("weight_trains", [True, False])              # False: a frozen base (LoRA)
def test_products_and_gradients_are_f_linears(onednn, bias, weight_trains):
    torch.manual_seed(0)
    x = torch.randn(3, 17, 40, requires_grad=True)
    w = torch.randn(56, 40, requires_grad=weight_trains)
    b = torch.randn(56, requires_grad=True) if bias else None
    y = dense.linear(x, w, b)
    assert y.grad_fn is not None and type(y.grad_fn).__name__.startswith("LinearFunction")
    g = torch.randn_like(y)
    params = [p for p in (x, w, b) if p is not None and p.requires_grad]
    ours = torch.autograd.grad(y, params, g)
    expected = F.linear(x, w, b)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    for a, e in zip(ours, torch.autograd.grad(expected, params, g), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-4)
    g2 = torch.randn(9, 56)
    torch.testing.assert_close(dense.grad_input(g2, w.detach()), g2 @ w.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(dense.forward(x.detach()[0], w.detach(), b), F.linear(x.detach()[0], w.detach(), b),
                               rtol=1e-5, atol=1e-5)
    out, gx = torch.zeros(17, 80), torch.ones(9, 40)                  # by blocks of w's rows, as an int8 base runs
    dense.product_into(out[:, 10:66], x.detach()[1], w.detach())
    dense.add_grad_input(gx, g2, w.detach())
    torch.testing.assert_close(out[:, 10:66], x.detach()[1] @ w.detach().t(), rtol=1e-5, atol=1e-4)
    assert not out[:, :10].any() and not out[:, 66:].any()
    torch.testing.assert_close(gx, 1 + g2 @ w.detach(), rtol=1e-5, atol=1e-4)


def test_a_linear_layer_trains_through_it_and_infers_as_before(onednn):
    """Linear.forward with gradients goes through LinearFunction; without them (no plan) F.linear, as before."""
    torch.manual_seed(1)
    layer, x = Linear(32, 48), torch.randn(4, 32)
    assert type(layer(x).grad_fn).__name__.startswith("LinearFunction")
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_what_onednn_does_not_take_keeps_f_linear(onednn):
    """bf16 tensors and autocast (whose bf16 products are oneDNN's already) go to F.linear: under autocast the
    product comes out in bf16, as autocast's F.linear gives it."""
    x, w = torch.randn(4, 32, requires_grad=True), torch.randn(48, 32, requires_grad=True)
    assert not dense.takes(x.bfloat16(), w.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = dense.linear(x, w)
    assert y.dtype == torch.bfloat16 and not type(y.grad_fn).__name__.startswith("LinearFunction")


def test_the_timing_answers_once_per_thread_count():
    dense.onednn_faster.cache_clear()
    first = dense.onednn_faster(torch.get_num_threads())
    assert isinstance(first, bool) and dense.onednn_faster(torch.get_num_threads()) is first
    assert dense.onednn_faster.cache_info().hits >= 1


def test_the_timing_draws_nothing_from_the_global_generator():
    """The first training product of a process times oneDNN on random inputs of its own: drawn from torch's
    generator they moved a run's dropout masks, so a first forward differed from the next with the same seed."""
    dense.onednn_faster.cache_clear()
    torch.manual_seed(0)
    before = torch.get_rng_state()
    dense.onednn_faster(torch.get_num_threads())
    assert torch.equal(torch.get_rng_state(), before)
