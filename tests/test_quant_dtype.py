"""quantize_int8 from any dtype: a bf16 model quantises (int8 activations, on a CPU) to the very model its fp32
copy gives — the same modules, tensors, dtypes and outputs, and the same fast decoding path (the fused GPT
step), where a bf16 model kept in bf16 around its int8 layers took none of it."""

import copy

import pytest
import torch

import tformer
from tformer.inference.quant import Int8Linear, dynamic_int8_available, quantize_int8
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
    floats = {t.dtype for t in [*from_bf16.parameters(), *from_bf16.buffers()] if t.is_floating_point()}
    assert floats == {torch.float32}                             # scales, biases, norms, embeddings
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
