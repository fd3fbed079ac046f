"""What Marian and BART share (their layers are the same code in transformers): post-LN encoder and
decoder layers with separate q/k/v projections (fused here into qkv_proj and, for the cross-attention,
kv_proj), one token embedding shared by encoder, decoder and head, and a final_logits_bias."""

from __future__ import annotations

import torch

from ...errors import ConfigError
from ...model.config import ModelConfig
from ...model.models import EncoderDecoder
from .keymap import ACT_TO_HF, STANDARD_ATTENTION, Rule, hf_activation, layer_rules, mismatches, settings, token_id

PREFIX = "model."
EXPORT_PREFIX = PREFIX
HEAD_KEYS = ("lm_head.weight", "final_logits_bias")
COMMON_DEFAULTS = dict(vocab_size=50265, max_position_embeddings=1024, encoder_layers=12, encoder_ffn_dim=4096,
                       encoder_attention_heads=16, decoder_layers=12, decoder_ffn_dim=4096,
                       decoder_attention_heads=16, activation_function="gelu", d_model=1024, dropout=0.1,
                       attention_dropout=0.0, activation_dropout=0.0,
                       scale_embedding=False, tie_word_embeddings=True, is_encoder_decoder=True)


def _attention(ours: str, hf: str, cross: bool) -> list[tuple[str, tuple[str, ...] | str]]:
    out = []
    for p in ("weight", "bias"):
        if cross:
            out += [(f"{ours}.q_proj.{p}", f"{hf}.q_proj.{p}"),
                    (f"{ours}.kv_proj.{p}", (f"{hf}.k_proj.{p}", f"{hf}.v_proj.{p}"))]           # [k; v]
        else:
            qkv = tuple(f"{hf}.{x}_proj.{p}" for x in "qkv")
            out.append((f"{ours}.qkv_proj.{p}", qkv))                                        # [q; k; v]
        out.append((f"{ours}.out_proj.{p}", f"{hf}.out_proj.{p}"))
    return out


def _norm(ours: str, hf: str) -> list[tuple[str, str]]:
    return [(f"{ours}.weight", f"{hf}.weight"), (f"{ours}.bias", f"{hf}.bias")]


FFN = [("ffn.up.weight", "fc1.weight"), ("ffn.up.bias", "fc1.bias"),
       ("ffn.down.weight", "fc2.weight"), ("ffn.down.bias", "fc2.bias")]
ENCODER_LAYER = (_attention("attn", "self_attn", False) + _norm("attn_residual.norm", "self_attn_layer_norm")
                 + FFN + _norm("ffn_residual.norm", "final_layer_norm"))
DECODER_LAYER = (ENCODER_LAYER + _attention("cross_attn", "encoder_attn", True)
                 + _norm("cross_residual.norm", "encoder_attn_layer_norm"))


def rules(cfg: ModelConfig, embedding_norm: bool, learned_positions: bool) -> list[Rule]:
    out = [Rule("shared.weight", ("shared.weight",))]
    if cfg.lm_head_bias:
        out.append(Rule("lm_head.bias", ("final_logits_bias",)))
    for side, n in (("encoder", cfg.n_layers), ("decoder", cfg.decoder_layers)):
        if learned_positions:
            out.append(Rule(f"{side}.embed.position.weight", (f"{side}.embed_positions.weight",)))
        if embedding_norm:
            out += [Rule(f"{side}.embed.norm.weight", (f"{side}.layernorm_embedding.weight",)),
                    Rule(f"{side}.embed.norm.bias", (f"{side}.layernorm_embedding.bias",))]
        out += layer_rules(ENCODER_LAYER if side == "encoder" else DECODER_LAYER, f"{side}.layers.",
                           f"{side}.layers.", n)
    if not cfg.tie_embeddings:
        out.append(Rule("lm_head.weight", ("lm_head.weight",)))
    return out


def copies(cfg: ModelConfig) -> list[tuple[str, ...]]:
    """One token embedding serves encoder, decoder (and the head when tied); HF files may hold copies."""
    group = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    return [group + (("lm_head.weight",) if cfg.tie_embeddings else ())]


