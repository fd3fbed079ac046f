"""Model-level invariants: causality, padding, cached == uncached, overfitting, gradients."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tformer import Decoder, Encoder, EncoderClassifier, EncoderDecoder, ModelConfig

V = 23


def tiny(kind="decoder", **kw):
    base = dict(kind=kind, vocab_size=V, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=32, dropout=0.0)
    return ModelConfig(**{**base, **kw})


def build(cls, seed=0, **kw):
    torch.manual_seed(seed)
    kind = {Decoder: "decoder", EncoderDecoder: "encoder-decoder"}.get(cls, "encoder")
    model = cls(tiny(kind, **kw), 3) if cls is EncoderClassifier else cls(tiny(kind, **kw))
    return model.eval()


def ids(*shape, seed=0):
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


# --- causality ------------------------------------------------------------------------------------

CAUSAL_MODELS = {
    "decoder-learned-pre": build(Decoder, positional="learned"),
    "decoder-rope-post": build(Decoder, positional="rope", norm_position="post", n_kv_heads=2),
    "encdec-sinusoidal-post": build(EncoderDecoder, positional="sinusoidal", norm_position="post"),
    "encdec-separate-vocab": build(EncoderDecoder, src_vocab_size=37),
}


@pytest.mark.parametrize("name", list(CAUSAL_MODELS))
@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 3), length=st.integers(2, 12), data=st.data())
def test_changing_later_tokens_never_changes_earlier_logits(name, batch, length, data):
    model = CAUSAL_MODELS[name]
    t = data.draw(st.integers(0, length - 2), label="t")
    seed = data.draw(st.integers(0, 1000), label="seed")
    x = ids(batch, length, seed=seed)
    y = x.clone()
    y[:, t + 1:] = (y[:, t + 1:] + 1 + ids(batch, length - t - 1, seed=seed + 1) % (V - 1)) % V  # all differ
    with torch.no_grad():
        if isinstance(model, EncoderDecoder):
            src = ids(batch, 5, seed=seed + 2)
            a, b = model(src, x), model(src, y)
        else:
            a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :t + 1], b[:, :t + 1], atol=1e-5, rtol=0)
    assert not torch.allclose(a[:, t + 1:], b[:, t + 1:], atol=1e-4)           # later positions do see them


# --- padding -------------------------------------------------------------------------------------

@pytest.mark.parametrize("positional", ["learned", "sinusoidal", "rope"])
@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_encoder_output_is_the_same_inside_a_padded_batch(positional, norm_position):
    enc = build(Encoder, positional=positional, norm_position=norm_position)
    short, long = ids(1, 4, seed=1), ids(1, 7, seed=2)
    batch = torch.cat([F.pad(short, (0, 3), value=0), long])                      # (2, 7), row 0 right-padded
    mask = torch.tensor([[1] * 4 + [0] * 3, [1] * 7])
    with torch.no_grad():
        out = enc(batch, mask)
        torch.testing.assert_close(out[0, :4], enc(short)[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(out[1], enc(long)[0], atol=1e-5, rtol=0)
    assert not out.isnan().any()


@pytest.mark.parametrize("positional", ["learned", "rope"])
def test_packed_inference_equals_the_padded_computation(positional):
    """In eval mode a padded batch runs its token-wise layers on the real tokens only (masks.Packing);
    the output equals the plain padded forward (train mode, dropout 0, which never packs) for left and
    right padding and a row that is all padding; padded positions are 0 in both."""
    enc = build(Encoder, positional=positional, n_layers=3)
    batch = ids(4, 9, seed=3)
    mask = torch.tensor([[1] * 5 + [0] * 4, [0] * 2 + [1] * 7, [1] * 9, [0] * 9])
    with torch.no_grad():
        packed = enc.eval()(batch, mask)
        plain = enc.train()(batch, mask)
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=0)
    assert (packed[~mask.bool()] == 0).all()


def test_fully_padded_sequence_gives_no_nan():
    with torch.no_grad():
        out = build(Encoder)(ids(2, 5), torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0]]))
        logits = build(Decoder)(ids(2, 5), torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]]))
    assert not out.isnan().any() and not logits.isnan().any()


def left_pad(rows):
    """Left-pad a list of 1-D id tensors: (ids (B, T), HF mask (B, T), per-row positions (B, T))."""
    t = max(len(r) for r in rows)
    batch = torch.stack([F.pad(r, (t - len(r), 0), value=0) for r in rows])
    mask = torch.stack([F.pad(torch.ones_like(r), (t - len(r), 0)) for r in rows])
    return batch, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("positional", ["learned", "sinusoidal", "rope"])
def test_left_padded_batch_with_positions_equals_unpadded_rows(positional):
    lm = build(Decoder, positional=positional)
    rows = [ids(6, seed=3), ids(3, seed=4)]
    batch, mask, positions = left_pad(rows)
    with torch.no_grad():
        out = lm(batch, attention_mask=mask, positions=positions)
        for b, r in enumerate(rows):
            torch.testing.assert_close(out[b, -len(r):], lm(r[None])[0], atol=1e-5, rtol=0)
        # ... and continuing both rows with the cache (mask grows by one column per step).
        cache = lm.new_cache(2, 10)
        lm(batch, attention_mask=mask, positions=positions, cache=cache)
        nxt = ids(2, 1, seed=5)
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
        step = lm(nxt, attention_mask=mask, positions=positions[:, -1:] + 1, cache=cache)
        for b, r in enumerate(rows):
            full = lm(torch.cat([r, nxt[b]])[None])[0, -1]
            torch.testing.assert_close(step[b, 0], full, atol=1e-5, rtol=0)


# --- KV cache --------------------------------------------------------------------------------------

DECODER_VARIANTS = {
    "learned": dict(positional="learned"),
    "sinusoidal": dict(positional="sinusoidal", norm_position="post"),
    "rope-gqa": dict(positional="rope", n_kv_heads=2, norm="rmsnorm", activation="swiglu", bias=False),
}


@pytest.mark.parametrize("variant", list(DECODER_VARIANTS))
def test_decoder_token_by_token_with_cache_equals_full_forward(variant):
    lm = build(Decoder, **DECODER_VARIANTS[variant])
    x = ids(2, 9)
    with torch.no_grad():
        full = lm(x)
        cache = lm.new_cache(2, 16)
        steps = [lm(x[:, t:t + 1], cache=cache) for t in range(9)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
        assert cache.length == 9
        # Prefill a chunk, then a second chunk (T > 1 on top of a cache), then single tokens.
        cache = lm.new_cache(2, 16)
        parts = [lm(x[:, :4], cache=cache), lm(x[:, 4:6], cache=cache)]
        parts += [lm(x[:, t:t + 1], cache=cache) for t in range(6, 9)]
        torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=0)


def test_cache_overflow_is_an_error():
    lm = build(Decoder)
    cache = lm.new_cache(1, 3)
    with torch.no_grad(), pytest.raises(ValueError, match="full"):
        lm(ids(1, 4), cache=cache)


def test_encoder_decoder_cache_computes_cross_kv_once():
    model = build(EncoderDecoder, positional="sinusoidal", n_decoder_layers=3)  # decoder deeper than encoder
    src, tgt = ids(2, 7, seed=1), ids(2, 6, seed=2)
    src_mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    calls = []
    for layer in model.decoder.layers:
        layer.cross_attn.kv_proj.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        full = model(src, tgt, src_mask)
        calls.clear()
        memory = model.encode(src, src_mask)
        cache = model.new_cache(2, 8)
        steps = [model.decode(tgt[:, :1], memory, src_mask, cache=cache)]
        assert len(calls) == len(model.decoder.layers)                            # computed at step 1 ...
        first_k = [c.k for c in cache.cross]
        assert all(k is not None and k.shape == (2, 4, 7, 8) for k in first_k)
        steps += [model.decode(tgt[:, t:t + 1], memory, src_mask, cache=cache) for t in range(1, 6)]
        assert len(calls) == len(model.decoder.layers)                            # ... and never again
        assert all(c.k is k for c, k in zip(cache.cross, first_k))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


def test_cache_reorder_selects_rows():
    lm = build(Decoder)
    x = ids(3, 4)
    with torch.no_grad():
        cache = lm.new_cache(3, 8)
        lm(x, cache=cache)
        cache.reorder(torch.tensor([2, 2, 0]))
        step = lm(x[[2, 2, 0], :1], cache=cache)
        expected = lm(torch.cat([x[[2, 2, 0]], x[[2, 2, 0], :1]], dim=1))[:, -1]
    torch.testing.assert_close(step[:, 0], expected, atol=1e-5, rtol=0)


# --- overfit one batch, gradients, return_attention ----------------------------------------------

def loss_of(model, head, batch):
    if isinstance(model, EncoderClassifier):
        return F.cross_entropy(model(batch["x"], batch["mask"]), batch["label"])
    if isinstance(model, Encoder):                       # token tagging through a tiny head (real tokens only)
        tags = batch["tags"].masked_fill(batch["mask"] == 0, -100)
        return F.cross_entropy(head(model(batch["x"], batch["mask"])).flatten(0, 1), tags.flatten())
    if isinstance(model, Decoder):
        return F.cross_entropy(model(batch["x"][:, :-1]).flatten(0, 1), batch["x"][:, 1:].flatten())
    logits = model(batch["x"], batch["tgt"][:, :-1], batch["mask"])
    return F.cross_entropy(logits.flatten(0, 1), batch["tgt"][:, 1:].flatten())


@pytest.mark.parametrize("cls", [Encoder, EncoderClassifier, Decoder, EncoderDecoder])
@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_overfits_one_batch_and_every_parameter_learns(cls, norm_position):
    model = build(cls, norm_position=norm_position, tie_embeddings=cls is not Decoder).train()
    head = nn.Linear(32, 5) if cls is Encoder else None
    batch = {"x": ids(4, 8, seed=1), "mask": torch.tensor([[1] * 8] * 3 + [[1] * 5 + [0] * 3]),
             "label": torch.tensor([0, 1, 2, 1]), "tags": ids(4, 8, seed=2) % 5, "tgt": ids(4, 7, seed=3)}
    params = list(model.parameters()) + (list(head.parameters()) if head else [])
    loss_of(model, head, batch).backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not no_grad, f"parameters without gradient: {no_grad}"
    opt = torch.optim.Adam(params, lr=1e-2)
    for _ in range(150):
        opt.zero_grad()
        loss = loss_of(model, head, batch)
        if loss.item() < 0.05:
            break
        loss.backward()
        opt.step()
    assert loss.item() < 0.05


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_return_attention_equals_plain_outputs(norm_position):
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    x = ids(2, 6)
    with torch.no_grad():
        enc = build(Encoder, norm_position=norm_position)
        out, att = enc(x, mask, return_attention=True)
        torch.testing.assert_close(out, enc(x, mask), atol=1e-5, rtol=0)
        assert len(att) == 2 and att[0].shape == (2, 4, 6, 6) and (att[0][1, :, :, 4:] == 0).all()

        clf = build(EncoderClassifier, norm_position=norm_position)
        logits, att = clf(x, mask, return_attention=True)
        torch.testing.assert_close(logits, clf(x, mask), atol=1e-5, rtol=0)

        lm = build(Decoder, norm_position=norm_position)
        logits, att = lm(x, return_attention=True)
        torch.testing.assert_close(logits, lm(x), atol=1e-5, rtol=0)
        assert torch.equal(att[0][0, 0] > 0, torch.ones(6, 6, dtype=torch.bool).tril())  # causal pattern
        torch.testing.assert_close(att[1].sum(-1), torch.ones(2, 4, 6))

        s2s = build(EncoderDecoder, norm_position=norm_position)
        tgt = ids(2, 5, seed=1)
        logits, att = s2s(x, tgt, mask, return_attention=True)
        torch.testing.assert_close(logits, s2s(x, tgt, mask), atol=1e-5, rtol=0)
        assert [len(att[k]) for k in ("encoder", "decoder", "cross")] == [2, 2, 2]
        assert att["cross"][0].shape == (2, 4, 5, 6) and (att["cross"][0][1, :, :, 4:] == 0).all()


def test_token_types_and_embedding_options():
    """BERT-style segment embeddings and the 2017 √D scale are used when configured."""
    enc = build(Encoder, type_vocab_size=2, embedding_norm=True)
    x = ids(1, 5)
    with torch.no_grad():
        a, b = enc(x), enc(x, token_type_ids=torch.ones_like(x))
    assert not torch.allclose(a, b)
    scaled = build(Decoder, embed_scale=True, positional="sinusoidal")
    plain = build(Decoder, positional="sinusoidal")
    with torch.no_grad():
        assert not torch.allclose(scaled(x), plain(x))


# --- device and dtype come from outside --------------------------------------------------------------

def test_models_follow_the_device_they_are_put_on():
    """The meta device stands in for CUDA: any tensor the model creates on the CPU by itself (a mask,
    positions, a cache) would make these calls fail with a device mismatch."""
    with torch.device("meta"):
        x, mask = torch.zeros(2, 6, dtype=torch.long), torch.ones(2, 6, dtype=torch.long)
        lm = Decoder(tiny(positional="rope", n_kv_heads=2)).eval()
        cache = lm.new_cache(2, 10)
        lm(x[:, :3], cache=cache)
        lm(x[:, 3:5], cache=cache)                                            # chunk on top of a cache
        out = lm(x[:, 5:], attention_mask=mask, cache=cache)
        s2s = EncoderDecoder(tiny("encoder-decoder", positional="sinusoidal"))
        cache = s2s.new_cache(2, 8)
        step = s2s.decode(x[:, :2], s2s.encode(x, mask), mask, cache=cache)
        logits, _ = s2s(x, x, mask, return_attention=True)
    assert {t.device.type for t in (out, cache.layers[0].k, step, logits)} == {"meta"}


def test_float64_model_cache_matches_full_forward_exactly():
    lm = build(Decoder, positional="rope").double()
    x = ids(1, 7)
    with torch.no_grad():
        full = lm(x)
        cache = lm.new_cache(1, 8)
        assert cache.layers[0].k.dtype == torch.float64
        steps = torch.cat([lm(x[:, t:t + 1], cache=cache) for t in range(7)], dim=1)
    assert full.dtype == torch.float64
    torch.testing.assert_close(steps, full, atol=1e-12, rtol=0)


# --- an encoder-decoder with its own source vocabulary --------------------------------------------

SRC_V = 37  # larger than the target's V: ids V..SRC_V-1 exist only in the source vocabulary


def separate_vocab_model():
    return build(EncoderDecoder, src_vocab_size=SRC_V, pad_token_id=0, decoder_start_token_id=1)


def source_batch():
    """Source ids drawn from the whole source vocabulary (most are >= V) and a mask with padding."""
    src = torch.randint(0, SRC_V, (3, 7), generator=torch.Generator().manual_seed(4))
    return src, torch.tensor([[1] * 7, [1] * 5 + [0] * 2, [1] * 3 + [0] * 4])


def test_separate_source_vocabulary_feeds_the_encoder_only():
    model = separate_vocab_model().train()
    assert model.encoder.embed.token is model.src_embed and model.src_embed.weight.shape == (SRC_V, 32)
    assert model.decoder.embed.token is model.shared and model.lm_head.weight is model.shared.weight
    src, mask = source_batch()
    logits = model(src, ids(3, 5), mask)
    assert logits.shape == (3, 5, V)                                          # the target vocabulary
    logits.sum().backward()
    read = torch.zeros(SRC_V, dtype=torch.bool)
    read[src[mask.bool()]] = True                                             # real (unpadded) source tokens
    touched = model.src_embed.weight.grad.abs().sum(-1) > 0
    assert torch.equal(touched, read)                                         # exactly the rows the source used


def test_separate_vocabulary_greedy_and_beam_equal_full_forward_and_cacheless():
    model = separate_vocab_model()
    src, mask = source_batch()
    kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=[])
    with torch.no_grad():
        greedy = model.generate(src, mask, **kw)
        seq = torch.ones(3, 1, dtype=torch.long)                              # the decoder start token
        for _ in range(8):                                                    # reference: full forward, argmax
            seq = torch.cat([seq, model(src, seq, mask)[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(greedy, seq)
        assert torch.equal(greedy, model.generate(src, mask, use_cache=False, **kw))
        beams = model.generate(src, mask, num_beams=3, **kw)
        assert torch.equal(beams, model.generate(src, mask, num_beams=3, use_cache=False, **kw))


def test_separate_vocabulary_save_load_gives_identical_outputs(tmp_path):
    from safetensors.torch import load_file

    from tformer import load, save

    model = separate_vocab_model()
    save(model, tmp_path / "m")
    assert "src_embed.weight" in load_file(tmp_path / "m" / "model.safetensors")
    again = load(tmp_path / "m")
    assert again.cfg == model.cfg and again.src_embed.weight.shape == (SRC_V, 32)
    src, mask = source_batch()
    with torch.no_grad():
        assert torch.equal(again(src, ids(3, 5), mask), model(src, ids(3, 5), mask))


@pytest.mark.parametrize("cls", [Decoder, Encoder, EncoderDecoder])
def test_initialisation_scales_the_residual_projections_only_before_pre_norms(cls):
    """N(0, 0.02) everywhere; the projections into the residual stream 0.02/sqrt(2 * layers) in a pre-norm
    model (GPT-2's rule), unscaled in a post-norm one (BERT's, Marian's: the stream is normalised anyway)."""
    for position in ("pre", "post"):
        model = build(cls, d_model=128, d_ff=512, norm_position=position)
        layers = 2 * (2 if cls is EncoderDecoder else 1)
        residual = [p for n, p in model.named_parameters() if n.endswith(("out_proj.weight", "down.weight"))]
        others = [p for n, p in model.named_parameters() if p.dim() == 2 and n.endswith(("q_proj.weight", "up.weight",
                                                                                          "qkv_proj.weight"))]
        assert residual and others
        want = 0.02 / (2 * layers) ** 0.5 if position == "pre" else 0.02
        for p in residual:
            assert abs(p.std().item() - want) < 0.1 * want, (position, p.std().item(), want)
        for p in others:
            assert abs(p.std().item() - 0.02) < 0.002
