"""T5 checkpoints: tformer equals Hugging Face's T5ForConditionalGeneration (forward on padded batches,
greedy and beam-4 generation) and T5EncoderModel on tiny random configs of both flavours — v1.0 (ReLU,
tied head scaled by d_model^-0.5) and v1.1 / Flan-T5 (gated GELU, no scaling) — with odd head counts,
d_kv * heads != d_model and encoder and decoder of different depths; the relative position bias against
its formula computed by hand; to_hf round-trips and loads in transformers."""

import json
import math

import pytest
import torch

import tformer
from hf_util import assert_close_real, batch, save_hf, state_equal, transformers
from tformer.errors import ConfigError
from tformer.model.positional import RelativePositionBias, relative_bucket

V10 = dict(vocab_size=53, d_model=20, d_kv=7, d_ff=36, num_layers=2, num_decoder_layers=3, num_heads=3,
           feed_forward_proj="relu", relative_attention_num_buckets=8, relative_attention_max_distance=12)
V11 = dict(vocab_size=47, d_model=24, d_kv=4, d_ff=28, num_layers=3, num_decoder_layers=1, num_heads=5,
           feed_forward_proj="gated-gelu", tie_word_embeddings=False, relative_attention_num_buckets=10,
           relative_attention_max_distance=16)
FLAVOURS = {"v1.0": V10, "v1.1": V11}
NO_EOS = dict(eos_token_id=None, decoder_start_token_id=0, pad_token_id=0)


