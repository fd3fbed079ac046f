"""GGUF in and out (tformer.checkpoints.gguf, `tformer export-gguf` / `import-gguf`).

Independent references: the gguf package's own tables (gguf.Keys, MODEL_TENSORS / TENSOR_NAMES) for
the names llama.cpp reads; the tensor shapes llama.cpp's loader declares (src/models/gpt2.cpp,
llama.cpp, written out below in ggml's order); the q/k permutation and q8_0 written out from their
definitions; and transformers' own GGUF loader, which must compute what the Hugging Face model a
tformer model was imported from computes. llama.cpp itself: tests/test_gguf_llama_cpp.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from gguf_util import SHAPES, TEXT, VOCAB, bpe_tokenizer, decoder, gguf, logits
from tformer.checkpoints.gguf import from_gguf, to_gguf
from tformer.data.tokenizers import Tokenizer
from tformer.errors import ConfigError

IDS = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
# Each weight's error: f16 rounds to half an ulp (relative 2^-11), bf16 likewise (2^-8); q8_0 to half a
# step of its block's scale, max|block| / 127 (relative 1/254 of the block's largest weight). These random
# models amplify weight noise into the logits about 10-15 times (measured max|Δ| / max|logit|: f16 3.5e-3,
# q8_0 7.5e-2, over three seeds of each shape), so each bound is 30 times the per-weight error.
TOLERANCE = {"f16": 30 * 2 ** -11, "bf16": 30 * 2 ** -8, "q8_0": 30 / 254}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return bpe_tokenizer()


def reader(path):
    return gguf.GGUFReader(path)


def field(r, key):
    return r.fields[key].contents()


# --- round trips ------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
def test_f32_round_trip_is_exact(shape, tokenizer, tmp_path):
    model = decoder(shape, tokenizer)
    back, tok, template = from_gguf(to_gguf(model, tmp_path / "m.gguf", tokenizer=tokenizer, chat_template="{{ x }}"))
    assert back.cfg == model.cfg
    assert torch.equal(logits(back, IDS), logits(model, IDS))
    assert template == "{{ x }}"
    for text in (TEXT, "Hello wörld, ça va?\n\n\t  123 456 — 生存 <eos> <pad>", " leading and trailing  "):
        assert tok.encode(text) == tokenizer.encode(text)
        assert tok.decode(tok.encode(text)) == text
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id)


def test_a_llama_3_style_tokenizer_is_written_as_llama_bpe(tokenizer, tmp_path):
    from gguf_util import llama3_style_tokenizer

    llama3 = llama3_style_tokenizer()
    to_gguf(decoder("llama", tokenizer), tmp_path / "m.gguf", tokenizer=llama3)
    assert field(reader(tmp_path / "m.gguf"), gguf.Keys.Tokenizer.PRE) == "llama-bpe"
    back = from_gguf(tmp_path / "m.gguf")[1]
    for text in (TEXT, "it's 12345 tokens,\r\n\n  spaced   out"):
        assert back.encode(text) == llama3.encode(text) and back.decode(back.encode(text)) == text


def f16(w):
    return w.half().float()


def bf16(w):
    return w.bfloat16().float()       # round to nearest even, as ggml's fp32 -> bf16 (GGML_FP32_TO_BF16)


def q8_0(w):
    """ggml's q8_0 (quantize_row_q8_0_ref, dequantize_row_q8_0): blocks of 32 weights along a row,
    scale d = max|x| / 127 stored as f16, q = roundf(x / d) in int8; the weight read back is q * d."""
    blocks = w.reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    x = blocks * torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.sign(x) * torch.floor(x.abs() + 0.5)                     # roundf: halves away from zero
    return (q * f16(d)).reshape(w.shape)


@pytest.mark.parametrize("type", ["f16", "bf16", "q8_0"])
@pytest.mark.parametrize("shape", SHAPES)
def test_f16_bf16_and_q8_0_round_trips(shape, type, tokenizer, tmp_path):
    """The weights read back are exactly the definition's rounding of each matrix (q8_0 only where
    rows are a multiple of 32 long, else f16; norms, biases, positions untouched), and the logits
    stay within the stated bound; where the model is far from a tie, its choice does not change."""
    model = decoder(shape, tokenizer)
    back, _, _ = from_gguf(to_gguf(model, tmp_path / "m.gguf", tokenizer=tokenizer, type=type))
    got = back.state_dict()
    for name, w in model.state_dict().items():
        if w.dim() < 2 or "embed.position" in name:
            want = w
        else:
            want = bf16(w) if type == "bf16" else q8_0(w) if type == "q8_0" and w.shape[-1] % 32 == 0 else f16(w)
        torch.testing.assert_close(got[name], want, rtol=0, atol=0, msg=name)
    a, b = logits(model, IDS), logits(back, IDS)
    bound = TOLERANCE[type] * a.abs().max()
    assert (a - b).abs().max() <= bound
    top2 = a.topk(2).values
    clear = top2[..., 0] - top2[..., 1] > 2 * bound
    assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


# --- what llama.cpp reads: metadata, tensor names and shapes ------------------------------------------
def expected_tensors(shape: str, cfg) -> dict[str, tuple[int, ...]]:
    """GGUF name -> shape in ggml's order (row length first), as llama.cpp's loader creates them
    (llama_model_gpt2/llama::load_arch_tensors): n_embd_gqa = kv heads * head size."""
    e, v, f, hd = cfg.d_model, cfg.vocab_size, cfg.ffn_dim, cfg.head_dim
    gqa = cfg.kv_heads * hd
    T = gguf.MODEL_TENSOR
    if shape == "gpt2":
        top = {T.TOKEN_EMBD: (e, v), T.POS_EMBD: (e, cfg.max_seq_len), T.OUTPUT_NORM: (e,)}
        block = {T.ATTN_NORM: (e,), T.ATTN_QKV: (e, e + 2 * gqa), T.ATTN_OUT: (e, e), T.FFN_NORM: (e,),
                 T.FFN_DOWN: (f, e), T.FFN_UP: (e, f)}
        biases = {T.OUTPUT_NORM: (e,), T.ATTN_NORM: (e,), T.ATTN_QKV: (e + 2 * gqa,), T.ATTN_OUT: (e,),
                  T.FFN_NORM: (e,), T.FFN_DOWN: (e,), T.FFN_UP: (f,)}
    else:
        top = {T.TOKEN_EMBD: (e, v), T.OUTPUT_NORM: (e,)}
        block = {T.ATTN_NORM: (e,), T.ATTN_Q: (e, cfg.n_heads * hd), T.ATTN_K: (e, gqa), T.ATTN_V: (e, gqa),
                 T.ATTN_OUT: (cfg.n_heads * hd, e), T.FFN_NORM: (e,), T.FFN_GATE: (e, f), T.FFN_DOWN: (f, e),
                 T.FFN_UP: (e, f)}
        biases = {}
    if not cfg.tie_embeddings:
        top[T.OUTPUT] = (e, v)
    arch = gguf.MODEL_ARCH.GPT2 if shape == "gpt2" else gguf.MODEL_ARCH.LLAMA
    assert set(top) | set(block) <= set(gguf.MODEL_TENSORS[arch])       # names llama.cpp knows for the arch
    out = {gguf.TENSOR_NAMES[t] + ".weight": s for t, s in top.items()}
    for i in range(cfg.n_layers):
        out |= {gguf.TENSOR_NAMES[t].format(bid=i) + ".weight": s for t, s in block.items()}
    for t, s in biases.items():
        for i in range(cfg.n_layers if t in block else 1):
            out[gguf.TENSOR_NAMES[t].format(bid=i) + ".bias"] = s
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_the_file_has_what_llama_cpp_reads(shape, tokenizer, tmp_path):
    model = decoder(shape, tokenizer)
    cfg = model.cfg
    r = reader(to_gguf(model, tmp_path / "m.gguf", tokenizer=tokenizer, chat_template="{{ x }}", type="q8_0"))
    arch = "gpt2" if shape == "gpt2" else "llama"
    K = gguf.Keys
    assert field(r, K.General.ARCHITECTURE) == arch
    assert field(r, K.General.FILE_TYPE) == gguf.LlamaFileType.MOSTLY_Q8_0
    for key, want in ((K.LLM.CONTEXT_LENGTH, cfg.max_seq_len), (K.LLM.EMBEDDING_LENGTH, 64),
                      (K.LLM.BLOCK_COUNT, 2), (K.LLM.FEED_FORWARD_LENGTH, cfg.d_ff),
                      (K.Attention.HEAD_COUNT, 4), (K.Attention.HEAD_COUNT_KV, cfg.n_kv_heads or 4)):
        assert field(r, key.format(arch=arch)) == want, key
    if shape == "gpt2":
        assert field(r, K.Attention.LAYERNORM_EPS.format(arch=arch)) == pytest.approx(cfg.norm_eps)
    else:
        assert field(r, K.Attention.LAYERNORM_RMS_EPS.format(arch=arch)) == pytest.approx(cfg.norm_eps)
        assert field(r, K.Rope.DIMENSION_COUNT.format(arch=arch)) == 16
        assert field(r, K.Rope.FREQ_BASE.format(arch=arch)) == cfg.rope_theta
    tokens, types = field(r, K.Tokenizer.LIST), field(r, K.Tokenizer.TOKEN_TYPE)
    assert (field(r, K.Tokenizer.MODEL), field(r, K.Tokenizer.PRE)) == ("gpt2", "gpt-2")
    assert len(tokens) == len(types) == VOCAB and tokens[300:] == [f"[PAD{i}]" for i in range(300, VOCAB)]
    assert [types[i] for i in (0, 1, 2, 3, 300)] == [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL,
                                                                                      gguf.TokenType.UNUSED]
    assert tokens[:3] == ["<pad>", "<bos>", "<eos>"] and "Ġ" in tokens and "Ċ" in tokens    # byte-level spelling
    assert all(len(m.split(" ")) == 2 for m in field(r, K.Tokenizer.MERGES))
    assert (field(r, K.Tokenizer.BOS_ID), field(r, K.Tokenizer.EOS_ID)) == (1, 2)
    assert field(r, K.Tokenizer.ADD_BOS) is False
    assert field(r, K.Tokenizer.CHAT_TEMPLATE) == "{{ x }}"
    assert {t.name: tuple(int(n) for n in t.shape) for t in r.tensors} == expected_tensors(shape, cfg)
    Q = gguf.GGMLQuantizationType
    for t in r.tensors:       # norms, biases and positions f32; q8_0 where rows are multiples of 32, else f16
        want = (Q.F32 if len(t.shape) == 1 or t.name == "position_embd.weight" else
                Q.Q8_0 if int(t.shape[0]) % 32 == 0 else Q.F16)
        assert t.tensor_type == want, t.name


def test_llama_q_and_k_rows_are_interleaved_per_head(tokenizer, tmp_path):
    """llama.cpp rotates dimension pairs (2i, 2i+1); HF and tformer rotate (i, i + d/2). Row 2i of each
    GGUF head is the head's row i, row 2i+1 its row i + d/2 (k: per K/V head)."""
    model = decoder("llama", tokenizer)
    cfg = model.cfg
    r = reader(to_gguf(model, tmp_path / "m.gguf"))
    files = {t.name: torch.from_numpy(t.data.copy()) for t in r.tensors}
    hd, half = cfg.head_dim, cfg.head_dim // 2
    w = model.stack.layers[1].attn.qkv_proj.weight.detach()
    q, k = w[:cfg.n_heads * hd], w[cfg.n_heads * hd:(cfg.n_heads + cfg.kv_heads) * hd]
    for name, ours, heads in (("blk.1.attn_q.weight", q, cfg.n_heads), ("blk.1.attn_k.weight", k, cfg.kv_heads)):
        theirs = files[name]
        for h in range(heads):
            for i in range(half):
                assert torch.equal(theirs[h * hd + 2 * i], ours[h * hd + i])
                assert torch.equal(theirs[h * hd + 2 * i + 1], ours[h * hd + half + i])


