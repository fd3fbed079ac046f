"""Training's language-model loss (model/lm_loss.py: the output layer and cross-entropy a block of rows at a
time) against PyTorch's F.cross_entropy on the whole logits: the same loss and the same gradients."""

import pytest
import torch
import torch.nn.functional as F

import tformer
from tformer.data.chat import IGNORE
from tformer.inference.quant import Int8Linear
from tformer.model import lm_loss as lm
from tformer.model.linear import Linear
from tformer.model.lora import apply_lora

TOL = dict(rtol=1e-5, atol=1e-5)


def labels(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    y = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(seed))
    y[::3] = lm.IGNORE_INDEX                                        # a third of the rows train nothing
    return y


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 7 rows of a 37-word vocabulary: 23 rows make 4 blocks, the last one shorter."""
    monkeypatch.setattr(lm, "BLOCK", 7 * 37)


@pytest.mark.parametrize("bias", [True, False])
def test_loss_and_gradients_equal_cross_entropy_of_the_whole_logits(bias, small_blocks):
    torch.manual_seed(0)
    head = Linear(16, 37, bias=bias)
    h = torch.randn(23, 16, requires_grad=True)
    y = labels(23, 37)
    ref = F.cross_entropy(head(h), y, ignore_index=-100)
    want = torch.autograd.grad(ref, [h, *head.parameters()])
    got = lm.lm_loss(h, head, y)
    assert lm.block_rows(23, 37) < 23                               # several blocks ran
    torch.testing.assert_close(got, ref, **TOL)
    for g, w in zip(torch.autograd.grad(got, [h, *head.parameters()]), want, strict=True):
        torch.testing.assert_close(g, w, **TOL)


def test_the_loss_gradient_scales_every_gradient(small_blocks):
    """loss · c (a loss weighted or averaged over micro-batches): every gradient times c, as autograd gives."""
    torch.manual_seed(1)
    head = Linear(16, 37)
    h = torch.randn(23, 16, requires_grad=True)
    y = labels(23, 37, seed=1)
    want = torch.autograd.grad(2.5 * F.cross_entropy(head(h), y), [h, head.weight, head.bias])
    got = torch.autograd.grad(2.5 * lm.lm_loss(h, head, y), [h, head.weight, head.bias])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)


def test_a_frozen_head_gives_the_hidden_states_gradient_only(small_blocks):
    torch.manual_seed(2)
    head = Linear(16, 37).requires_grad_(False)
    h = torch.randn(23, 16, requires_grad=True)
    y = labels(23, 37, seed=2)
    (want,) = torch.autograd.grad(F.cross_entropy(head(h), y), [h])
    lm.lm_loss(h, head, y).backward()
    torch.testing.assert_close(h.grad, want, **TOL)
    assert head.weight.grad is None and head.bias.grad is None


def test_every_row_ignored_gives_nan_and_zero_gradients_as_pytorch():
    head = Linear(8, 11)
    h = torch.randn(5, 8, requires_grad=True)
    y = torch.full((5,), lm.IGNORE_INDEX)
    ref = F.cross_entropy(head(h), y)
    (want,) = torch.autograd.grad(ref, [h])
    got = lm.lm_loss(h, head, y)
    assert torch.isnan(ref) and torch.isnan(got)
    assert torch.equal(torch.autograd.grad(got, [h])[0], want)


def test_without_gradients_it_gives_the_loss_alone():
    head = Linear(8, 11)
    h = torch.randn(2, 5, 8, requires_grad=True)
    y = torch.randint(0, 11, (2, 5))
    with torch.no_grad():
        got = lm.lm_loss(h, head, y)
        ref = F.cross_entropy(head(h).flatten(0, 1), y.flatten())
    assert not got.requires_grad
    torch.testing.assert_close(got, ref, **TOL)


def test_decoder_labels_give_the_cross_entropy_of_its_logits(small_blocks):
    """forward(labels=) of a tied GPT (the output layer is the token embedding) with a padding mask and
    positions, as SFT calls it: the loss and every parameter's gradient of F.cross_entropy(model(...))."""
    torch.manual_seed(3)
    model = tformer.Decoder(tformer.preset("tiny", vocab_size=37, max_seq_len=32)).train()
    assert model.lm_head.weight is model.stack.embed.token.weight
    ids = torch.randint(0, 37, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    positions = torch.arange(9).expand(2, 9)
    y = labels(18, 37, seed=3).view(2, 9)
    ref = F.cross_entropy(model(ids, mask, positions).flatten(0, 1), y.flatten())
    want = torch.autograd.grad(ref, list(model.parameters()))
    got = model(ids, mask, positions, labels=y)
    torch.testing.assert_close(got, ref, **TOL)
    for (name, _), g, w in zip(model.named_parameters(), torch.autograd.grad(got, list(model.parameters())), want,
                               strict=True):
        torch.testing.assert_close(g, w, **TOL, msg=name)


@pytest.mark.parametrize("targets", [("qkv",), ("qkv", "lm_head")])
def test_lora_trains_the_adapters_as_with_the_whole_logits(targets, small_blocks):
    """LoRA: a frozen output layer; adapters on it too (that layer then runs whole, its adapters included)."""
    torch.manual_seed(4)
    model = apply_lora(tformer.Decoder(tformer.preset("tiny", vocab_size=37, max_seq_len=32)), 4, 8, targets=targets)
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)                          # B = 0 would give A no gradient
    ids, y = torch.randint(0, 37, (2, 9)), torch.randint(0, 37, (2, 9))
    trained = [p for p in model.parameters() if p.requires_grad]
    ref = F.cross_entropy(model(ids).flatten(0, 1), y.flatten())
    want = torch.autograd.grad(ref, trained)
    got = model(ids, labels=y)
    torch.testing.assert_close(got, ref, **TOL)
    for g, w in zip(torch.autograd.grad(got, trained), want, strict=True):
        torch.testing.assert_close(g, w, **TOL)


def test_an_int8_head_gives_the_loss_of_its_dequantised_weight(small_blocks):
    torch.manual_seed(5)
    head = Int8Linear(torch.nn.Linear(16, 37))
    w = head.weight.float() * head.scales[:, None]                      # s_n · q_nk
    h = torch.randn(23, 16, requires_grad=True)
    y = labels(23, 37, seed=5)
    ref = F.cross_entropy(F.linear(h, w, head.bias), y)
    (want,) = torch.autograd.grad(ref, [h])
    got = lm.lm_loss(h, head, y)
    torch.testing.assert_close(got, ref, **TOL)
    torch.testing.assert_close(torch.autograd.grad(got, [h])[0], want, **TOL)


def test_bf16_autocast_gives_autocasts_loss_and_gradients(small_blocks):
    """Under bf16 autocast (`tformer train` on a CPU with bf16 units) the logits are bf16 products, as
    autocast makes F.linear's, and the cross-entropy is taken in fp32 as the tasks took it (.float())."""
    torch.manual_seed(6)
    head = Linear(16, 37)
    h = torch.randn(23, 16, requires_grad=True)
    y = labels(23, 37, seed=6)
    params = [h, head.weight, head.bias]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(head(h).float(), y)
        got = lm.lm_loss(h, head, y)
    torch.testing.assert_close(got, ref, **TOL)
    for g, w in zip(torch.autograd.grad(got, params), torch.autograd.grad(ref, params), strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-3)        # bf16 products (8 significant bits)


def test_the_sft_labels_ignore_what_the_loss_ignores():
    assert IGNORE == lm.IGNORE_INDEX