@pytest.fixture(scope="module", params=list(FLAVOURS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("t5")
    hf = transformers.T5ForConditionalGeneration(transformers.T5Config(**FLAVOURS[request.param], **NO_EOS))
    hf = save_hf(hf, path, seed=20 + len(request.param))
    return hf, tformer.from_hf(path)


def test_config_reads_both_flavours(pair):
    hf, ours = pair
    c = ours.cfg
    assert (c.kind, c.positional, c.norm, c.bias, c.attention_scale) == ("encoder-decoder", "relative", "rmsnorm",
                                                                         False, False)
    assert c.head_dim * c.n_heads != c.d_model and c.n_layers != c.decoder_layers
    gated = hf.config.is_gated_act
    assert (c.activation, c.output_scale) == (("geglu", False) if gated else ("relu", True))


def test_forward_equals_hf_on_padded_batches(pair):
    hf, ours = pair
    src, src_mask = batch(ours.cfg.vocab_size, 3, 15, seed=1)      # longer than max_distance: the far buckets
    tgt, tgt_mask = batch(ours.cfg.vocab_size, 3, 14, seed=2)
    with torch.no_grad():
        out = hf(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
        assert_close_real(ours.encode(src, src_mask), out.encoder_last_hidden_state, src_mask)
        assert_close_real(ours(src, tgt, src_mask, tgt_mask), out.logits, tgt_mask)


def test_greedy_and_beam_generation_equal_hf(pair):
    hf, ours = pair
    hf, ours = hf.double(), ours.double()        # fp64: no near-ties decided by rounding
    # transformers 5 sizes T5's decoder cache by num_layers (the encoder's depth) and fails when the decoder
    # is deeper; its uncached path is the reference then
    hf_kw = dict(do_sample=False, use_cache=hf.config.num_decoder_layers <= hf.config.num_layers)
    src, src_mask = batch(ours.cfg.vocab_size, 3, 9, seed=3)
    try:
        with torch.no_grad():
            for beams in (1, 4):
                expected = hf.generate(input_ids=src, attention_mask=src_mask, max_new_tokens=20, num_beams=beams,
                                       **hf_kw)
                got = ours.generate(src, src_mask, max_new_tokens=20, num_beams=beams, eos_token_id=[])
                assert expected.shape == (3, 21) and torch.equal(got, expected), beams
                if beams == 1:
                    eos = expected[:, 2].unique().tolist()    # ids the model does produce: hypotheses end early
            expected = hf.generate(input_ids=src, attention_mask=src_mask, max_new_tokens=12, num_beams=4,
                                   eos_token_id=eos, **hf_kw)
            assert torch.equal(ours.generate(src, src_mask, max_new_tokens=12, num_beams=4, eos_token_id=eos),
                               expected)
            torch.manual_seed(0)
            sampled = ours.generate(src, src_mask, max_new_tokens=6, do_sample=True, temperature=0.8, top_k=10)
            assert sampled.shape[0] == 3 and bool((sampled < ours.cfg.vocab_size).all())
    finally:
        hf.float(), ours.float()


def test_cached_decoding_equals_a_full_forward(pair):
    """The relative bias of each new query against every cached key, step by step."""
    _, ours = pair
    src, src_mask = batch(ours.cfg.vocab_size, 2, 8, seed=4)
    tgt = torch.randint(0, ours.cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        memory = ours.encode(src, src_mask)
        full = ours.decode(tgt, memory, src_mask)
        cache = ours.new_cache(2, 16)
        first = ours.step(tgt[:, :4], cache, memory=memory, src_mask=src_mask, all_logits=True)
        steps = [ours.step(tgt[:, i:i + 1], cache, memory=memory, src_mask=src_mask) for i in range(4, 11)]
    torch.testing.assert_close(torch.cat([first, torch.stack(steps, 1)], 1), full, rtol=1e-4, atol=1e-5)


def t5_bucket(d: int, bidirectional: bool, n: int, max_distance: int) -> int:
    """The T5 paper's bucketing of one offset d = key - query, written out with Python's math."""
    offset = 0
    if bidirectional:
        n //= 2
        offset = n if d > 0 else 0
        d = abs(d)
    else:
        d = max(-d, 0)
    exact = n // 2
    if d < exact:
        return offset + d
    return offset + min(n - 1, exact + int(math.log(d / exact) / math.log(max_distance / exact) * (n - exact)))


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_buckets_follow_the_formula(bidirectional):
    offsets = torch.arange(-300, 301)
    got = relative_bucket(offsets, bidirectional, 32, 128)
    assert got.tolist() == [t5_bucket(d, bidirectional, 32, 128) for d in offsets.tolist()]
    bias = RelativePositionBias(3, 32, 128, bidirectional)
    table = bias(4, 9, offset=5)                               # queries at 5..8 after 5 cached positions
    assert table.shape == (1, 3, 4, 9)
    for i in range(4):
        for j in range(9):
            assert torch.equal(table[0, :, i, j], bias.weight[t5_bucket(j - (5 + i), bidirectional, 32, 128)])


def test_to_hf_round_trips_and_loads_in_transformers(pair, tmp_path):
    hf, ours = pair
    out = tformer.to_hf(ours, tmp_path / "export")
    assert state_equal(tformer.from_hf(out), ours)
    reloaded = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    assert type(reloaded) is transformers.T5ForConditionalGeneration
    src, src_mask = batch(ours.cfg.vocab_size, 2, 7, seed=6)
    tgt, tgt_mask = batch(ours.cfg.vocab_size, 2, 5, seed=7)
    with torch.no_grad():
        theirs = reloaded(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt,
                          decoder_attention_mask=tgt_mask).logits
        assert_close_real(ours(src, tgt, src_mask, tgt_mask), theirs, tgt_mask)


def test_an_untied_v11_file_keeps_its_own_output_layer(tmp_path):
    """Older v1.1 / Flan-T5 files: tie_word_embeddings=false, an lm_head.weight of their own, no scaling.
    transformers 5 ties T5's head, so the reference is its decoder's output times that matrix."""
    from safetensors.torch import load_file, save_file

    hf = save_hf(transformers.T5ForConditionalGeneration(transformers.T5Config(**V11, **NO_EOS)), tmp_path, seed=9)
    head = 0.3 * torch.randn(V11["vocab_size"], V11["d_model"], generator=torch.Generator().manual_seed(1))
    state = load_file(tmp_path / "model.safetensors")
    save_file({**state, "lm_head.weight": head}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("scale_decoder_outputs")
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    ours = tformer.from_hf(tmp_path)
    assert (ours.cfg.tie_embeddings, ours.cfg.output_scale) == (False, False)
    src, src_mask = batch(V11["vocab_size"], 2, 8, seed=10)
    tgt, tgt_mask = batch(V11["vocab_size"], 2, 6, seed=11)
    with torch.no_grad():
        memory = hf.encoder(input_ids=src, attention_mask=src_mask).last_hidden_state
        hidden = hf.decoder(input_ids=tgt, attention_mask=tgt_mask, encoder_hidden_states=memory,
                            encoder_attention_mask=src_mask).last_hidden_state
        assert_close_real(ours(src, tgt, src_mask, tgt_mask), hidden @ head.T, tgt_mask)
    out = tformer.to_hf(ours, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert state_equal(tformer.from_hf(out), ours)


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_t5_encoder_model_is_an_encoder(flavour, tmp_path):
    kw = {k: v for k, v in FLAVOURS[flavour].items() if k not in ("num_decoder_layers", "tie_word_embeddings")}
    hf = save_hf(transformers.T5EncoderModel(transformers.T5Config(**kw)), tmp_path, seed=12)
    ours = tformer.from_hf(tmp_path)
    assert ours.kind == "encoder"
    ids, mask = batch(kw["vocab_size"], 3, 13, seed=13)
    with torch.no_grad():
        assert_close_real(ours(ids, mask), hf(input_ids=ids, attention_mask=mask).last_hidden_state, mask)
    out = tformer.to_hf(ours, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["T5EncoderModel"]
    assert state_equal(tformer.from_hf(out), ours)
    reloaded = transformers.T5EncoderModel.from_pretrained(out).eval()
    with torch.no_grad():
        assert_close_real(ours(ids, mask), reloaded(input_ids=ids, attention_mask=mask).last_hidden_state, mask)


@pytest.mark.parametrize("change, named", [
    (dict(feed_forward_proj="gated-relu"), "feed_forward_proj"),
    (dict(feed_forward_proj="tanh"), "feed_forward_proj"),
])
def test_what_tformer_lacks_is_refused(change, named, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", **V10, **change}))
    with pytest.raises(ConfigError, match=named):
        tformer.from_hf(tmp_path)


def test_export_refuses_a_t5_with_per_stack_heads(tmp_path):
    cfg = tformer.ModelConfig(kind="encoder-decoder", vocab_size=30, d_model=16, n_heads=2, n_decoder_heads=4,
                              positional="relative", norm="rmsnorm", bias=False, attention_scale=False,
                              activation="relu", norm_position="pre", pad_token_id=0)
    with pytest.raises(ConfigError, match="t5 does not fit: n_decoder_heads=4"):
        tformer.to_hf(tformer.EncoderDecoder(cfg), tmp_path / "x")


def test_import_hf_and_export_hf_commands(tmp_path, capsys):
    from tformer.cli import main

    hf = save_hf(transformers.T5ForConditionalGeneration(transformers.T5Config(**V10, **NO_EOS)), tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    assert main(["export-hf", str(tmp_path / "ours"), str(tmp_path / "back")]) == 0
    assert "as t5 (T5ForConditionalGeneration)" in capsys.readouterr().out
    reloaded = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "back").eval()
    src, src_mask = batch(V10["vocab_size"], 2, 6, seed=14)
    tgt, tgt_mask = batch(V10["vocab_size"], 2, 5, seed=15)
    with torch.no_grad():
        kw = dict(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
        assert_close_real(reloaded(**kw).logits, hf(**kw).logits, tgt_mask)
