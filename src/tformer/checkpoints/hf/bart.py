"""BART (`BartForConditionalGeneration`) <-> tformer `EncoderDecoder`: post-LN, learned positions
stored with an offset of 2 rows (position_offset=2), a LayerNorm after the embeddings on both sides
(layernorm_embedding -> embedding_norm), final_logits_bias, GELU."""

from __future__ import annotations

from ...model.config import ModelConfig
from . import seq2seq
from .keymap import Rule, refuse_unless

MODEL_TYPE = "bart"
ARCHITECTURE = "BartForConditionalGeneration"
PREFIX, EXPORT_PREFIX, HEAD_KEYS = seq2seq.PREFIX, seq2seq.EXPORT_PREFIX, seq2seq.HEAD_KEYS
IGNORED = {r"(encoder|decoder)\.version": "fairseq version markers, not weights"}
DEFAULTS = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
# Switches of older BART-like configs (mBART, fairseq ports) that change the architecture, with the
# value transformers' BART implements. Any other value is refused.
LEGACY = dict(normalize_before=False, add_final_layer_norm=False, normalize_embedding=True,
              static_position_embeddings=False, add_bias_logits=False, extra_pos_embeddings=2)


def config_from_hf(hf: dict) -> ModelConfig:
    for key, value in LEGACY.items():
        refuse_unless(hf.get(key, value) == value, "bart", f"{key}={hf.get(key)!r}")
    return seq2seq.config_from_hf(hf, DEFAULTS, "bart", positional="learned", position_offset=2, embedding_norm=True)


def fits(cfg: ModelConfig) -> list[str]:
    return seq2seq.fits(cfg, positional="learned", position_offset=2, embedding_norm=True)


def config_to_hf(cfg: ModelConfig) -> dict:
    return seq2seq.config_to_hf(cfg, MODEL_TYPE, ARCHITECTURE)


build = seq2seq.build
copies = seq2seq.copies
prepare_import = seq2seq.prepare_import
export_extra = seq2seq.export_extra


def rules(cfg: ModelConfig) -> list[Rule]:
    return seq2seq.rules(cfg, embedding_norm=True, learned_positions=True)
