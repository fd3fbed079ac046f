"""BERT (`BertModel`) <-> tformer `Encoder`: post-LN, learned + token-type embeddings with a
LayerNorm after them, GELU. Q, K, V are fused into qkv_proj.

Not part of `Encoder`, so dropped on import (declared in IGNORED, never silently): the pooler
(tanh(dense(first token)), used by next-sentence pre-training) and the pre-training heads `cls.*`.
On export no pooler is written: load with `BertModel.from_pretrained(dir, add_pooling_layer=False)`
(plain `AutoModel` works too and initialises a fresh pooler, as it says in its warning).

`BertForTokenClassification` (named entities: a linear `classifier` over every token's vector)
is `EncoderTokenClassifier` both ways; its label names travel in config.json's id2label. Its
`classifier_dropout` is not kept (training only: the tformer head drops out at the encoder's rate).
"""

from __future__ import annotations

from torch import nn

from ...errors import ConfigError
from ...model.config import ModelConfig
from ...model.heads import EncoderTokenClassifier
from ...model.models import Encoder
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

MODEL_TYPE = "bert"
ARCHITECTURE = "BertModel"
PREFIX = "bert."                       # BertFor* files nest the encoder under bert.; BertModel has none
EXPORT_PREFIX = ""
HEAD_KEYS = ()
TOKEN_CLASSIFIER = "BertForTokenClassification"
TAGGER_HEAD = [Rule("head.weight", ("classifier.weight",)), Rule("head.bias", ("classifier.bias",))]
IGNORED = {
    r"pooler\.dense\.(weight|bias)": "the pooler (tanh over the first token) is not part of Encoder",
    r"cls\..*": "pre-training heads (masked LM, next sentence) are not part of Encoder",
    r"embeddings\.(position_ids|token_type_ids)": "index buffers, rebuilt at run time",
}
DEFAULTS = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                intermediate_size=3072, hidden_act="gelu", hidden_dropout_prob=0.1,
                attention_probs_dropout_prob=0.1, max_position_embeddings=512,
                type_vocab_size=2, layer_norm_eps=1e-12, pad_token_id=0, is_decoder=False,
                add_cross_attention=False, position_embedding_type="absolute", bos_token_id=None, eos_token_id=None)

LAYER = [
    *((f"attn.qkv_proj.{p}", tuple(f"attention.self.{x}.{p}" for x in ("query", "key", "value")))  # [q; k; v]
      for p in ("weight", "bias")),
    ("attn.out_proj.weight", "attention.output.dense.weight"), ("attn.out_proj.bias", "attention.output.dense.bias"),
    ("attn_residual.norm.weight", "attention.output.LayerNorm.weight"),
    ("attn_residual.norm.bias", "attention.output.LayerNorm.bias"),
    ("ffn.up.weight", "intermediate.dense.weight"), ("ffn.up.bias", "intermediate.dense.bias"),
    ("ffn.down.weight", "output.dense.weight"), ("ffn.down.bias", "output.dense.bias"),
    ("ffn_residual.norm.weight", "output.LayerNorm.weight"), ("ffn_residual.norm.bias", "output.LayerNorm.bias"),
]


def config_from_hf(hf: dict) -> ModelConfig:
    s = settings(hf, DEFAULTS)
    refuse_unless(s["position_embedding_type"] == "absolute", "bert",
                  f"position_embedding_type={s['position_embedding_type']!r}")
    refuse_unless(not s["is_decoder"] and not s["add_cross_attention"], "bert", "is_decoder/add_cross_attention")
    return ModelConfig(
        kind="encoder", vocab_size=s["vocab_size"], d_model=s["hidden_size"], n_heads=s["num_attention_heads"],
        n_layers=s["num_hidden_layers"], d_ff=s["intermediate_size"], max_seq_len=s["max_position_embeddings"],
        dropout=float(s["hidden_dropout_prob"]),
        attn_dropout=float(s["attention_probs_dropout_prob"]), norm_position="post", positional="learned",
        activation=hf_activation(s["hidden_act"], "hidden_act", "bert"), norm="layernorm",
        norm_eps=s["layer_norm_eps"], bias=True, embedding_norm=True, type_vocab_size=s["type_vocab_size"],
        pad_token_id=s["pad_token_id"], bos_token_id=token_id(s["bos_token_id"], "bos_token_id", "bert"),
        eos_token_id=token_id(s["eos_token_id"], "eos_token_id", "bert"))


