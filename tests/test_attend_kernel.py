"""tformer.kernels.gemv's attention kernels: decoding attention for every row and head (`attend`: beams reading
their source's keys in place, a reordered cache followed by its lineage), an encoder's attention on the real
tokens of a packed batch (`attend_whole`) and a prompt's causal attention after its cached positions
(`attend_causal`), each against the formula in float64, and the models that use them."""

import pytest
import torch
import torch.nn.functional as F

from tformer.kernels import build, gemv

needs_kernel = pytest.mark.skipif(build.unsupported() is not None, reason=f"gemv: {build.unsupported()}")


def _attend_reference(q, k, v, mask, copies):
    """The formula (tformer.model.attention.attention) in float64, the beams of a source given its keys."""
    from tformer.model.attention import attention
    k, v = (x.double().repeat_interleave(copies, dim=0) for x in (k, v))
    if mask is not None:
        mask = mask.repeat_interleave(q.size(0) // mask.size(0), dim=0)
    out = attention(q.double(), k, v, mask)                                   # (B, H, 1, hd)
    return out.transpose(1, 2).reshape(q.size(0), 1, -1)


@needs_kernel
@pytest.mark.parametrize("B, H, H_kv, T_k, hd, copies, masked", [
    (64, 8, 8, 20, 64, 1, False),     # Marian's self-attention: 16 sentences x 4 beams, cache slice
    (64, 8, 8, 33, 64, 4, True),      # Marian's cross-attention: 4 beams share a source and its mask
    (1, 12, 12, 200, 64, 1, False),   # GPT-2 at batch 1
    (3, 8, 2, 17, 128, 1, True),      # grouped-query attention, a wider head, padded keys
    (2, 4, 4, 1, 16, 2, False),       # one key
])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])   # bf16: a server's --kv-cache-dtype
def test_attend_equals_the_formula(B, H, H_kv, T_k, hd, copies, masked, kv_dtype):
    torch.manual_seed(T_k)
    q = torch.randn(B, 1, 3 * H * hd)[..., :H * hd].view(B, 1, H, hd).transpose(1, 2)   # strided as in a layer
    cache = torch.randn(2, B // copies, H_kv, T_k + 5, hd).to(kv_dtype)                # filled part of a cache
    k, v = cache[0, :, :, :T_k], cache[1, :, :, :T_k]
    mask = None
    if masked:
        mask = torch.rand(B // copies, 1, 1, T_k) > 0.3
        mask[..., 0] = True
    out = gemv.attend(q, k, v, mask, hd ** -0.5)
    assert out.shape == (B, 1, H * hd) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _attend_reference(q, k, v, mask, copies), atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("H, H_kv, hd", [(12, 12, 32), (8, 2, 64), (4, 4, 16)])   # MiniLM; grouped-query; a narrow head
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])                  # bf16: an int8 encoder's
def test_attend_whole_equals_the_formula_text_by_text(H, H_kv, hd, dtype):
    """Every real token of a packed batch attends to all of its own text's tokens and to no other's: each text
    (1 to 70 tokens: within and across blocks of queries and vectors of keys; one text of none) as the formula
    gives it alone, in float64 from the same inputs."""
    torch.manual_seed(hd)
    lengths = [1, 7, 8, 9, 0, 16, 17, 33, 70, 3]
    starts = F.pad(torch.tensor(lengths).cumsum(0), (1, 0))
    qkv = torch.randn(sum(lengths), (H + 2 * H_kv) * hd).to(dtype)
    out = gemv.attend_whole(qkv, starts, H, H_kv, hd, hd ** -0.5)
    assert out.shape == (sum(lengths), H * hd) and out.dtype == dtype
    bound = 1e-5 if dtype == torch.float32 else 2 ** -8                       # the output rounded to bf16
    torch.testing.assert_close(out.double(), whole_reference(qkv, lengths, H, H_kv, hd), atol=bound, rtol=bound)