def config_from_hf(hf: dict, defaults: dict, family: str, **fixed) -> ModelConfig:
    s = settings(hf, {**COMMON_DEFAULTS, **defaults})

    def decoder_own(key: str):           # the decoder's value, None when it equals the encoder's
        return None if s[f"decoder_{key}"] == s[f"encoder_{key}"] else s[f"decoder_{key}"]

    return ModelConfig(
        kind="encoder-decoder", vocab_size=s["vocab_size"], d_model=s["d_model"],
        n_heads=s["encoder_attention_heads"], n_layers=s["encoder_layers"], n_decoder_layers=s["decoder_layers"],
        n_decoder_heads=decoder_own("attention_heads"), d_decoder_ff=decoder_own("ffn_dim"),
        d_ff=s["encoder_ffn_dim"], max_seq_len=s["max_position_embeddings"], dropout=float(s["dropout"]),
        attn_dropout=float(s["attention_dropout"]), ffn_dropout=float(s["activation_dropout"]),
        norm_position="post", activation=hf_activation(s["activation_function"], "activation_function", family),
        norm="layernorm", norm_eps=1e-5, bias=True, tie_embeddings=s["tie_word_embeddings"],
        embed_scale=s["scale_embedding"], lm_head_bias=True,
        pad_token_id=s["pad_token_id"], bos_token_id=token_id(s["bos_token_id"], "bos_token_id", family),
        eos_token_id=token_id(s["eos_token_id"], "eos_token_id", family),
        decoder_start_token_id=s["decoder_start_token_id"], **fixed)


# The conversion maps one embedding shared by source and target (a Marian file with a separate decoder
# vocabulary is refused on import too), so a model with its own source vocabulary has no HF form here.
SHARED_VOCAB = (lambda v: v is None, "None: tformer's Marian/BART export uses one vocabulary shared by source "
                "and target; train without --separate-vocab to export")


def fits(cfg: ModelConfig, **specific) -> list[str]:
    # transformers' Marian/BART layers use nn.LayerNorm's default eps, 1e-5.
    return mismatches(cfg, dict(kind="encoder-decoder", norm_position="post", norm="layernorm", bias=True,
                                norm_eps=1e-5, type_vocab_size=0, activation=list(ACT_TO_HF),
                                n_kv_heads=(lambda v: v in (None, cfg.n_heads) and v in (None, cfg.n_decoder_heads),
                                            "None: Marian/BART have no grouped-query attention"),
                                src_vocab_size=SHARED_VOCAB, **STANDARD_ATTENTION, **specific))


def decoder_start(cfg: ModelConfig) -> int | None:
    """The first decoder input (ModelConfig.decoder_start), or None when the config names none."""
    try:
        return cfg.decoder_start()
    except ConfigError:
        return None


def config_to_hf(cfg: ModelConfig, model_type: str, architecture: str) -> dict:
    start, decoder = decoder_start(cfg), cfg.stack_config("decoder")
    return dict(model_type=model_type, architectures=[architecture], is_encoder_decoder=True,
                vocab_size=cfg.vocab_size, d_model=cfg.d_model, max_position_embeddings=cfg.max_seq_len,
                encoder_layers=cfg.n_layers, decoder_layers=cfg.decoder_layers, encoder_attention_heads=cfg.n_heads,
                decoder_attention_heads=decoder.n_heads, encoder_ffn_dim=cfg.ffn_dim, decoder_ffn_dim=decoder.ffn_dim,
                activation_function=ACT_TO_HF[cfg.activation], dropout=cfg.dropout,
                attention_dropout=cfg.attention_dropout, activation_dropout=cfg.ffn_dropout,
                scale_embedding=cfg.embed_scale, tie_word_embeddings=cfg.tie_embeddings,
                pad_token_id=cfg.pad_token_id, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                forced_eos_token_id=None, decoder_start_token_id=start)


def build(cfg: ModelConfig) -> EncoderDecoder:
    return EncoderDecoder(cfg)


def export_extra(state: dict, cfg: ModelConfig) -> None:
    """Write the shared embedding under every name HF reads (with untied heads, transformers 5 keeps
    encoder/decoder embeddings as separate tensors), and a zero final_logits_bias when there is none."""
    for k in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        state[k] = state["shared.weight"].clone()
    bias = state.get("final_logits_bias")
    state["final_logits_bias"] = (bias if bias is not None else torch.zeros(cfg.vocab_size)).reshape(1, -1)


def prepare_import(hf_state: dict, cfg: ModelConfig, source: str) -> None:
    """final_logits_bias is a (1, V) buffer; tformer's lm_head.bias is (V,). A file without one
    means zeros, as in transformers' own loader."""
    bias = hf_state.get("final_logits_bias")
    hf_state["final_logits_bias"] = bias.reshape(-1) if bias is not None else torch.zeros(cfg.vocab_size)