def fits(cfg: ModelConfig) -> list[str]:
    return mismatches(cfg, dict(kind="encoder", norm_position="post", positional="learned", norm="layernorm",
                                bias=True, embed_scale=False, embedding_norm=True, position_offset=0,
                                type_vocab_size=(lambda n: n >= 1, ">= 1: BERT always adds segment embeddings"),
                                activation=list(ACT_TO_HF),
                                n_kv_heads=[None, cfg.n_heads], **STANDARD_ATTENTION))


def config_to_hf(cfg: ModelConfig) -> dict:
    return dict(model_type=MODEL_TYPE, architectures=[ARCHITECTURE], vocab_size=cfg.vocab_size,
                hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                intermediate_size=cfg.ffn_dim, hidden_act=ACT_TO_HF[cfg.activation],
                hidden_dropout_prob=cfg.dropout, attention_probs_dropout_prob=cfg.attention_dropout,
                max_position_embeddings=cfg.max_seq_len, type_vocab_size=cfg.type_vocab_size,
                layer_norm_eps=cfg.norm_eps, pad_token_id=cfg.pad_token_id, bos_token_id=cfg.bos_token_id,
                eos_token_id=cfg.eos_token_id, is_decoder=False, add_cross_attention=False)


def build(cfg: ModelConfig) -> Encoder:
    return Encoder(cfg)


def rules(cfg: ModelConfig) -> list[Rule]:
    out = [Rule("embed.token.weight", ("embeddings.word_embeddings.weight",)),
           Rule("embed.position.weight", ("embeddings.position_embeddings.weight",)),
           Rule("embed.token_type.weight", ("embeddings.token_type_embeddings.weight",)),
           Rule("embed.norm.weight", ("embeddings.LayerNorm.weight",)),
           Rule("embed.norm.bias", ("embeddings.LayerNorm.bias",))]
    return out + layer_rules(LAYER, "layers.", "encoder.layer.", cfg.n_layers)


def copies(cfg: ModelConfig) -> list[tuple[str, ...]]:
    return []


# --- BertForTokenClassification <-> EncoderTokenClassifier -------------------------------------------

def build_for(hf: dict, cfg: ModelConfig) -> nn.Module:
    """The model a config.json describes: a tagger for BertForTokenClassification, else the Encoder."""
    if TOKEN_CLASSIFIER not in (hf.get("architectures") or []):
        return build(cfg)
    labels = labels_from_hf(hf)
    return EncoderTokenClassifier(cfg, len(labels), labels)


def rules_for(model: nn.Module) -> list[Rule]:
    """The key map of `model`: the encoder's, nested under `encoder.` in a tagger, plus its head."""
    if model.kind != "tagger":
        return rules(model.cfg)
    return [Rule("encoder." + r.ours, r.hf, r.transpose) for r in rules(model.cfg)] + TAGGER_HEAD


def export_for(model: nn.Module) -> tuple[dict, str, tuple[str, ...]]:
    """(config.json additions, prefix of the encoder's tensors, head tensor names) for `model`."""
    if model.kind != "tagger":
        return {}, EXPORT_PREFIX, HEAD_KEYS
    labels = model.labels or [f"LABEL_{i}" for i in range(model.num_labels)]
    extra = dict(architectures=[TOKEN_CLASSIFIER], id2label={str(i): name for i, name in enumerate(labels)},
                 label2id={name: i for i, name in enumerate(labels)})
    return extra, PREFIX, tuple(hf for r in TAGGER_HEAD for hf in r.hf)


def labels_from_hf(hf: dict) -> list[str]:
    """Label names in id order from id2label (keys are strings in config.json), else LABEL_i."""
    id2label = hf.get("id2label")
    if not id2label:
        n = hf.get("num_labels", 2)
        return [f"LABEL_{i}" for i in range(n)]
    try:
        ids = sorted(int(k) for k in id2label)
    except (TypeError, ValueError):
        raise ConfigError(f"bert: id2label keys must be label ids (0, 1, ...), got {sorted(id2label)[:5]}") from None
    if ids != list(range(len(ids))):
        raise ConfigError(f"bert: id2label must number its labels 0..{len(ids) - 1}, got {ids[:10]}")
    return [str(id2label.get(str(i), id2label.get(i))) for i in ids]
