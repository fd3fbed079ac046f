"""ModelConfig: JSON round trip, validation naming the field, presets."""

import json

import pytest
import torch

from tformer import PRESETS, Decoder, Encoder, EncoderDecoder, ModelConfig, preset
from tformer.errors import ConfigError


def test_json_round_trip_keeps_every_field():
    cfg = ModelConfig(kind="encoder-decoder", vocab_size=99, d_model=48, n_heads=6, n_layers=3,
                      n_decoder_layers=1, n_kv_heads=2, d_ff=100, positional="rope", activation="swiglu",
                      norm="rmsnorm", bias=False, tie_embeddings=False, norm_eps=1e-6, eos_token_id=2)
    again = ModelConfig.from_json(cfg.to_json())
    assert again == cfg
    assert json.loads(cfg.to_json())["n_decoder_layers"] == 1
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert (cfg.head_dim, cfg.kv_heads, cfg.ffn_dim, cfg.decoder_layers) == (8, 2, 100, 1)


def test_src_vocab_size_round_trips_and_old_configs_load_without_it():
    cfg = ModelConfig(kind="encoder-decoder", vocab_size=99, src_vocab_size=123)
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    assert json.loads(cfg.to_json())["src_vocab_size"] == 123
    old = {k: v for k, v in ModelConfig(kind="encoder-decoder").to_dict().items() if k != "src_vocab_size"}
    assert ModelConfig.from_dict(old).src_vocab_size is None          # a config.json from before the field


def test_per_stack_shapes_round_trip_and_shape_the_decoder():
    cfg = ModelConfig(kind="encoder-decoder", d_model=32, n_heads=4, n_layers=2, n_decoder_layers=3,
                      n_decoder_heads=8, d_ff=40, d_decoder_ff=56)
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    dec = cfg.stack_config("decoder")
    assert (dec.n_heads, dec.head_dim, dec.ffn_dim, dec.n_layers) == (8, 4, 56, 3)
    assert cfg.stack_config("encoder") is cfg
    model = EncoderDecoder(cfg)
    assert (model.encoder.layers[0].attn.n_heads, model.decoder.layers[0].attn.n_heads,
            model.decoder.layers[0].cross_attn.n_heads) == (4, 8, 8)
    assert (model.encoder.layers[0].ffn.down.in_features, model.decoder.layers[0].ffn.down.in_features) == (40, 56)
    assert (len(model.encoder.layers), len(model.decoder.layers)) == (2, 3)
    cache = model.new_cache(2, 10)
    assert cache.layers[0].k.shape == (2, 8, 10, 4)


def test_configs_saved_before_the_per_stack_and_t5_fields_still_load():
    new = ("n_decoder_heads", "d_decoder_ff", "head_size", "relative_buckets", "relative_max_distance",
           "attention_scale", "output_scale")
    old = {k: v for k, v in ModelConfig(kind="encoder-decoder").to_dict().items() if k not in new}
    cfg = ModelConfig.from_dict(old)
    assert (cfg.n_decoder_heads, cfg.d_decoder_ff, cfg.head_size, cfg.attention_scale) == (None, None, None, True)


def test_attention_dropout_follows_dropout_unless_set():
    assert ModelConfig(dropout=0.2).attention_dropout == 0.2
    assert ModelConfig(dropout=0.2, attn_dropout=0.0).attention_dropout == 0.0
    cfg = ModelConfig(dropout=0.1, attn_dropout=0.05, ffn_dropout=0.3)
    assert ModelConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("fields,named", [
    (dict(d_model=30, n_heads=4), "d_model"),
    (dict(activation="tanh"), "activation"),
    (dict(kind="gpt"), "kind"),
    (dict(norm_position="middle"), "norm_position"),
    (dict(positional="alibi"), "positional"),
    (dict(norm="batchnorm"), "norm"),
    (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
    (dict(d_model=24, n_heads=8, positional="rope"), "rope"),
    (dict(dropout=1.0), "dropout"),
    (dict(dropout="high"), "dropout"),
    (dict(attn_dropout=-0.1), "attn_dropout"),
    (dict(ffn_dropout=1.5), "ffn_dropout"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(n_layers=2.5), "n_layers"),
    (dict(n_decoder_layers=2), "n_decoder_layers"),
    (dict(norm_eps=-1.0), "norm_eps"),
    (dict(rope_theta=0), "rope_theta"),
    (dict(sinusoidal_layout="zigzag"), "sinusoidal_layout"),
    (dict(bias="yes"), "bias"),
    (dict(pad_token_id=-1), "pad_token_id"),
    (dict(src_vocab_size=40), "src_vocab_size"),                       # only for an encoder-decoder
    (dict(kind="encoder-decoder", src_vocab_size=0), "src_vocab_size"),
    (dict(kind="encoder-decoder", src_vocab_size=True), "src_vocab_size"),
    (dict(n_decoder_heads=2), "n_decoder_heads"),                      # only for an encoder-decoder
    (dict(d_decoder_ff=64), "d_decoder_ff"),
    (dict(kind="encoder-decoder", d_model=32, n_decoder_heads=5), "n_decoder_heads=5"),
    (dict(kind="encoder-decoder", n_heads=4, n_kv_heads=2, n_decoder_heads=3, head_size=8), "n_kv_heads"),
    (dict(kind="encoder-decoder", d_model=24, n_heads=4, n_decoder_heads=8, positional="rope"), "n_decoder_heads=8"),
    (dict(head_size=0), "head_size"),
    (dict(positional="relative", relative_buckets=2), "relative_buckets"),
    (dict(positional="relative", relative_buckets=32, relative_max_distance=16), "relative_max_distance"),
    (dict(attention_scale="no"), "attention_scale"),
    (dict(output_scale=True), "output_scale"),
])
def test_invalid_configs_raise_value_error_naming_the_field(fields, named):
    with pytest.raises(ValueError, match=named):
        ModelConfig(**fields)


def test_allowed_values_are_listed():
    with pytest.raises(ConfigError, match="gelu, gelu_tanh, relu, silu, swiglu, geglu"):
        ModelConfig(activation="tanh")


def test_bad_json_and_unknown_fields():
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json("{nope")
    with pytest.raises(ConfigError, match="d_modle"):
        ModelConfig.from_dict({"d_modle": 64})
    with pytest.raises(ConfigError, match="JSON object"):
        ModelConfig.from_json("[1, 2]")


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_build(name):
    cfg = preset(name)
    cls = {"decoder": Decoder, "encoder": Encoder, "encoder-decoder": EncoderDecoder}[cfg.kind]
    with torch.device("meta"):                                          # shapes only: no memory, no time
        model = cls(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert n > 0
    if name == "gpt2-small":                                           # GPT-2 small has 124.4M parameters
        assert abs(n - 124_439_808) < 1000
    if name == "bert-base":                                            # BERT-base encoder without pooler
        assert abs(n - 108_891_648) < 1000
    if name == "t5-small":                                             # T5ForConditionalGeneration t5-small
        assert n == 60_506_624
    if name == "flan-t5-small":                                        # google/flan-t5-small (untied head)
        assert n == 76_961_152


def test_preset_overrides_and_unknown_name():
    assert preset("tiny", vocab_size=11).vocab_size == 11
    with pytest.raises(ConfigError, match="tiny"):
        preset("huge")
