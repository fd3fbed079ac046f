"""quantize_int8 from any dtype: a bf16 model quantises (int8 activations, on a CPU) to the very model its fp32
copy gives — the same modules, tensors, dtypes and outputs, and the same fast decoding path (the fused GPT
step), where a bf16 model kept in bf16 around its int8 layers took none of it. An encoder on a CPU with bf16
units comes out in bf16 around its int8 layers (it never decodes; its products of many rows are bf16 anyway)."""

import copy

import pytest
import torch

import tformer
from tformer.devices import native_bf16
from tformer.inference import int8_plans
from tformer.inference.int8_plans import dynamic_int8_available
from tformer.inference.quant import INT8_MAX_ROWS, Int8Linear, quantize_int8
from tformer.kernels import gemv

pytestmark = pytest.mark.skipif(not dynamic_int8_available(), reason="no FBGEMM in this PyTorch build")

SMALL = dict(vocab_size=1000, d_model=128, n_heads=4, n_layers=2, d_ff=512, max_seq_len=64)
KINDS = {
    "decoder": lambda: tformer.Decoder(tformer.preset("gpt2-small", **SMALL)),                  # GPT-2's block
    "encoder-decoder": lambda: tformer.EncoderDecoder(tformer.preset("transformer-base", **SMALL, dropout=0.0,
                                                                     pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "encoder": lambda: tformer.Encoder(tformer.preset("bert-base", **SMALL)),
}


def bf16_and_its_fp32_copy(kind: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    bf16 = KINDS[kind]().to(torch.bfloat16).eval()
    return bf16, copy.deepcopy(bf16).float()                     # the same weights, rounded to bf16, in fp32


def outputs(model: torch.nn.Module, kind: str) -> torch.Tensor:
    ids = torch.randint(3, 1000, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        if kind == "encoder":
            return model(ids)
        return model.generate(ids, max_new_tokens=10, eos_token_id=[])                      # greedy


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_bf16_model_quantises_to_the_model_its_fp32_copy_gives(kind):
    bf16, fp32 = bf16_and_its_fp32_copy(kind)
    from_bf16, from_fp32 = quantize_int8(bf16), quantize_int8(fp32)
    assert [(n, type(m)) for n, m in from_bf16.named_modules()] == [(n, type(m)) for n, m in from_fp32.named_modules()]
    assert any(isinstance(m, Int8Linear) for m in from_bf16.modules())
    ours, theirs = from_bf16.state_dict(), from_fp32.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name
    rest = torch.bfloat16 if kind == "encoder" and native_bf16(torch.device("cpu")) else torch.float32
    int8 = {id(t) for m in from_bf16.modules() if isinstance(m, Int8Linear) for t in m.buffers()}
    floats = {t.dtype for t in [*from_bf16.parameters(), *from_bf16.buffers()] if t.is_floating_point()
              and id(t) not in int8}
    assert floats == {rest}                                      # norms, embeddings
    assert {m.scales.dtype for m in from_bf16.modules() if isinstance(m, Int8Linear)} == {torch.float32}
    assert torch.equal(outputs(from_bf16, kind), outputs(from_fp32, kind))


@pytest.mark.skipif(not gemv.available(), reason=f"gemv: {gemv.unsupported() or 'not built'}")
def test_a_bf16_gpt_quantised_decodes_through_the_fused_step(monkeypatch):
    calls = []
    original = gemv.gpt_step
    monkeypatch.setattr(gemv, "gpt_step", lambda *a: calls.append(1) or original(*a))
    bf16, _ = bf16_and_its_fp32_copy("decoder")
    outputs(quantize_int8(bf16), "decoder")
    assert len(calls) >= 9                                       # every step after the prompt's


def test_weight_only_int8_keeps_the_models_dtype():
    """activations="float": PyTorch's weight-only kernel multiplies bf16 inputs by int8 weights (fast with
    AVX-512), so the model stays bf16 around them."""
    bf16, _ = bf16_and_its_fp32_copy("decoder")
    model = quantize_int8(bf16, activations="float")
    assert model.lm_head.scales.dtype == torch.bfloat16 and model.stack.embed.token.weight.dtype == torch.bfloat16


def test_an_int8_encoder_in_bf16_is_the_fp32_one_within_bf16s_rounding(monkeypatch):
    """dtype=None (bf16 for an encoder on a CPU with bf16 units) against dtype=fp32 on the same weights: the
    same int8 weights and scales; hidden states of a batch of more than INT8_MAX_ROWS tokens within what
    rounding the activations to bf16 explains (the products of both multiply in bf16: WideBf16)."""
    torch.manual_seed(0)
    fp32 = KINDS["encoder"]().eval()
    chosen, in_fp32 = quantize_int8(copy.deepcopy(fp32)), quantize_int8(copy.deepcopy(fp32), dtype=torch.float32)
    assert {t.dtype for t in in_fp32.parameters()} == {torch.float32}
    def int8_tensors(model):
        return {k: v for k, v in model.state_dict().items() if not v.is_floating_point() or "scales" in k}

    assert all(torch.equal(v, int8_tensors(in_fp32)[k]) for k, v in int8_tensors(chosen).items())
    calls = []
    original = int8_plans.WideBf16.__call__
    monkeypatch.setattr(int8_plans.WideBf16, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
    ids = torch.randint(3, 1000, (8, 40), generator=torch.Generator().manual_seed(1))      # 320 > INT8_MAX_ROWS
    assert ids.numel() > INT8_MAX_ROWS
    with torch.inference_mode():
        ours, reference = chosen(ids).float(), in_fp32(ids)
    assert bool(calls) == native_bf16(torch.device("cpu"))       # elsewhere: the dequantised fp32 product
    cos = torch.nn.functional.cosine_similarity(ours.flatten(1), reference.flatten(1), dim=-1)
    assert cos.min() > 0.9999                                    # a bf16 model against its fp32 copy: ~0.99998


@pytest.mark.skipif(not native_bf16(torch.device("cpu")), reason="no bf16 units: no oneDNN bf16 product for many rows")
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "silu"])
def test_an_int8_ffn_applies_its_activation_inside_the_wide_product(monkeypatch, activation):
    """Past INT8_MAX_ROWS rows an int8 up-projection (WideBf16) applies the FFN's activation as oneDNN writes
    its product: the activation of the layer's own output (tformer's functions) within bf16's rounding."""
    from tformer.model.layers import ACTIVATIONS
    torch.manual_seed(0)
    layer = Int8Linear(torch.nn.Linear(128, 512))
    x = torch.randn(INT8_MAX_ROWS + 40, 128, dtype=torch.bfloat16)
    calls = []
    original = int8_plans.WideBf16.__call__
    monkeypatch.setattr(int8_plans.WideBf16, "__call__", lambda self, *a: calls.append(a[2:]) or original(self, *a))
    with torch.inference_mode():
        fused, apart = layer.activated(x, activation, ACTIVATIONS[activation]), ACTIVATIONS[activation](layer(x))
    assert calls == [(activation,), (None,)] and fused.dtype == torch.bfloat16
    torch.testing.assert_close(fused.float(), apart.float(), atol=2 ** -7, rtol=2 ** -7)
