"""Marian and BART checkpoints: tformer's EncoderDecoder equals Hugging Face's, forward (padded
source and target) and greedy generation, on tiny random configs with different encoder and
decoder depths; to_hf round-trips and loads in transformers; what tformer lacks is refused."""

import pytest
import torch

import tformer
from hf_util import assert_close_real, batch, save_hf, state_equal, transformers
from tformer.errors import CheckpointError, ConfigError

MARIAN = [
    dict(vocab_size=61, d_model=24, encoder_attention_heads=3, decoder_attention_heads=3, encoder_layers=2,
         decoder_layers=1, encoder_ffn_dim=40, decoder_ffn_dim=40, max_position_embeddings=64,
         scale_embedding=True, activation_function="swish", pad_token_id=60, decoder_start_token_id=60),
    dict(vocab_size=45, d_model=20, encoder_attention_heads=5, decoder_attention_heads=5, encoder_layers=1,
         decoder_layers=3, encoder_ffn_dim=36, decoder_ffn_dim=36, max_position_embeddings=64,
         activation_function="relu", pad_token_id=44, decoder_start_token_id=44, tie_word_embeddings=False),
    dict(vocab_size=45, d_model=24, encoder_attention_heads=6, decoder_attention_heads=4, encoder_layers=3,
         decoder_layers=1, encoder_ffn_dim=48, decoder_ffn_dim=20, max_position_embeddings=64,
         scale_embedding=True, pad_token_id=44, decoder_start_token_id=44),      # the two stacks differ
]
BART = [
    dict(vocab_size=61, d_model=24, encoder_attention_heads=3, decoder_attention_heads=3, encoder_layers=2,
         decoder_layers=1, encoder_ffn_dim=40, decoder_ffn_dim=40, max_position_embeddings=64),
    dict(vocab_size=45, d_model=20, encoder_attention_heads=5, decoder_attention_heads=5, encoder_layers=1,
         decoder_layers=3, encoder_ffn_dim=36, decoder_ffn_dim=36, max_position_embeddings=64,
         scale_embedding=True, activation_function="gelu_new", tie_word_embeddings=False),
    dict(vocab_size=61, d_model=32, encoder_attention_heads=4, decoder_attention_heads=8, encoder_layers=2,
         decoder_layers=3, encoder_ffn_dim=40, decoder_ffn_dim=56, max_position_embeddings=64),  # the shape
]
CASES = [(transformers.MarianConfig, transformers.MarianMTModel, c) for c in MARIAN] + \
        [(transformers.BartConfig, transformers.BartForConditionalGeneration, c) for c in BART]
NO_EOS = dict(eos_token_id=None, forced_eos_token_id=None)   # both sides generate exactly max_new_tokens


@pytest.fixture(scope="module", params=range(len(CASES)),
                ids=["marian-a", "marian-b", "marian-c", "bart-a", "bart-b", "bart-c"])
def pair(request, tmp_path_factory):
    config_cls, model_cls, kw = CASES[request.param]
    path = tmp_path_factory.mktemp("s2s")
    hf = save_hf(model_cls(config_cls(**kw, **NO_EOS)), path, seed=10 + request.param,
                 share_embeddings=not kw.get("tie_word_embeddings", True))
    return hf, tformer.from_hf(path)


def test_encoder_and_decoder_may_differ_in_heads_ffn_width_and_depth(pair):
    hf, ours = pair
    enc, dec = hf.config, ours.cfg.stack_config("decoder")
    assert (ours.cfg.n_heads, ours.cfg.ffn_dim, ours.cfg.n_layers) == (
        enc.encoder_attention_heads, enc.encoder_ffn_dim, enc.encoder_layers)
    assert (dec.n_heads, dec.ffn_dim, dec.n_layers) == (enc.decoder_attention_heads, enc.decoder_ffn_dim,
                                                        enc.decoder_layers)