def test_exact_gelu_is_kept_for_tformer(tokenizer, tmp_path):
    """llama.cpp's gpt2 computes tanh GELU; a model with exact GELU still reads back exactly."""
    model = decoder("gpt2", tokenizer, activation="gelu")
    back, _, _ = from_gguf(to_gguf(model, tmp_path / "m.gguf"))
    assert back.cfg.activation == "gelu" and torch.equal(logits(back, IDS), logits(model, IDS))


def test_bf16_tensors_are_read(tokenizer, tmp_path):
    from gguf_util import rewrite

    model = decoder("llama", tokenizer)
    to_gguf(model, tmp_path / "m.gguf")
    rewrite(tmp_path / "m.gguf", tmp_path / "bf16.gguf",
            tensor=lambda n, d, q: (n, d, gguf.GGMLQuantizationType.BF16 if d.ndim == 2 else q))
    back, _, _ = from_gguf(tmp_path / "bf16.gguf")
    for name, w in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], w.bfloat16().float() if w.dim() == 2 else w), name


# --- what is refused -----------------------------------------------------------------------------------
@pytest.mark.parametrize("make,words", [
    (lambda: Tokenizer.char(TEXT), "character tokenizer"),
    (lambda: Tokenizer.train_wordpiece(TEXT, 120), "wordpiece tokenizer"),
])
def test_tokenizers_llama_cpp_cannot_represent_are_refused(make, words, tokenizer, tmp_path):
    with pytest.raises(ConfigError, match=words):
        to_gguf(decoder("gpt2", tokenizer), tmp_path / "m.gguf", tokenizer=make())
    assert os.listdir(tmp_path) == []


