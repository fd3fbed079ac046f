"""A GPT's decoding step in one kernel call (fused.GPTStep): the same logits as the layers run one by
one, the same greedy tokens as Hugging Face's GPT-2, and the layer path wherever the kernel does not fit."""

import pytest
import torch

from hf_util import save_hf, transformers
from tformer import Decoder, ModelConfig
from tformer.inference.fused import GPTStep
from tformer.kernels import gemv
from tformer.model.plans import plan_decoding

pytestmark = pytest.mark.skipif(not gemv.available(), reason=f"gemv: {gemv.unsupported() or 'not built'}")


def gpt(seed=0, **kw):
    base = dict(kind="decoder", vocab_size=300, d_model=256, n_heads=4, n_layers=2, d_ff=512, max_seq_len=64,
                activation="gelu_tanh")
    torch.manual_seed(seed)
    return Decoder(ModelConfig(**{**base, **kw})).eval()


def steps(model, ids, n, fused):
    """Logits of n greedy steps after the prompt `ids`, with the fused step on or off."""
    plan_decoding(model, ids.size(0))
    saved = model.stack._fused_step()
    model.stack.fused = saved if fused else None
    cache, out = model.new_cache(ids.size(0)), []
    with torch.no_grad():
        logits = model.step(ids, cache)
        for _ in range(n):
            out.append(logits)
            logits = model.step(logits.argmax(-1, keepdim=True), cache)
    model.stack.fused = saved
    return torch.stack(out, 1)


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("kw", [dict(), dict(activation="gelu"), dict(activation="relu", bias=False),
                                dict(n_kv_heads=2)], ids=["gelu_tanh", "gelu", "relu-nobias", "gqa"])
def test_fused_step_equals_the_layers(rows, kw):
    model = gpt(**kw)
    assert model.stack._fused_step() is not None
    ids = torch.randint(0, 300, (rows, 5), generator=torch.Generator().manual_seed(rows))
    fused, layers = steps(model, ids, 6, True), steps(model, ids, 6, False)
    torch.testing.assert_close(fused, layers, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_fused_int8_step_equals_the_int8_layers(rows):
    """quantize_int8: the fused step runs tformer's int8 kernel (int8_plans.Gemv8) in every layer, with the
    results of the layers run one by one (which take the same kernel), and as close to the fp32 model
    as FBGEMM's int8 products are (later steps may pick other tokens)."""
    from tformer.inference.int8_plans import Gemv8
    from tformer.inference.quant import quantize_int8
    model = gpt(seed=rows)
    ids = torch.randint(0, 300, (rows, 5), generator=torch.Generator().manual_seed(rows))
    fp32 = steps(model, ids, 6, True)
    quantize_int8(model)
    fused, layers = steps(model, ids, 6, True), steps(model, ids, 6, False)
    assert model.stack._fused_step().table[:, 3].tolist() == [1, 1]              # W_qkv's type: int8
    assert all(isinstance(lin.kernel, Gemv8) for lin in model.stack.layers[0].ffn.modules() if hasattr(lin, "kernel"))
    # The same kernel, but LayerNorm's and GELU's last bits can move an input across a 7-bit rounding step.
    assert (fused - layers).norm() / layers.norm() < 2e-3
    # The first fused step, in the rows fed the same token as the fp32 model, is as close to fp32 as FBGEMM's (0.028).
    same = fused[:, 0].argmax(-1) == fp32[:, 0].argmax(-1)
    assert same.any()
    assert 0 < (fused[same, 1] - fp32[same, 1]).norm() / fp32[same, 1].norm() < 0.05


def test_fused_step_is_taken_and_moves_the_caches():
    model = gpt()
    plan_decoding(model, 1)
    cache = model.new_cache(1)
    calls = []
    step = model.stack._fused_step()
    original = step.__call__
    with torch.no_grad():
        model.step(torch.tensor([[1, 2, 3]]), cache)
        model.stack.fused = lambda x, caches: calls.append(1) or original(x, caches)
        model.step(torch.tensor([[4]]), cache)
    model.stack.fused = step
    assert calls and all(c.length == 4 for c in cache.layers)


def test_layers_that_do_not_fit_keep_the_layer_path():
    assert gpt(norm="rmsnorm").stack._fused_step() is None                         # Llama-shaped
    assert gpt(positional="rope").stack._fused_step() is None
    assert gpt(activation="swiglu").stack._fused_step() is None
    assert gpt(norm_position="post").stack._fused_step() is None
    model = gpt()
    x = torch.randn(9, 1, 256)                                                      # more rows than the kernel takes
    plan_decoding(model, 9)
    cache = model.new_cache(9)
    assert model.stack._fused_step()(x, cache.layers) is None
    assert all(c.length == 0 for c in cache.layers)


def test_stale_plans_fall_back_then_rebuild():
    model = gpt()
    ids = torch.tensor([[5, 6, 7]])
    before = steps(model, ids, 3, True)
    with torch.no_grad():                                                           # an optimizer step, say
        model.stack.layers[0].ffn.up.weight.mul_(1.5)
    cache = model.new_cache(1)
    with torch.no_grad():
        model.step(ids, cache)
        assert model.stack._fused_step()(torch.randn(1, 1, 256), cache.layers) is None   # plan stale: not taken
    after_fused, after_layers = steps(model, ids, 3, True), steps(model, ids, 3, False)   # generate plans again
    torch.testing.assert_close(after_fused, after_layers, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(before, after_fused)


@pytest.mark.skipif(transformers is None, reason="transformers not installed")
def test_greedy_tokens_equal_hf_gpt2(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from tformer.checkpoints.hf import from_hf

    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=300, n_positions=64,
                                    bos_token_id=0, eos_token_id=0)).eval()
    save_hf(hf, tmp_path)
    ours = from_hf(tmp_path).eval()
    assert isinstance(ours.stack._fused_step(), GPTStep)
    ids = torch.randint(1, 300, (3, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, pad_token_id=0)
    got = ours.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=[])
    assert torch.equal(got, ref)
