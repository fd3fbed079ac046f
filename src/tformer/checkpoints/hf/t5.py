"""T5 (`T5ForConditionalGeneration`) <-> tformer `EncoderDecoder`, and `T5EncoderModel` <-> `Encoder`.

T5 is tformer's core with these choices: pre-norm with RMS norm (no bias) and a final norm per
stack; linear layers without bias; no position vectors but a relative position bias on the
self-attention scores (positional="relative": learned per head and log-spaced distance bucket,
held by each stack's first layer in transformers, by the stack here); scores not scaled by 1/√d_k
(attention_scale=False); a head size of its own (d_kv -> head_size); ReLU (v1.0) or gated-GELU
(v1.1, Flan-T5 -> "geglu") feed-forward; pad as the decoder start token. v1.0 ties the output layer
to the embedding and scales the last hidden state by d_model^-0.5 first (output_scale); v1.1 does not
scale, and its older files keep an untied lm_head.

transformers 5 always ties T5's output layer to the embedding and reads the scaling from
`scale_decoder_outputs` (older files: from tie_word_embeddings); both are read here. An untied model
is written as the older files are (tie_word_embeddings=false + lm_head.weight).
"""

from __future__ import annotations

from torch import nn

from ...model.config import ModelConfig
from ...model.models import Encoder, EncoderDecoder
from .keymap import ACT_TO_HF, Rule, hf_activation, layer_rules, mismatches, refuse_unless, settings, token_id

MODEL_TYPE = "t5"
ENCODER_ONLY = "T5EncoderModel"
PREFIX = EXPORT_PREFIX = ""              # T5's tensors have no base-model prefix
HEAD_KEYS = ("lm_head.weight",)
IGNORED = {r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight":
           "cross-attention has no relative position bias (older files carry an unused table)"}
DEFAULTS = dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=None,
                num_heads=8, relative_attention_num_buckets=32, relative_attention_max_distance=128,
                dropout_rate=0.1, layer_norm_epsilon=1e-6, feed_forward_proj="relu", tie_word_embeddings=True,
                scale_decoder_outputs=None, n_positions=512, pad_token_id=0, eos_token_id=1,
                decoder_start_token_id=0, architectures=None)
# feed_forward_proj: "{act}" or "gated-{act}"; transformers reads "gated-gelu" as tanh GELU.
GATED_FROM_HF = {"gated-gelu": "geglu", "gated-gelu_new": "geglu", "gated-silu": "swiglu"}
FFN_TO_HF = {**ACT_TO_HF, "geglu": "gated-gelu", "swiglu": "gated-silu"}


def config_from_hf(hf: dict) -> ModelConfig:
    s = settings(hf, DEFAULTS)
    encoder_only = ENCODER_ONLY in (s["architectures"] or [])
    proj = s["feed_forward_proj"]
    refuse_unless(proj in GATED_FROM_HF or not str(proj).startswith("gated-"), "t5", f"feed_forward_proj={proj!r}")
    activation = GATED_FROM_HF.get(proj) or hf_activation(proj, "feed_forward_proj", "t5")
    tied = s["tie_word_embeddings"]
    scaled = s["scale_decoder_outputs"] if s["scale_decoder_outputs"] is not None else tied is not False
    decoder_layers = s["num_decoder_layers"]
    return ModelConfig(
        kind="encoder" if encoder_only else "encoder-decoder", vocab_size=s["vocab_size"], d_model=s["d_model"],
        n_heads=s["num_heads"], head_size=s["d_kv"], n_layers=s["num_layers"], d_ff=s["d_ff"],
        n_decoder_layers=None if encoder_only or decoder_layers in (None, s["num_layers"]) else decoder_layers,
        max_seq_len=s["n_positions"], dropout=float(s["dropout_rate"]), ffn_dropout=float(s["dropout_rate"]),
        norm_position="pre", positional="relative", relative_buckets=s["relative_attention_num_buckets"],
        relative_max_distance=s["relative_attention_max_distance"], attention_scale=False, activation=activation,
        norm="rmsnorm", norm_eps=float(s["layer_norm_epsilon"]), bias=False, tie_embeddings=bool(tied),
        output_scale=bool(scaled) and not encoder_only, pad_token_id=s["pad_token_id"],
        eos_token_id=token_id(s["eos_token_id"], "eos_token_id", "t5"),
        decoder_start_token_id=None if encoder_only else s["decoder_start_token_id"])


def fits(cfg: ModelConfig) -> list[str]:
    return mismatches(cfg, dict(
        kind=["encoder", "encoder-decoder"], norm_position="pre", positional="relative", norm="rmsnorm", bias=False,
        attention_scale=False, embed_scale=False, embedding_norm=False, type_vocab_size=0, lm_head_bias=False,
        activation=list(FFN_TO_HF), n_kv_heads=[None, cfg.n_heads], src_vocab_size=None,
        n_decoder_heads=[None, cfg.n_heads], d_decoder_ff=[None, cfg.ffn_dim],          # one shape for both stacks
        attn_dropout=[None, cfg.dropout], ffn_dropout=cfg.dropout))                     # one dropout_rate