def test_forward_equals_hf_with_padding_on_both_sides(pair):
    hf, ours = pair
    assert type(ours).__name__ == "EncoderDecoder"
    assert ours.cfg.n_layers != ours.cfg.decoder_layers
    src, src_mask = batch(ours.cfg.vocab_size, 3, 9, seed=4)
    tgt, tgt_mask = batch(ours.cfg.vocab_size, 3, 7, seed=5)
    with torch.no_grad():
        out = hf(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
        assert_close_real(ours.encode(src, src_mask), out.encoder_last_hidden_state, src_mask)
        assert_close_real(ours(src, tgt, src_mask, tgt_mask), out.logits, tgt_mask)


def test_greedy_generation_equals_hf(pair):
    hf, ours = pair
    src, src_mask = batch(ours.cfg.vocab_size, 3, 8, seed=6)
    with torch.no_grad():
        expected = hf.generate(input_ids=src, attention_mask=src_mask, max_new_tokens=32, do_sample=False,
                               num_beams=1)
        got = ours.generate(src, src_mask, max_new_tokens=32, eos_token_id=[])
    assert expected.shape == (3, 1 + 32)
    assert torch.equal(got, expected)


def test_to_hf_round_trips_and_loads_in_transformers(pair, tmp_path):
    hf, ours = pair
    out = tformer.to_hf(ours, tmp_path / "export")
    assert state_equal(tformer.from_hf(out), ours)
    reloaded = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    assert type(reloaded) is type(hf)
    src, src_mask = batch(ours.cfg.vocab_size, 2, 6, seed=7)
    tgt, tgt_mask = batch(ours.cfg.vocab_size, 2, 5, seed=8)
    with torch.no_grad():
        theirs = reloaded(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt,
                          decoder_attention_mask=tgt_mask).logits
        assert_close_real(ours(src, tgt, src_mask, tgt_mask), theirs, tgt_mask)


def test_marian_position_table_is_checked(tmp_path):
    """A stored table that is not the formula would be silently replaced: refused instead."""
    from safetensors.torch import load_file, save_file

    from tformer.model.positional import sinusoidal_table

    save_hf(transformers.MarianMTModel(transformers.MarianConfig(**MARIAN[0])), tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["model.encoder.embed_positions.weight"] = sinusoidal_table(64, 24, "split")   # what HF computes
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    tformer.from_hf(tmp_path)
    state["model.encoder.embed_positions.weight"] = sinusoidal_table(64, 24, "interleaved")
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="encoder.embed_positions.weight"):
        tformer.from_hf(tmp_path)


def test_separate_encoder_and_decoder_embeddings_are_refused(tmp_path):
    # transformers 5 with an untied head keeps three independent embedding tensors
    save_hf(transformers.BartForConditionalGeneration(transformers.BartConfig(**BART[1])), tmp_path)
    with pytest.raises(CheckpointError, match="embed_tokens.weight differ"):
        tformer.from_hf(tmp_path)


@pytest.mark.parametrize("family, change, named", [
    ("bart", dict(normalize_before=True), "normalize_before"),
    ("bart", dict(add_final_layer_norm=True), "add_final_layer_norm"),
    ("marian", dict(share_encoder_decoder_embeddings=False), "share_encoder_decoder_embeddings"),
    ("bart", dict(decoder_attention_heads=5), "d_model=24 must be divisible by n_decoder_heads=5"),
])
def test_features_tformer_lacks_are_refused(family, change, named, tmp_path):
    base = {"bart": BART[0], "marian": MARIAN[0]}[family]
    config = {"bart": transformers.BartConfig, "marian": transformers.MarianConfig}[family](**{**base, **change})
    config.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=named):
        tformer.from_hf(tmp_path)


@pytest.mark.parametrize("layout", ["split", "interleaved"])
def test_a_tformer_2017_model_exports_to_marian(layout, tmp_path):
    """tformer's own 2017-style model (post-LN, sinusoidal, scaled embeddings), either table layout:
    the interleaved one is exported by re-ordering the residual dimensions, an identical function."""
    torch.manual_seed(0)
    cfg = tformer.preset("transformer-base", vocab_size=37, d_model=16, n_heads=2, n_layers=2, n_decoder_layers=1,
                         d_ff=24, max_seq_len=32, dropout=0.0, pad_token_id=0, sinusoidal_layout=layout)
    ours = tformer.EncoderDecoder(cfg).eval()
    with torch.no_grad():                                 # non-trivial norms, so their order matters
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    tformer.to_hf(ours, tmp_path / "m")
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "m").eval()
    assert type(hf) is transformers.MarianMTModel
    src, src_mask = batch(37, 2, 7, seed=11)
    tgt, tgt_mask = batch(37, 2, 5, seed=12)
    with torch.no_grad():
        theirs = hf(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
        assert_close_real(ours(src, tgt, src_mask, tgt_mask), theirs.logits, tgt_mask)


def test_export_refuses_an_encoder_decoder_no_family_fits(tmp_path):
    cfg = tformer.preset("transformer-base", vocab_size=30, d_model=16, n_heads=2, n_layers=1, d_ff=24,
                         max_seq_len=16, pad_token_id=0, norm_position="pre")
    with pytest.raises(ConfigError, match="marian does not fit: norm_position='pre'"):
        tformer.to_hf(tformer.EncoderDecoder(cfg), tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_export_refuses_a_separate_source_vocabulary(tmp_path):
    cfg = tformer.preset("transformer-base", vocab_size=30, src_vocab_size=40, d_model=16, n_heads=2, n_layers=1,
                         d_ff=24, max_seq_len=16, pad_token_id=0)      # Marian-shaped but for the vocabulary
    with pytest.raises(ConfigError, match="marian does not fit: src_vocab_size=40 .*one vocabulary shared") as e:
        tformer.to_hf(tformer.EncoderDecoder(cfg), tmp_path / "x")
    assert "\n" not in str(e.value) and not (tmp_path / "x").exists()