def test_an_unknown_pre_tokenizer_is_refused(tokenizer, tmp_path):
    from tokenizers import pre_tokenizers

    other = Tokenizer.from_str(tokenizer.to_str())
    other.hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    with pytest.raises(ConfigError, match="prefix space"):
        to_gguf(decoder("gpt2", tokenizer), tmp_path / "m.gguf", tokenizer=other)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("overrides,words", [
    (dict(activation="relu"), "activation='relu'"),
    (dict(norm_position="post"), "norm_position"),
])
def test_decoders_llama_cpp_cannot_run_are_refused(overrides, words, tokenizer, tmp_path):
    with pytest.raises(ConfigError, match=words):
        to_gguf(decoder("gpt2", tokenizer, **overrides), tmp_path / "m.gguf")
    assert os.listdir(tmp_path) == []


def test_a_failed_write_leaves_nothing_and_keeps_the_old_file(tokenizer, tmp_path, monkeypatch):
    target = tmp_path / "m.gguf"
    target.write_bytes(b"old")

    def fail(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail)
    with pytest.raises(OSError):
        to_gguf(decoder("llama", tokenizer), target, tokenizer=tokenizer)
    assert os.listdir(tmp_path) == ["m.gguf"] and target.read_bytes() == b"old"


# --- an independent reader: transformers' GGUF loader --------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_transformers_reads_the_export_as_the_original(family, tokenizer, tmp_path):
    """A random HF model -> tformer.from_hf -> to_gguf -> transformers' from_pretrained(gguf_file=...)
    computes the HF model's logits: names, transposes, the q/k permutation and the metadata all agree."""
    import tformer
    from hf_util import save_hf

    transformers = pytest.importorskip("transformers")
    if family == "gpt2":     # transformers reads GPT-2's FFN width as 4 * n_embd, its position table as 1024
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_positions=1024, n_embd=32,
                                                                  n_layer=2, n_head=4))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rope_theta=50000.0))
    hf = save_hf(hf, tmp_path / "hf")
    to_gguf(tformer.from_hf(tmp_path / "hf"), tmp_path / "gguf" / "m.gguf", tokenizer=tokenizer)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gguf", gguf_file="m.gguf").eval()
    ids = IDS[:, :24]
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-5)


