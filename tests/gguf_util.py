"""Shared by tests/test_gguf*.py: a byte-level BPE tokenizer, tiny GPT-2- and Llama-shaped decoders
whose weights make the logits clearly ordered, and `rewrite`, which copies a GGUF file with changes
(the damaged and unsupported files the import must refuse)."""

from __future__ import annotations

import pytest
import torch

from tformer.data.tokenizers import Tokenizer
from tformer.model.config import ModelConfig
from tformer.model.models import Decoder

gguf = pytest.importorskip("gguf")

TEXT = """To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles
And by opposing end them. To die—to sleep, no more; 1601, 1602, 1603.
Être ou ne pas être, c'est là la question. Ser o no ser, ésa es la cuestión. 生存还是毁灭。
"""
VOCAB = 304            # the tokenizer has 300: rows 300..303 are llama.cpp's "[PAD<i>]" rows
SHAPES = {
    # GPT-2: learned positions, LayerNorm, tanh GELU, biases, tied output layer
    "gpt2": dict(positional="learned", norm="layernorm", activation="gelu_tanh", bias=True, tie_embeddings=True,
                 d_ff=256),
    # Llama: rotary positions, RMSNorm, SwiGLU, grouped-query attention (2 K/V heads for 4 query heads);
    # d_ff=88 makes ffn_down's rows 88 long, not a multiple of q8_0's 32-weight blocks (f16 fallback)
    "llama": dict(positional="rope", norm="rmsnorm", activation="swiglu", bias=False, n_kv_heads=2, d_ff=88,
                  tie_embeddings=False, rope_theta=500000.0, norm_eps=1e-6),
    "llama-tied": dict(positional="rope", norm="rmsnorm", activation="swiglu", bias=False, n_kv_heads=2, d_ff=96,
                       tie_embeddings=True, norm_eps=1e-5),
}


def bpe_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer.train_bpe(TEXT * 8, 300)
    assert tokenizer.kind == "bpe"
    return tokenizer


def llama3_style_tokenizer() -> Tokenizer:
    """Byte-level BPE split as Llama 3's tokenizer.json splits (a regex Split, then ByteLevel without its
    own regex; ignore_merges): llama.cpp's "llama-bpe"."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    from tformer.checkpoints.gguf.vocab import LLAMA3_REGEX
    from tformer.data.tokenizers import SPECIALS

    hf = HFTokenizer(models.BPE(ignore_merges=True))
    hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator([TEXT * 8], trainers.BpeTrainer(vocab_size=300, special_tokens=list(SPECIALS),
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                           show_progress=False))
    return Tokenizer(hf, "bpe")


def decoder(shape: str, tokenizer: Tokenizer, seed: int = 0, **overrides) -> Decoder:
    settings = dict(vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=2, max_seq_len=128, dropout=0.0,
                    attn_dropout=0.0, pad_token_id=tokenizer.pad_id, bos_token_id=tokenizer.bos_id,
                    eos_token_id=tokenizer.eos_id, **SHAPES[shape])
    cfg = ModelConfig(kind="decoder", **{**settings, **overrides})
    model = Decoder(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():   # big enough for clearly ordered logits (an N(0, 0.02) init makes greedy ties likely)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen) if name.endswith("weight")
                        else 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_((0.1 if p.dim() == 1 else 0.2) * torch.randn(p.shape, generator=gen))
    return model.eval()


def logits(model: Decoder, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.step(ids, all_logits=True)


def rewrite(src, dst, arch: str | None = None, keys: dict | None = None, tensor=None, add: dict | None = None):
    """Copy the GGUF file `src` to `dst` with another architecture name, metadata `keys` replaced
    ({key: (value, GGUFValueType)}, value None: removed), each tensor passed through
    `tensor(name, fp32 array, GGML type)` -> (name, array, type), or None to leave it out, and the
    f32 tensors `add` ({name: array}) added."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch or reader.fields["general.architecture"].contents())
    keys = keys or {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in keys:
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    for key, (value, vtype) in keys.items():
        if value is not None:
            writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        item = (t.name, gguf.quants.dequantize(t.data, t.tensor_type).copy(), t.tensor_type)
        item = tensor(*item) if tensor is not None else item
        if item is not None:
            name, data, qtype = item
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    for name, data in (add or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
