"""GGUF names and layouts: the llama.cpp architecture a decoder becomes, its hyperparameters, and each
tensor's GGUF name — a declarative map from the Hugging Face names (tformer.checkpoints.hf) to
llama.cpp's, as llama.cpp's convert_hf_to_gguf.py maps them, with its two layout changes:

  gpt2   HF's Conv1D matrices are (in, out); GGUF stores every matrix as nn.Linear does, (out, in),
         so they are transposed back. The fused c_attn rows [q; k; v] are GGUF's attn_qkv as they are.
         The causal-mask buffers of old GPT-2 files are never part of the export.
  llama  HF rotates q and k in halves ("rotate half": dimension i pairs with i + d/2); llama.cpp's rope
         (its NORM mode) rotates adjacent pairs (2i, 2i + 1). The rows of each head of attn_q / attn_k
         are reordered to match (`permute`): per head, rows [r_0 .. r_{d/2-1} | s_0 .. s_{d/2-1}]
         become r_0 s_0 r_1 s_1 ...; attn_k with the KV-head count under grouped-query attention.

Shapes here are PyTorch's (rows, row length), as gguf's writer and reader take and give them; ggml
lists them the other way round (ne0 = row length), which is how llama.cpp's sources read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import Tensor

from ...errors import CheckpointError, ConfigError
from ...model.config import ModelConfig


@dataclass(frozen=True)
class Arch:
    name: str                    # general.architecture; also the tformer.checkpoints.hf family's MODEL_TYPE
    block: str                   # HF prefix of the blocks, followed by the block number
    top: dict[str, str]          # HF name -> GGUF name, outside the blocks
    layer: dict[str, str]        # HF name inside block N -> GGUF name inside "blk.N."
    transposed: tuple[str, ...] = ()                     # stored (in, out) by HF: GPT-2's Conv1D
    permuted: dict[str, str] = field(default_factory=dict)  # q / k rows reordered, by the head count named


GPT2 = Arch(
    "gpt2", "h.",
    top={"wte.weight": "token_embd.weight", "wpe.weight": "position_embd.weight",
         "ln_f.weight": "output_norm.weight", "ln_f.bias": "output_norm.bias", "lm_head.weight": "output.weight"},
    layer={"ln_1.weight": "attn_norm.weight", "ln_1.bias": "attn_norm.bias",
           "attn.c_attn.weight": "attn_qkv.weight", "attn.c_attn.bias": "attn_qkv.bias",
           "attn.c_proj.weight": "attn_output.weight", "attn.c_proj.bias": "attn_output.bias",
           "ln_2.weight": "ffn_norm.weight", "ln_2.bias": "ffn_norm.bias",
           "mlp.c_fc.weight": "ffn_up.weight", "mlp.c_fc.bias": "ffn_up.bias",
           "mlp.c_proj.weight": "ffn_down.weight", "mlp.c_proj.bias": "ffn_down.bias"},
    transposed=("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"))

LLAMA = Arch(
    "llama", "layers.",
    top={"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
         "lm_head.weight": "output.weight"},
    layer={"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
           "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
           "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
           "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
           "mlp.down_proj.weight": "ffn_down.weight"},
    permuted={"self_attn.q_proj.weight": "n_heads", "self_attn.k_proj.weight": "kv_heads"})

ARCHS = {a.name: a for a in (GPT2, LLAMA)}
# llama.cpp's gpt2 computes the tanh approximation of GELU; a model trained with exact GELU is written
# with this key as well, so that tformer reads it back exactly (llama.cpp ignores keys it does not know).
ACTIVATION_KEY = "tformer.activation"


def _split(arch: Arch, hf_name: str) -> tuple[int | None, str]:
    m = re.fullmatch(re.escape(arch.block) + r"(\d+)\.(.+)", hf_name)
    return (int(m[1]), m[2]) if m else (None, hf_name)


def gguf_name(arch: Arch, hf_name: str) -> str:
    block, rest = _split(arch, hf_name)
    return arch.top[rest] if block is None else f"blk.{block}.{arch.layer[rest]}"


def gguf_shape(arch: Arch, hf_name: str, shape) -> tuple[int, ...]:
    return tuple(reversed(shape)) if _split(arch, hf_name)[1] in arch.transposed else tuple(shape)


def permute(w: Tensor, n_heads: int) -> Tensor:
    """HF's rotate-half rows -> llama.cpp's interleaved rows, head by head (convert_hf_to_gguf's permute)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute(w: Tensor, n_heads: int) -> Tensor:
    """The inverse of `permute` (transformers' GGUF loader calls it _reverse_permute_weights)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def to_gguf_layout(arch: Arch, hf_name: str, t: Tensor, cfg: ModelConfig) -> Tensor:
    _, rest = _split(arch, hf_name)
    if rest in arch.transposed:
        t = t.t()
    if rest in arch.permuted:
        t = permute(t, getattr(cfg, arch.permuted[rest]))
    return t.contiguous()


def from_gguf_layout(arch: Arch, hf_name: str, t: Tensor, cfg: ModelConfig) -> Tensor:
    _, rest = _split(arch, hf_name)
    if rest in arch.permuted:
        t = unpermute(t, getattr(cfg, arch.permuted[rest]))
    if rest in arch.transposed:
        t = t.t()
    return t.contiguous()


def gguf_arch(family, cfg: ModelConfig) -> Arch:
    """The GGUF architecture of a model whose HF family is `family`; ConfigError where llama.cpp's
    graph for it would compute something else (its gpt2 FFN is always GELU)."""
    arch = ARCHS[family.MODEL_TYPE]
    if arch is GPT2 and cfg.activation not in ("gelu", "gelu_tanh"):
        raise ConfigError(f"cannot export to GGUF: llama.cpp's gpt2 computes GELU in its feed-forward layers, "
                          f"this model uses activation={cfg.activation!r}")
    return arch


def write_hparams(writer, arch: Arch, cfg: ModelConfig) -> None:
    """The hyperparameters llama.cpp reads for `arch` (llama-model.cpp), as convert_hf_to_gguf writes them."""
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.d_model)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(cfg.ffn_dim)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.kv_heads)
    writer.add_vocab_size(cfg.vocab_size)
    if arch is LLAMA:
        writer.add_layer_norm_rms_eps(cfg.norm_eps)
        writer.add_rope_dimension_count(cfg.head_dim)
        writer.add_rope_freq_base(cfg.rope_theta)
    else:
        writer.add_layer_norm_eps(cfg.norm_eps)
        if cfg.activation == "gelu":
            writer.add_string(ACTIVATION_KEY, "gelu")


def hf_config(arch: Arch, get, vocab_size: int, tied: bool) -> dict:
    """The config.json of the HF family that the GGUF hyperparameters describe; `get(key[, default])`
    reads a metadata key (no default: required). The HF family's config_from_hf then refuses what
    tformer cannot represent exactly. Dropout is 0: a GGUF file is for inference."""
    def h(key: str, *default):
        return get(f"{arch.name}.{key}", *default)

    def n(key: str, *default) -> int:                # a positive integer
        value = h(key, *default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointError(f"metadata {arch.name}.{key}={value!r} is not a positive integer")
        return value

    heads = n("attention.head_count")
    kv_heads = n("attention.head_count_kv", heads)
    if h("expert_count", 0):
        raise ConfigError(f"{arch.name}.expert_count={h('expert_count')}: mixture-of-experts models are "
                          "not supported")
    common = dict(vocab_size=vocab_size, tie_word_embeddings=tied)
    if arch is GPT2:
        if kv_heads != heads:
            raise ConfigError(f"gpt2.attention.head_count_kv={kv_heads} != head_count={heads}: "
                              "grouped-query attention is not part of GPT-2")
        return dict(common, model_type="gpt2", n_embd=n("embedding_length"), n_inner=n("feed_forward_length"),
                    n_layer=n("block_count"), n_head=heads, n_positions=n("context_length"),
                    layer_norm_epsilon=h("attention.layer_norm_epsilon"), resid_pdrop=0.0, attn_pdrop=0.0,
                    activation_function="gelu" if get(ACTIVATION_KEY, None) == "gelu" else "gelu_new")
    width = n("embedding_length")
    head_dim = n("attention.key_length", width // heads)
    rotated = n("rope.dimension_count", head_dim)
    if rotated != head_dim:
        raise ConfigError(f"llama.rope.dimension_count={rotated} rotates part of each head of {head_dim}: "
                          "partial rotary embeddings are not supported")
    scaling = h("rope.scaling.type", "none")
    if scaling != "none":
        raise ConfigError(f"llama.rope.scaling.type={scaling!r}: rope scaling is not supported")
    return dict(common, model_type="llama", hidden_size=width, intermediate_size=n("feed_forward_length"),
                num_hidden_layers=n("block_count"), num_attention_heads=heads, num_key_value_heads=kv_heads,
                head_dim=head_dim, max_position_embeddings=n("context_length"),
                rms_norm_eps=h("attention.layer_norm_rms_epsilon"), rope_theta=h("rope.freq_base", 10000.0),
                hidden_act="silu", attention_dropout=0.0)