def config_to_hf(cfg: ModelConfig) -> dict:
    encoder_only = cfg.kind == "encoder"
    start = next((t for t in (cfg.decoder_start_token_id, cfg.pad_token_id) if t is not None), None)
    return dict(model_type=MODEL_TYPE, architectures=[ENCODER_ONLY if encoder_only else "T5ForConditionalGeneration"],
                is_encoder_decoder=not encoder_only, vocab_size=cfg.vocab_size, d_model=cfg.d_model,
                d_kv=cfg.head_dim, d_ff=cfg.ffn_dim, num_layers=cfg.n_layers, num_decoder_layers=cfg.decoder_layers,
                num_heads=cfg.n_heads, relative_attention_num_buckets=cfg.relative_buckets,
                relative_attention_max_distance=cfg.relative_max_distance, dropout_rate=cfg.dropout,
                layer_norm_epsilon=cfg.norm_eps, feed_forward_proj=FFN_TO_HF[cfg.activation],
                tie_word_embeddings=cfg.tie_embeddings, scale_decoder_outputs=cfg.output_scale,
                n_positions=cfg.max_seq_len, pad_token_id=cfg.pad_token_id, eos_token_id=cfg.eos_token_id,
                decoder_start_token_id=start)


def build(cfg: ModelConfig) -> nn.Module:
    return Encoder(cfg) if cfg.kind == "encoder" else EncoderDecoder(cfg)


def _attention(ours: str, hf: str, cross: bool) -> list[tuple[str, tuple[str, ...] | str]]:
    if cross:
        qkv = [(f"{ours}.q_proj.weight", f"{hf}.q.weight"),
               (f"{ours}.kv_proj.weight", (f"{hf}.k.weight", f"{hf}.v.weight"))]                        # [k; v]
    else:
        qkv = [(f"{ours}.qkv_proj.weight", tuple(f"{hf}.{x}.weight" for x in "qkv"))]             # [q; k; v]
    return qkv + [(f"{ours}.out_proj.weight", f"{hf}.o.weight")]


def _ffn(cfg: ModelConfig, sub: str) -> list[tuple[str, tuple[str, ...] | str]]:
    up = ((f"{sub}.DenseReluDense.wi_0.weight", f"{sub}.DenseReluDense.wi_1.weight")           # [gate; up]
          if cfg.activation in ("geglu", "swiglu") else f"{sub}.DenseReluDense.wi.weight")
    return [("ffn.up.weight", up), ("ffn.down.weight", f"{sub}.DenseReluDense.wo.weight"),
            ("ffn_residual.norm.weight", f"{sub}.layer_norm.weight")]


def _stack(cfg: ModelConfig, ours: str, side: str) -> list[Rule]:
    """One T5Stack: layer.0 self-attention, (decoder: layer.1 cross-attention), then the FFN."""
    self_attn = _attention("attn", "layer.0.SelfAttention", False) + [("attn_residual.norm.weight",
                                                                       "layer.0.layer_norm.weight")]
    if side == "encoder":
        template, n = self_attn + _ffn(cfg, "layer.1"), cfg.n_layers
    else:
        template = (self_attn + _attention("cross_attn", "layer.1.EncDecAttention", True)
                    + [("cross_residual.norm.weight", "layer.1.layer_norm.weight")] + _ffn(cfg, "layer.2"))
        n = cfg.decoder_layers
    first = f"{side}.block.0.layer.0.SelfAttention"               # the layer that holds the stack's bias table
    return [Rule(f"{ours}relative_bias.weight", (f"{first}.relative_attention_bias.weight",)),
            Rule(f"{ours}norm.weight", (f"{side}.final_layer_norm.weight",)),
            *layer_rules(template, f"{ours}layers.", f"{side}.block.", n)]


def rules(cfg: ModelConfig) -> list[Rule]:
    if cfg.kind == "encoder":
        return [Rule("embed.token.weight", ("shared.weight",)), *_stack(cfg, "", "encoder")]
    out = [Rule("shared.weight", ("shared.weight",)), *_stack(cfg, "encoder.", "encoder"),
           *_stack(cfg, "decoder.", "decoder")]
    return out if cfg.tie_embeddings else out + [Rule("lm_head.weight", ("lm_head.weight",))]


def copies(cfg: ModelConfig) -> list[tuple[str, ...]]:
    """One embedding serves both stacks (and the head when tied); HF files may hold copies."""
    if cfg.kind == "encoder":
        return [("shared.weight", "encoder.embed_tokens.weight")]
    group = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    return [group + (("lm_head.weight",) if cfg.tie_embeddings else ())]


def export_extra(state: dict, cfg: ModelConfig) -> None:
    """The shared embedding under every name HF's stacks read."""
    for side in ("encoder",) if cfg.kind == "encoder" else ("encoder", "decoder"):
        state[f"{side}.embed_tokens.weight"] = state["shared.weight"].clone()
