"""Llama (`LlamaForCausalLM`) <-> tformer `Decoder`: pre-RMSNorm, rotary positions in the
"rotate half" convention, SwiGLU (gate and up fused into ffn.up as [gate; up]), grouped-query
attention (num_key_value_heads), no biases, an untied output layer by default."""

from __future__ import annotations

from ...model.config import ModelConfig
from ...model.models import Decoder
from .keymap import STANDARD_ATTENTION, Rule, layer_rules, mismatches, refuse_unless, settings, token_id

MODEL_TYPE = "llama"
ARCHITECTURE = "LlamaForCausalLM"
PREFIX = EXPORT_PREFIX = "model."
HEAD_KEYS = ("lm_head.weight",)
IGNORED = {r"layers\.\d+\.self_attn\.rotary_emb\.inv_freq": "RoPE frequencies, recomputed from rope_theta"}
DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
                rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, mlp_bias=False, head_dim=None,
                pad_token_id=None, bos_token_id=1, eos_token_id=2, rope_theta=10000.0, rope_scaling=None,
                rope_parameters=None, pretraining_tp=1, attention_dropout=0.0)

LAYER = [
    ("attn_residual.norm.weight", "input_layernorm.weight"),
    ("attn.qkv_proj.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    ("attn.out_proj.weight", "self_attn.o_proj.weight"),
    ("ffn_residual.norm.weight", "post_attention_layernorm.weight"),
    ("ffn.up.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("ffn.down.weight", "mlp.down_proj.weight"),
]


def _rope_theta(s: dict) -> float:
    """transformers 5 writes rope_parameters={rope_type, rope_theta}; older files rope_theta and rope_scaling."""
    params = s["rope_parameters"] or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    refuse_unless(rope_type == "default", "llama", f"rope_parameters with rope_type={rope_type!r}")
    extra = sorted(set(params) - {"rope_type", "type", "rope_theta"})
    refuse_unless(not extra, "llama", f"rope_parameters {', '.join(extra)}")
    refuse_unless(not s["rope_scaling"], "llama", f"rope_scaling={s['rope_scaling']!r}")
    return float(params.get("rope_theta", s["rope_theta"]))


def config_from_hf(hf: dict) -> ModelConfig:
    s = settings(hf, DEFAULTS)
    refuse_unless(s["hidden_act"] == "silu", "llama", f"hidden_act={s['hidden_act']!r} (SwiGLU needs silu)")
    refuse_unless(not s["attention_bias"], "llama", "attention_bias=true")
    refuse_unless(not s["mlp_bias"], "llama", "mlp_bias=true")
    refuse_unless(s["pretraining_tp"] in (None, 1), "llama", f"pretraining_tp={s['pretraining_tp']}")
    heads = s["num_attention_heads"]
    refuse_unless(s["head_dim"] in (None, s["hidden_size"] // heads), "llama",
                  f"head_dim={s['head_dim']} != hidden_size / num_attention_heads")
    return ModelConfig(
        kind="decoder", vocab_size=s["vocab_size"], d_model=s["hidden_size"], n_heads=heads,
        n_kv_heads=s["num_key_value_heads"], n_layers=s["num_hidden_layers"], d_ff=s["intermediate_size"],
        max_seq_len=s["max_position_embeddings"], dropout=0.0,
        attn_dropout=float(s["attention_dropout"]), norm_position="pre", positional="rope",
        activation="swiglu", norm="rmsnorm", norm_eps=s["rms_norm_eps"], bias=False,
        tie_embeddings=s["tie_word_embeddings"], rope_theta=_rope_theta(s), pad_token_id=s["pad_token_id"],
        bos_token_id=token_id(s["bos_token_id"], "bos_token_id", "llama"),
        eos_token_id=token_id(s["eos_token_id"], "eos_token_id", "llama"))


def fits(cfg: ModelConfig) -> list[str]:
    return mismatches(cfg, dict(kind="decoder", norm_position="pre", positional="rope", norm="rmsnorm",
                                activation="swiglu", bias=False, embed_scale=False, embedding_norm=False,
                                type_vocab_size=0, lm_head_bias=False, **STANDARD_ATTENTION))


def config_to_hf(cfg: ModelConfig) -> dict:
    return dict(model_type=MODEL_TYPE, architectures=[ARCHITECTURE], vocab_size=cfg.vocab_size,
                hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
                num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                hidden_act="silu", max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
                tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False,
                attention_dropout=cfg.attention_dropout,
                rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                pad_token_id=cfg.pad_token_id, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)


def build(cfg: ModelConfig) -> Decoder:
    return Decoder(cfg)


def rules(cfg: ModelConfig) -> list[Rule]:
    out = [Rule("stack.embed.token.weight", ("embed_tokens.weight",)), Rule("stack.norm.weight", ("norm.weight",))]
    out += layer_rules(LAYER, "stack.layers.", "layers.", cfg.n_layers)
    if not cfg.tie_embeddings:
        out.append(Rule("lm_head.weight", ("lm_head.weight",)))
    return out


def copies(cfg: ModelConfig) -> list[tuple[str, ...]]:
    return [("embed_tokens.weight", "lm_head.weight")] if cfg.tie_embeddings else []
