"""tformer's dropout: the rate, the 1/(1-p) scaling, the gradient, determinism, and nn.Dropout's contract,
through tformer's kernel (kernels/dropout.c) and through PyTorch's ops (where the kernel is not built)."""

import pytest
import torch

import tformer.model.dropout as module
from tformer.kernels.build import function
from tformer.model.dropout import Dropout, dropout


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def path(request, monkeypatch):
    if request.param == "kernel" and function("tformer_dropout") is None:
        pytest.skip("tformer's kernel library is not built here")
    if request.param == "torch":
        monkeypatch.setattr(module, "function", lambda name: None)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_survivors_are_scaled_as_pytorch_scales_them_and_the_gradient_takes_the_same_mask(dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 1000, 37, dtype=dtype, requires_grad=True)            # not a multiple of 4 or 1,024
    y = dropout(x, 0.3)
    kept = y != 0
    assert y.dtype == dtype and 0.69 < kept.float().mean().item() < 0.71
    assert torch.equal(y[kept], x[kept] * (1 / 0.7))                         # PyTorch's product, its rounding
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(x.grad, g * kept * (1 / 0.7))


def test_the_mask_depends_on_the_seed_not_on_the_threads():
    x, threads = torch.randn(100_003), torch.get_num_threads()
    torch.manual_seed(7)
    a = dropout(x, 0.5)
    torch.set_num_threads(1)
    try:
        torch.manual_seed(7)
        b = dropout(x, 0.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(a, b)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keeps_each_element_with_probability_one_minus_p(p):
    torch.manual_seed(0)
    x = torch.ones(200_000)
    y = dropout(x, p)
    kept = (y != 0).float().mean().item()
    sigma = (p * (1 - p) / x.numel()) ** 0.5
    assert abs(kept - (1 - p)) < 5 * sigma + 1 / 32768           # 5 standard errors + the rounding of p
    torch.testing.assert_close(y[y != 0], torch.full_like(y[y != 0], 1 / (1 - p)))   # survivors scaled


def test_masks_are_independent_across_positions_and_calls():
    """No lane of the 4-per-draw packing is correlated with another, nor one call with the next."""
    torch.manual_seed(0)
    a = dropout(torch.ones(400_000), 0.5) != 0
    b = dropout(torch.ones(400_000), 0.5) != 0
    for lag in (1, 2, 3, 4):
        agree = (a[lag:] == a[:-lag]).float().mean().item()
        assert abs(agree - 0.5) < 0.005, lag
    assert abs((a == b).float().mean().item() - 0.5) < 0.005


def test_gradient_is_the_same_mask_and_scale():
    torch.manual_seed(0)
    x = torch.randn(64, 33, dtype=torch.bfloat16, requires_grad=True)
    y = dropout(x, 0.25)
    y.backward(torch.ones_like(y))
    expected = (y != 0).to(x.dtype) / 0.75
    torch.testing.assert_close(x.grad, expected)


def test_seeded_and_off_in_eval_or_at_zero():
    x = torch.randn(1000)
    torch.manual_seed(3)
    a = dropout(x, 0.3)
    torch.manual_seed(3)
    assert torch.equal(a, dropout(x, 0.3))
    assert dropout(x, 0.3, training=False) is x and dropout(x, 0.0) is x
    m = Dropout(0.3).eval()
    assert m(x) is x and isinstance(m, torch.nn.Dropout) and not m.state_dict()


def test_expected_value_matches_nn_dropout():
    """Same distribution as torch's own: mean preserved, same variance of the output (p (1-p) / (1-p)^2)."""
    torch.manual_seed(0)
    x = torch.ones(400_000)
    ours, theirs = dropout(x, 0.2), torch.nn.functional.dropout(x, 0.2)
    for y in (ours, theirs):
        assert abs(y.mean().item() - 1.0) < 0.01
        assert abs(y.var().item() - 0.2 / 0.8) < 0.01
