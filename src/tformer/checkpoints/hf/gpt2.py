"""GPT-2 (`GPT2LMHeadModel`) <-> tformer `Decoder`: pre-LN, learned positions, GELU-tanh, tied head.

GPT-2 stores its projections as Conv1D, i.e. (in, out) matrices: they are transposed. Its fused
c_attn already holds [q | k | v], which is exactly tformer's qkv_proj after the transpose.
reorder_and_upcast_attn is accepted: it only changes mixed-precision numerics, not the function.
Dropout: tformer has one rate; resid_pdrop is taken (it only matters for fine-tuning).
"""

from __future__ import annotations

from ...model.config import ModelConfig
from ...model.models import Decoder
from .keymap import (
    ACT_TO_HF,
    STANDARD_ATTENTION,
    Rule,
    hf_activation,
    layer_rules,
    mismatches,
    refuse_unless,
    settings,
    token_id,
)

MODEL_TYPE = "gpt2"
ARCHITECTURE = "GPT2LMHeadModel"
PREFIX = "transformer."                # GPT2LMHeadModel's base model; GPT2Model files have no prefix
EXPORT_PREFIX = PREFIX
HEAD_KEYS = ("lm_head.weight",)
# Old checkpoints store the causal mask as buffers; tformer builds it at run time.
IGNORED = {r"h\.\d+\.attn\.(masked_)?bias": "causal-mask buffers, rebuilt at run time"}
# Values GPT2Config uses when config.json omits a key (transformers 5.x, configuration_gpt2.py).
DEFAULTS = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                activation_function="gelu_new", resid_pdrop=0.1, attn_pdrop=0.1, layer_norm_epsilon=1e-5,
                scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, add_cross_attention=False,
                tie_word_embeddings=True, bos_token_id=50256, eos_token_id=50256, pad_token_id=None)

LAYER = [
    ("attn_residual.norm.weight", "ln_1.weight"), ("attn_residual.norm.bias", "ln_1.bias"),
    ("attn.qkv_proj.weight", "attn.c_attn.weight"), ("attn.qkv_proj.bias", "attn.c_attn.bias"),
    ("attn.out_proj.weight", "attn.c_proj.weight"), ("attn.out_proj.bias", "attn.c_proj.bias"),
    ("ffn_residual.norm.weight", "ln_2.weight"), ("ffn_residual.norm.bias", "ln_2.bias"),
    ("ffn.up.weight", "mlp.c_fc.weight"), ("ffn.up.bias", "mlp.c_fc.bias"),
    ("ffn.down.weight", "mlp.c_proj.weight"), ("ffn.down.bias", "mlp.c_proj.bias"),
]
CONV1D = ("attn.qkv_proj.weight", "attn.out_proj.weight", "ffn.up.weight", "ffn.down.weight")


def config_from_hf(hf: dict) -> ModelConfig:
    s = settings(hf, DEFAULTS)
    refuse_unless(s["scale_attn_weights"], "gpt2", "scale_attn_weights=false (unscaled attention scores)")
    refuse_unless(not s["scale_attn_by_inverse_layer_idx"], "gpt2", "scale_attn_by_inverse_layer_idx=true")
    refuse_unless(not s["add_cross_attention"], "gpt2", "add_cross_attention=true")
    return ModelConfig(
        kind="decoder", vocab_size=s["vocab_size"], d_model=s["n_embd"], n_heads=s["n_head"], n_layers=s["n_layer"],
        d_ff=s["n_inner"], max_seq_len=s["n_positions"], dropout=float(s["resid_pdrop"]),
        attn_dropout=float(s["attn_pdrop"]), norm_position="pre",
        positional="learned", activation=hf_activation(s["activation_function"], "activation_function", "gpt2"),
        norm="layernorm", norm_eps=s["layer_norm_epsilon"], bias=True, tie_embeddings=s["tie_word_embeddings"],
        pad_token_id=s["pad_token_id"], bos_token_id=token_id(s["bos_token_id"], "bos_token_id", "gpt2"),
        eos_token_id=token_id(s["eos_token_id"], "eos_token_id", "gpt2"))


def fits(cfg: ModelConfig) -> list[str]:
    return mismatches(cfg, dict(kind="decoder", norm_position="pre", positional="learned", norm="layernorm",
                                bias=True, embed_scale=False, embedding_norm=False, type_vocab_size=0,
                                position_offset=0, lm_head_bias=False, activation=list(ACT_TO_HF),
                                n_kv_heads=[None, cfg.n_heads], **STANDARD_ATTENTION))


def config_to_hf(cfg: ModelConfig) -> dict:
    return dict(model_type=MODEL_TYPE, architectures=[ARCHITECTURE], vocab_size=cfg.vocab_size,
                n_positions=cfg.max_seq_len, n_embd=cfg.d_model, n_layer=cfg.n_layers, n_head=cfg.n_heads,
                n_inner=cfg.ffn_dim, activation_function=ACT_TO_HF[cfg.activation], resid_pdrop=cfg.dropout,
                embd_pdrop=cfg.dropout, attn_pdrop=cfg.attention_dropout, layer_norm_epsilon=cfg.norm_eps,
                scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
                add_cross_attention=False, tie_word_embeddings=cfg.tie_embeddings, pad_token_id=cfg.pad_token_id,
                bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)


def build(cfg: ModelConfig) -> Decoder:
    return Decoder(cfg)


def rules(cfg: ModelConfig) -> list[Rule]:
    out = [Rule("stack.embed.token.weight", ("wte.weight",)), Rule("stack.embed.position.weight", ("wpe.weight",)),
           Rule("stack.norm.weight", ("ln_f.weight",)), Rule("stack.norm.bias", ("ln_f.bias",))]
    out += layer_rules(LAYER, "stack.layers.", "h.", cfg.n_layers, transpose=CONV1D)
    if not cfg.tie_embeddings:
        out.append(Rule("lm_head.weight", ("lm_head.weight",)))
    return out


# HF may store the tied head as a copy of the token embedding: the copies must agree.
def copies(cfg: ModelConfig) -> list[tuple[str, ...]]:
    return [("wte.weight", "lm_head.weight")] if cfg.tie_embeddings else []
