"""Marian (`MarianMTModel`) <-> tformer `EncoderDecoder`: the 2017 model. Post-LN, fixed sinusoidal
positions in the "split" layout (sines in the first half of the vector, cosines in the second),
embeddings scaled by sqrt(d_model) (scale_embedding), final_logits_bias, decoder start = pad.

The sinusoidal table is not a weight in tformer. transformers usually does not save it; when a file
does hold it, it must equal the formula (checked), or the checkpoint is refused.

A model with the paper's "interleaved" table (sin on even, cos on odd dimensions) is exported too:
the split table is the interleaved one with its columns reordered, so reordering the residual-stream
dimensions of every weight the same way gives an identical function (LayerNorm, attention and the
FFN do not care about the order of the D dimensions; only the position table did).
"""

from __future__ import annotations

import torch

from ...errors import CheckpointError
from ...model.config import ModelConfig
from ...model.positional import sinusoidal_table
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
    return seq2seq.fits(cfg, positional="sinusoidal", position_offset=0, embedding_norm=False) + (
        [] if seq2seq.decoder_start(cfg) is not None
        else ["decoder_start_token_id=None (Marian needs a decoder start token; set it, or pad_token_id)"])


def config_to_hf(cfg: ModelConfig) -> dict:  # always the split layout: see export_state
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


# Which dimension of each tformer tensor indexes the residual stream (D): matrices that read from it
# (embeddings, input projections, the output layer) have it as columns; those that write to it
# (output projections) as rows, with their biases; norms along their only dimension.
READS = ("token.weight", "shared.weight", "lm_head.weight", "qkv_proj.weight", "q_proj.weight", "kv_proj.weight",
         "ffn.up.weight")
WRITES = ("out_proj.weight", "out_proj.bias", "ffn.down.weight", "ffn.down.bias", "norm.weight", "norm.bias")


def export_state(state: dict, cfg: ModelConfig) -> dict:
    """The weights in the split layout's basis (see the module docstring)."""
    if cfg.sinusoidal_layout == "split":
        return state
    d = cfg.d_model
    perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])    # split column j = interleaved perm[j]
    out = {}
    for key, t in state.items():
        if key.endswith(READS):
            t = t[:, perm]
        elif key.endswith(WRITES):
            t = t[perm]
        out[key] = t
    return out