def whole_reference(qkv, lengths, H, H_kv, hd):
    """softmax(QKᵀ/√hd)V of each text alone, in float64."""
    outs = []
    for x in qkv.double().split(lengths):
        q, k, v = (part.reshape(len(x), part.size(1) // hd, hd).transpose(0, 1)
                   for part in x.split([H * hd, H_kv * hd, H_kv * hd], dim=1))
        k, v = k.repeat_interleave(H // H_kv, 0), v.repeat_interleave(H // H_kv, 0)
        o = torch.softmax(q @ k.transpose(1, 2) * hd ** -0.5, dim=-1) @ v                 # (H, n, hd)
        outs.append(o.transpose(0, 1).reshape(len(x), H * hd))
    return torch.cat(outs)


@needs_kernel
@pytest.mark.parametrize("mask", ["padded", "none", "all ones"])
def test_an_encoder_attends_through_the_kernel_padded_or_not(monkeypatch, mask):
    """An encoder in inference packs its real tokens and attends through attend_whole, with padding or without (a
    single text: PyTorch's flash kernel is slower on short texts), and gives what PyTorch's attention gives."""
    from tformer.model.config import ModelConfig
    from tformer.model.models import Encoder
    torch.manual_seed(0)
    model = Encoder(ModelConfig(kind="encoder", vocab_size=100, d_model=64, n_heads=4, n_layers=2, d_ff=128,
                                max_seq_len=32, dropout=0.0)).eval()
    ids = torch.randint(0, 100, (3, 20))
    attention_mask = {"padded": torch.ones(3, 20, dtype=torch.long).index_fill_(1, torch.arange(15, 20), 0),
                      "none": None, "all ones": torch.ones(3, 20, dtype=torch.long)}[mask]
    calls = []
    original = gemv.attend_whole
    monkeypatch.setattr(gemv, "attend_whole", lambda *a: calls.append(1) or original(*a))
    with torch.no_grad():
        ours = model(ids, attention_mask)
        assert len(calls) == 2                                          # each layer
        monkeypatch.setattr(gemv, "available", lambda: False)
        monkeypatch.setattr(gemv, "attend_whole", lambda *a: None)     # PyTorch's attention
        torch.testing.assert_close(ours, model(ids, attention_mask), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_attend_whole_declines_what_it_does_not_take():
    starts = torch.tensor([0, 3, 5])
    qkv = torch.randn(5, 3 * 4 * 16)
    assert gemv.attend_whole(qkv, starts, 4, 4, 16, 0.25) is not None
    assert gemv.attend_whole(qkv[:, :-1], starts, 4, 4, 16, 0.25) is None               # not Q, K, V's width
    assert gemv.attend_whole(torch.randn(5, 3 * 4 * 24), starts, 4, 4, 24, 0.25) is None  # head not a multiple of 16
    assert gemv.attend_whole(qkv.half(), starts, 4, 4, 16, 0.25) is None
    assert gemv.attend_whole(qkv, torch.tensor([0, 3, 6]), 4, 4, 16, 0.25) is None       # past the last row
    assert gemv.attend_whole(qkv.t().contiguous().t(), starts, 4, 4, 16, 0.25) is None    # columns not contiguous


@needs_kernel
def test_attend_gives_zero_where_no_key_may_be_attended_and_declines_what_it_does_not_take():
    q, k = torch.randn(2, 4, 1, 16), torch.randn(2, 4, 5, 16)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    mask[1] = False
    out = gemv.attend(q, k, k, mask, 0.25)
    assert torch.equal(out[1], torch.zeros(1, 64)) and out[0].abs().sum() > 0
    assert gemv.attend(torch.randn(2, 4, 2, 16), k, k, None, 0.25) is None             # two queries a row
    assert gemv.attend(torch.randn(2, 4, 1, 24), torch.randn(2, 4, 5, 24), torch.randn(2, 4, 5, 24), None, 1.0) is None
    assert gemv.attend(q.bfloat16(), k.bfloat16(), k.bfloat16(), None, 0.25) is None
    assert gemv.attend(q, k.bfloat16(), k, None, 0.25) is None                          # keys and values differ
    assert gemv.attend(q, k, k, torch.ones(2, 4, 1, 5, dtype=torch.bool), 0.25) is None  # a mask per head


@needs_kernel
def test_beam_search_with_the_attention_kernel_matches_without(monkeypatch):
    from tformer.model.config import ModelConfig
    from tformer.model.models import EncoderDecoder
    torch.manual_seed(0)
    cfg = ModelConfig(kind="encoder-decoder", vocab_size=500, d_model=64, n_heads=4, n_layers=2, max_seq_len=64,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = EncoderDecoder(cfg).eval()
    src = torch.randint(3, 500, (3, 9))
    mask = torch.ones_like(src)
    mask[1, 6:] = 0
    calls = []
    original = gemv.attend
    monkeypatch.setattr(gemv, "attend", lambda *a: calls.append(1) or original(*a))
    fast = model.generate(src, attention_mask=mask, num_beams=4, max_new_tokens=10, eos_token_id=[])
    assert len(calls) >= 2 * 2 * 9                                # self and cross, 2 layers, each new token
    for name, value in (("attend", lambda *a: None),           # no kernel: keys put in beam order to read
                        ("available", lambda: False)):         # the cache copied into beam order each step
        monkeypatch.setattr(gemv, name, value)
        assert torch.equal(model.generate(src, attention_mask=mask, num_beams=4, max_new_tokens=10,
                                          eos_token_id=[]), fast)


@needs_kernel
def test_a_reordered_cache_reads_as_the_copied_one():
    """KVCache.reorder only rewrites the lineage; following it (the kernel, follow_lineage, settle)
    gives what copying the rows into beam order at each step gives."""
    from tformer.model.attention import attention
    from tformer.model.kv_cache import KVCache, follow_lineage
    torch.manual_seed(0)
    B, H, hd, g = 6, 2, 16, torch.Generator().manual_seed(1)
    cache = KVCache(B, H, 12, hd)
    new = [(torch.randn(B, H, 3, hd), torch.randn(B, H, 3, hd))] + [(torch.randn(B, H, 1, hd), torch.randn(B, H, 1, hd))
                                                                   for _ in range(6)]
    ref_k = ref_v = torch.empty(B, H, 0, hd)
    for step, (k, v) in enumerate(new):
        if step:
            index = torch.randint(0, B, (B,), generator=g)
            cache.reorder(index)
            ref_k, ref_v = ref_k[index], ref_v[index]
        keys, values = cache.update(k, v)
        ref_k, ref_v = torch.cat([ref_k, k], dim=2), torch.cat([ref_v, v], dim=2)
        if step:
            lineage = cache.lineage[:, :cache.length]
            assert torch.equal(torch.stack(follow_lineage(keys, values, lineage)), torch.stack((ref_k, ref_v)))
            q = torch.randn(B, H, 1, hd)
            expected = attention(q, ref_k, ref_v).transpose(1, 2).reshape(B, 1, H * hd)
            torch.testing.assert_close(gemv.attend(q, keys, values, None, hd ** -0.5, lineage), expected)
    assert cache.lineage is not None and not torch.equal(cache.k[:, :, :cache.length], ref_k)   # nothing was moved
    cache.reorder(torch.tensor([5, 0, 0]))                        # fewer rows: settles, then keeps them
    assert cache.lineage is None and torch.equal(cache.k[:, :, :cache.length], ref_k[[5, 0, 0]])


def causal_reference(q, k, v, scale):
    """The formula in float64: q (T, H, hd), k, v (H_kv, L, hd); query i sees keys 0 .. L - T + i."""
    T, H, hd = q.shape
    k, v = (x.double().repeat_interleave(H // x.size(0), dim=0) for x in (k, v))       # (H, L, hd)
    scores = torch.einsum("thd,hjd->htj", q.double(), k) * scale
    allowed = torch.ones(T, k.size(1), dtype=torch.bool).tril(k.size(1) - T)
    p = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("htj,hjd->thd", p, v).reshape(T, H * hd)


@needs_kernel
@pytest.mark.parametrize("H, H_kv, hd, offset, T", [
    (12, 12, 64, 0, 128),       # a prompt of GPT-2-small's shape
    (12, 12, 64, 200, 56),      # a server's last chunk of a prompt, after 200 positions
    (8, 2, 128, 37, 9),         # grouped-query attention, a wider head, a block of queries and one more
    (4, 4, 16, 0, 2),           # two queries
    (4, 4, 32, 1000, 21),       # a long prefix
])
@pytest.mark.parametrize("q_dtype, kv_dtype", [(torch.float32, torch.float32),
                                                (torch.float32, torch.bfloat16),    # a server's --kv-cache-dtype bf16
                                                (torch.bfloat16, torch.bfloat16)])  # a bf16 model's
def test_attend_causal_equals_the_formula(H, H_kv, hd, offset, T, q_dtype, kv_dtype):
    torch.manual_seed(offset + T)
    L = offset + T
    q = torch.randn(T, 3 * H * hd)[:, :H * hd].view(T, H, hd).to(q_dtype)   # strided as in a fused projection
    cache = torch.randn(2, H_kv, L + 7, hd).to(kv_dtype)                     # the filled part of a cache
    k, v = cache[0, :, :L], cache[1, :, :L]
    out = gemv.attend_causal(q, k, v, hd ** -0.5)
    expected = causal_reference(q, k, v, hd ** -0.5)
    assert out.dtype == q_dtype
    bound = 1e-5 if q_dtype == torch.float32 else 2 ** -8     # bf16 out: rounded to 8 significant bits once
    torch.testing.assert_close(out.double(), expected, atol=bound, rtol=bound)


@needs_kernel
def test_attend_causal_declines_what_it_does_not_take():
    q, k = torch.randn(3, 4, 16), torch.randn(4, 5, 16)
    assert gemv.attend_causal(q, k, k, 0.25) is not None
    assert gemv.attend_causal(torch.randn(6, 4, 16), k, k, 0.25) is None                 # more queries than keys
    assert gemv.attend_causal(torch.randn(3, 4, 24), torch.randn(4, 5, 24), torch.randn(4, 5, 24), 1.0) is None
    assert gemv.attend_causal(q.half(), k.half(), k.half(), 0.25) is None
    assert gemv.attend_causal(q, k.bfloat16(), k, 0.25) is None                         # keys and values differ
    assert gemv.attend_causal(q, torch.randn(3, 5, 16), torch.randn(3, 5, 16), 0.25) is None   # 4 heads on 3
    assert gemv.attend_causal(q.transpose(0, 2).contiguous().transpose(0, 2), k, k, 0.25) is None
    assert gemv.attend_causal(q[None], k, k, 0.25) is None                              # a batch of sequences


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])                 # bf16: `tformer serve --dtype bf16`
def test_a_prompt_and_its_chunks_attend_through_the_kernel_as_without(monkeypatch, dtype):
    """A decoder's prompt in one step (generate's prefill) and in chunks after its cached positions (the
    server's ragged passes, model/ragged.py) attend through attend_causal, and give what PyTorch's attention
    gives with the kernel off (in bf16 within the rounding of the layers' bf16 activations; a CPU with AMX keeps
    PyTorch's kernel for bf16, which multiplies by AMX tiles there)."""
    from tformer.model.config import ModelConfig
    from tformer.model.models import Decoder
    from tformer.model.ragged import Part, RaggedCache
    torch.manual_seed(0)
    model = Decoder(ModelConfig(kind="decoder", vocab_size=100, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2,
                                d_ff=128, max_seq_len=64, dropout=0.0, positional="rope", norm="rmsnorm",
                                activation="swiglu", bias=False)).eval().to(dtype)
    ids = torch.randint(0, 100, (1, 40))

    def run():
        whole = model.step(ids, model.new_cache(1, 40), all_logits=True, head=False)     # (1, 40, D): one step
        cache, chunks = model.new_cache(1, 40), []
        for a, b in ((0, 16), (16, 30), (30, 40)):                                      # chunks after the cached ones
            chunks.append(model.step(ids[0, a:b, None], RaggedCache([Part(cache, 1, b - a)]),
                                     positions=torch.arange(a, b)[:, None], head=False))
        return whole.reshape(40, -1), torch.cat(chunks).reshape(40, -1)

    calls = []
    original = gemv.attend_causal
    monkeypatch.setattr(gemv, "attend_causal", lambda *a: calls.append(1) or original(*a))
    with torch.no_grad():
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
        run()
        assert len(calls) == (2 * 4 if dtype == torch.float32 else 0)  # with AMX, bf16 stays PyTorch's
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        calls.clear()
        ours = run()
        assert len(calls) == 2 * 4                                      # each layer, in the step and each chunk
        monkeypatch.setattr(gemv, "attend_causal", lambda *a: None)     # PyTorch's attention
        theirs = run()
    bound = 1e-5 if dtype == torch.float32 else 3e-2
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.float(), b.float(), atol=bound, rtol=bound)


@needs_kernel
def test_a_bf16_models_decoding_steps_attend_through_the_kernel(monkeypatch):
    """A bf16 decoder's decoding steps widen their queries for gemv.attend (bf16 keys and values read as they
    are) and give what PyTorch's bf16 attention gives, within bf16's rounding; with AMX, PyTorch's."""
    from tformer.model.config import ModelConfig
    from tformer.model.models import Decoder
    torch.manual_seed(0)
    model = Decoder(ModelConfig(kind="decoder", vocab_size=100, d_model=64, n_heads=4, n_layers=2, d_ff=128,
                                max_seq_len=64, dropout=0.0, positional="rope")).eval().to(torch.bfloat16)
    ids = torch.randint(0, 100, (3, 12))

    def steps():
        cache, out = model.new_cache(3, 20), []
        model.step(ids[:, :8], cache, head=False)
        for t in range(8, 12):                                          # one new token per row
            out.append(model.step(ids[:, t:t + 1], cache, head=False))
        return torch.stack(out).float()

    calls = []
    original = gemv.attend
    monkeypatch.setattr(gemv, "attend", lambda *a, **k: calls.append(a[0].dtype) or original(*a, **k))
    with torch.no_grad():
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
        steps()
        assert calls == []                                              # with AMX: PyTorch's bf16 attention
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        ours = steps()
        assert calls == [torch.float32] * 2 * 4                         # each layer of each step, widened
        monkeypatch.setattr(gemv, "attend", lambda *a, **k: None)
        theirs = steps()
    torch.testing.assert_close(ours, theirs, atol=3e-2, rtol=1e-2)               # a few bf16 ulps at 2-4
