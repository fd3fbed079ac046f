"""GPT-2 and Llama checkpoints: tformer's Decoder equals Hugging Face's, forward and greedy
generation, on tiny random configs; to_hf round-trips and loads in transformers."""

import pytest
import torch

import tformer
from hf_util import assert_close_real, batch, save_hf, state_equal, transformers
from tformer.errors import ConfigError

GPT2 = [
    dict(vocab_size=61, n_embd=24, n_head=3, n_layer=2, n_positions=48),                      # odd heads
    dict(vocab_size=50, n_embd=20, n_head=5, n_layer=3, n_inner=36, n_positions=48, activation_function="relu",
         layer_norm_epsilon=1e-6, tie_word_embeddings=False),                                  # untied head
]
LLAMA = [
    dict(vocab_size=61, hidden_size=24, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
         intermediate_size=40, max_position_embeddings=48),                                     # GQA
    dict(vocab_size=37, hidden_size=30, num_attention_heads=3, num_key_value_heads=1, num_hidden_layers=3,
         intermediate_size=28, max_position_embeddings=48, rms_norm_eps=1e-5, tie_word_embeddings=True,
         rope_parameters={"rope_type": "default", "rope_theta": 500.0}),                         # MQA, tied
]
CASES = [("gpt2", transformers.GPT2Config, transformers.GPT2LMHeadModel, c) for c in GPT2] + \
        [("llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, c) for c in LLAMA]


@pytest.fixture(scope="module", params=range(len(CASES)), ids=["gpt2-a", "gpt2-b", "llama-a", "llama-b"])
def pair(request, tmp_path_factory):
    """(HF model, tformer model imported from its directory, directory)."""
    name, config_cls, model_cls, kw = CASES[request.param]
    path = tmp_path_factory.mktemp(name)
    # No EOS, so both sides generate exactly max_new_tokens.
    hf = save_hf(model_cls(config_cls(**kw, bos_token_id=None, eos_token_id=None, pad_token_id=0)), path,
                 seed=request.param)
    return hf, tformer.from_hf(path), path


def test_forward_equals_hf_on_padded_batch(pair):
    hf, ours, _ = pair
    assert type(ours).__name__ == "Decoder"
    ids, mask = batch(ours.cfg.vocab_size, 3, 11, seed=1, pad_side="right")
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
        assert_close_real(ours(ids, mask), expected, mask)
        torch.testing.assert_close(ours(ids[:1]), hf(input_ids=ids[:1]).logits, rtol=1e-4, atol=1e-5)


def test_greedy_generation_equals_hf(pair):
    hf, ours, _ = pair
    ids, mask = batch(ours.cfg.vocab_size, 3, 6, seed=2, pad_side="left")   # left padding, as HF generates
    with torch.no_grad():
        expected = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, do_sample=False, num_beams=1,
                               pad_token_id=0)
        got = ours.generate(ids, mask, max_new_tokens=32, eos_token_id=[])
    assert expected.shape == (3, 6 + 32)
    assert torch.equal(got, expected)


def test_to_hf_round_trips_and_loads_in_transformers(pair, tmp_path):
    hf, ours, _ = pair
    out = tformer.to_hf(ours, tmp_path / "export")
    assert state_equal(tformer.from_hf(out), ours)                           # from_hf(to_hf(m)) == m
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(hf)
    ids, mask = batch(ours.cfg.vocab_size, 2, 9, seed=3)
    with torch.no_grad():
        assert_close_real(reloaded(input_ids=ids, attention_mask=mask).logits, ours(ids, mask), mask)


def test_export_refuses_a_decoder_no_family_fits():
    cfg = tformer.ModelConfig(kind="decoder", vocab_size=40, d_model=16, n_heads=2, n_layers=1,
                              positional="sinusoidal", activation="gelu")
    with pytest.raises(ConfigError, match="positional='sinusoidal'"):
        tformer.to_hf(tformer.Decoder(cfg), "/nonexistent/never-written")


@pytest.mark.parametrize("change, named", [
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (dict(add_cross_attention=True), "add_cross_attention"),
    (dict(activation_function="gelu_fast"), "gelu_fast"),
])
def test_gpt2_features_tformer_lacks_are_refused(change, named, tmp_path):
    transformers.GPT2Config(**GPT2[0], **change).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=named):
        tformer.from_hf(tmp_path)


@pytest.mark.parametrize("change, named", [
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "linear"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_llama_features_tformer_lacks_are_refused(change, named, tmp_path):
    transformers.LlamaConfig(**{**LLAMA[0], **change}).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=named):
        tformer.from_hf(tmp_path)
