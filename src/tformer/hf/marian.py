"""Marian (`MarianMTModel`) <-> tformer `EncoderDecoder`: the 2017 model. Post-LN, fixed sinusoidal
positions in the "split" layout (sines in the first half of the vector, cosines in the second),
embeddings scaled by sqrt(d_model) (scale_embedding), final_logits_bias, decoder start = pad.

The sinusoidal table is not a weight in tformer. transformers usually does not save it; when a file
does hold it, it must equal the formula (checked), or the checkpoint is refused.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..errors import CheckpointError
from ..positional import sinusoidal_table
from . import seq2seq
from .keymap import Rule, refuse_unless, settings

MODEL_TYPE = "marian"
ARCHITECTURE = "MarianMTModel"
PREFIX, EXPORT_PREFIX, HEAD_KEYS = seq2seq.PREFIX, seq2seq.EXPORT_PREFIX, seq2seq.HEAD_KEYS
POSITIONS = ("encoder.embed_positions.weight", "decoder.embed_positions.weight")
IGNORED: dict[str, str] = {}           # the position tables are checked in prepare_import, not ignored
DEFAULTS = dict(vocab_size=58101, decoder_vocab_size=None, share_encoder_decoder_embeddings=True,
                pad_token_id=58100, decoder_start_token_id=58100, eos_token_id=0, bos_token_id=None)


def config_from_hf(hf: dict) -> ModelConfig:
    s = settings(hf, {**seq2seq.COMMON_DEFAULTS, **DEFAULTS})
    refuse_unless(s["share_encoder_decoder_embeddings"], "marian", "share_encoder_decoder_embeddings=false")
    refuse_unless(s["decoder_vocab_size"] in (None, s["vocab_size"]), "marian",
                  f"a separate decoder vocabulary (decoder_vocab_size={s['decoder_vocab_size']})")
    return seq2seq.config_from_hf(hf, DEFAULTS, "marian", positional="sinusoidal", sinusoidal_layout="split")


def fits(cfg: ModelConfig) -> list[str]:
    return seq2seq.fits(cfg, positional="sinusoidal", sinusoidal_layout="split", embedding_norm=False) + (
        [] if cfg.decoder_start_token_id is not None or cfg.pad_token_id is not None
        else ["decoder_start_token_id=None and pad_token_id=None (Marian needs a decoder start token)"])


def config_to_hf(cfg: ModelConfig) -> dict:
    return {**seq2seq.config_to_hf(cfg, MODEL_TYPE, ARCHITECTURE), "decoder_vocab_size": cfg.vocab_size,
            "share_encoder_decoder_embeddings": True}


build = seq2seq.build
copies = seq2seq.copies


def rules(cfg: ModelConfig) -> list[Rule]:
    return seq2seq.rules(cfg, embedding_norm=False, learned_positions=False)


def prepare_import(hf_state: dict, cfg: ModelConfig, source: str) -> None:
    seq2seq.prepare_import(hf_state, cfg, source)
    table = sinusoidal_table(cfg.max_seq_len, cfg.d_model, "split")
    for key in POSITIONS:
        stored = hf_state.pop(key, None)
        if stored is not None and (stored.shape != table.shape or
                                   not torch.allclose(stored.float(), table, atol=1e-6, rtol=0)):
            raise CheckpointError(f"{source}: {key} is not the split sinusoidal table of "
                                  f"{cfg.max_seq_len} x {cfg.d_model} that Marian computes; "
                                  f"tformer cannot represent this checkpoint exactly")


def export_extra(state: dict, cfg: ModelConfig) -> None:
    seq2seq.export_extra(state, cfg)