# --- the commands --------------------------------------------------------------------------------------
def run_main(argv, capsys) -> tuple[int, str, str]:
    from tformer.cli import main

    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def tree(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"dir") for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def ws(tmp_path_factory, tokenizer):
    """Checkpoints (Llama-shaped with a BPE tokenizer and a chat template; GPT-2-shaped with a char
    tokenizer; an encoder), a good GGUF file and the bad ones, each made from the good one."""
    import tformer
    from gguf_util import rewrite
    from tformer.model.config import ModelConfig, preset
    from tformer.model.models import Encoder, EncoderDecoder

    root = tmp_path_factory.mktemp("gguf")
    tformer.save(decoder("llama", tokenizer), root / "llama", tokenizer=tokenizer,
                 extra_files={"chat_template.jinja": b"{{ bos_token }}{% for m in messages %}{{ m.content }}"
                                                    b"{{ eos_token }}{% endfor %}"})
    char = Tokenizer.char(TEXT)
    tformer.save(decoder("gpt2", char, vocab_size=char.vocab_size), root / "char", tokenizer=char)
    tformer.save(Encoder(ModelConfig(kind="encoder", vocab_size=50, d_model=32, n_heads=2)), root / "encoder")
    tformer.save(EncoderDecoder(preset("t5-small", vocab_size=50, d_model=32, n_heads=2, head_size=16, n_layers=1,
                                       d_ff=64)), root / "t5")
    to_gguf(decoder("llama", tokenizer), root / "good.gguf", tokenizer=tokenizer)
    good = (root / "good.gguf").read_bytes()
    (root / "truncated.gguf").write_bytes(good[:len(good) // 2])
    (root / "notes.gguf").write_text("not a model\n")
    (root / "empty.gguf").write_bytes(b"")
    rewrite(root / "good.gguf", root / "falcon.gguf", arch="falcon")
    rewrite(root / "good.gguf", root / "shape.gguf",
            tensor=lambda n, d, q: (n, d[:-16] if n == "blk.0.attn_k.weight" else d, q))
    rewrite(root / "good.gguf", root / "q4.gguf",
            tensor=lambda n, d, q: (n, d, gguf.GGMLQuantizationType.Q4_0 if n == "blk.0.ffn_gate.weight" else q))
    rewrite(root / "good.gguf", root / "missing.gguf", tensor=lambda n, d, q: None if n == "blk.1.ffn_up.weight"
            else (n, d, q))
    rewrite(root / "good.gguf", root / "nometa.gguf", keys={"llama.block_count": (None, None)})
    V = gguf.GGUFValueType
    for name, keys in (("adapter", {"general.type": ("adapter", V.STRING)}),
                       ("partial", {"llama.rope.dimension_count": (8, V.UINT32)}),
                       ("yarn", {"llama.rope.scaling.type": ("yarn", V.STRING)}),
                       ("experts", {"llama.expert_count": (8, V.UINT32)}),
                       ("heads", {"llama.attention.head_count": ("4", V.STRING)})):
        rewrite(root / "good.gguf", root / f"{name}.gguf", keys=keys)
    rewrite(root / "good.gguf", root / "freqs.gguf", add={"rope_freqs.weight": np.ones(8, dtype=np.float32)})
    (root / "taken.gguf").write_bytes(b"mine")
    (root / "taken").mkdir()
    (root / "taken" / "keep.txt").write_text("mine")
    return root


BAD = [
    ("truncated", ["import-gguf", "truncated.gguf", "out"], "truncated.gguf is a damaged GGUF file"),
    ("not-gguf", ["import-gguf", "notes.gguf", "out"], "not a GGUF file"),
    ("empty", ["import-gguf", "empty.gguf", "out"], "not a GGUF file"),
    ("a-directory", ["import-gguf", "taken", "out"], "is a directory"),
    ("unsupported-architecture", ["import-gguf", "falcon.gguf", "out"], "general.architecture='falcon'"),
    ("wrong-shape", ["import-gguf", "shape.gguf", "out"], "tensor blk.0.attn_k.weight has shape (16, 64)"),
    ("other-quantisation", ["import-gguf", "q4.gguf", "out"], "blk.0.ffn_gate.weight is Q4_0"),
    ("missing-tensor", ["import-gguf", "missing.gguf", "out"], "missing tensor(s) blk.1.ffn_up.weight"),
    ("missing-metadata", ["import-gguf", "nometa.gguf", "out"], "metadata llama.block_count is missing"),
    ("adapter", ["import-gguf", "adapter.gguf", "out"], "general.type='adapter'"),
    ("partial-rotary", ["import-gguf", "partial.gguf", "out"], "partial rotary"),
    ("rope-scaling", ["import-gguf", "yarn.gguf", "out"], "rope.scaling.type='yarn'"),
    ("rope-frequency-factors", ["import-gguf", "freqs.gguf", "out"], "rope_freqs.weight"),
    ("mixture-of-experts", ["import-gguf", "experts.gguf", "out"], "mixture-of-experts"),
    ("metadata-of-the-wrong-type", ["import-gguf", "heads.gguf", "out"], "llama.attention.head_count='4'"),
    ("import-over-a-directory", ["import-gguf", "good.gguf", "taken"], "--force"),
    ("encoder", ["export-gguf", "encoder", "out.gguf"], "cannot export a Encoder (kind 'encoder') to GGUF"),
    ("t5", ["export-gguf", "t5", "out.gguf"], "(kind 'encoder-decoder') to GGUF"),
    ("char-tokenizer", ["export-gguf", "char", "out.gguf"], "character tokenizer"),
    ("export-over-a-file", ["export-gguf", "llama", "taken.gguf"], "--force"),
    ("export-to-a-directory", ["export-gguf", "llama", "taken"], "is a directory"),
    ("bad-type", ["export-gguf", "llama", "out.gguf", "--type", "q4_0"], "--type"),
]


@pytest.mark.parametrize("argv,key", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_gets_one_line_and_writes_nothing(argv, key, ws, capsys, monkeypatch):
    monkeypatch.chdir(ws)
    before = tree(ws)
    rc, _, err = run_main(argv, capsys)
    lines = err.strip("\n").split("\n")
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert key in lines[0], lines[0]
    assert tree(ws) == before


def test_export_then_import_keeps_the_model_tokenizer_and_chat_template(ws, tokenizer, tmp_path, capsys):
    import tformer
    from tformer.checkpoints.format import load_tokenizer
    from tformer.data.chat_template import find_chat_template

    rc, out, _ = run_main(["export-gguf", ws / "llama", tmp_path / "m.gguf", "--type", "q8_0"], capsys)
    assert rc == 0 and "GGUF llama (q8_0) + tokenizer + chat template" in out
    rc, out, _ = run_main(["import-gguf", tmp_path / "m.gguf", tmp_path / "back"], capsys)
    assert rc == 0 and "imported GGUF llama as Decoder" in out
    original, back = tformer.load(ws / "llama"), tformer.load(tmp_path / "back")
    a, b = logits(original, IDS), logits(back, IDS)
    assert (a - b).abs().max() <= TOLERANCE["q8_0"] * a.abs().max()
    assert load_tokenizer(tmp_path / "back").encode(TEXT) == tokenizer.encode(TEXT)
    chat = find_chat_template(tmp_path / "back")
    assert chat.render([{"role": "user", "content": "hi"}]) == "<bos>hi<eos>"
    rc, _, err = run_main(["import-gguf", tmp_path / "m.gguf", tmp_path / "back"], capsys)
    assert rc == 2 and "--force" in err
    assert run_main(["import-gguf", tmp_path / "m.gguf", tmp_path / "back", "--force"], capsys)[0] == 0


def test_a_char_tokenizer_checkpoint_exports_without_its_tokenizer(ws, tmp_path, capsys):
    rc, out, _ = run_main(["export-gguf", ws / "char", tmp_path / "m.gguf", "--no-tokenizer"], capsys)
    assert rc == 0 and "+ tokenizer" not in out
    assert field(reader(tmp_path / "m.gguf"), gguf.Keys.Tokenizer.MODEL) == "none"
    model, tok, template = from_gguf(tmp_path / "m.gguf")
    assert tok is None and template is None and model.cfg.activation == "gelu_tanh"
