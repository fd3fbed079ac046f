"""An encoder with a task head on top, BERT's recipe for the seeds' "downstream tasks":

    EncoderClassifier:       Encoder -> first token's vector -> dropout -> linear -> label logits (B, L)
    EncoderTokenClassifier:  Encoder -> every token's vector -> dropout -> linear -> label logits (B, T, L)

L = num_labels; other shape letters as in models.py.
"""

from __future__ import annotations

from torch import Tensor, nn

from .config import ModelConfig
from .dropout import Dropout
from .linear import Linear
from .models import Encoder
from .pooling import POOLINGS


def check_labels(num_labels: int, labels: list[str] | None) -> None:
    if num_labels < 2:
        raise ValueError(f"num_labels={num_labels} must be at least 2")
    if labels is not None and len(labels) != num_labels:
        raise ValueError(f"labels has {len(labels)} names but num_labels={num_labels}")


def label_head(d_model: int, num_labels: int) -> Linear:
    """The linear layer from a vector to label logits: N(0, 0.02) weights, zero bias (as BERT)."""
    head = Linear(d_model, num_labels)
    nn.init.normal_(head.weight, std=0.02)
    nn.init.zeros_(head.bias)
    return head


class EncoderClassifier(nn.Module):
    """Sequence classification as in BERT: the first token's vector -> dropout -> linear -> logits.
    (Softmax turns the logits into label probabilities; the loss applies it internally.)
    pooling="mean" averages the token vectors instead (for encoders pretrained that way)."""

    kind = "classifier"
    is_encoder_decoder = False

    def __init__(self, cfg: ModelConfig, num_labels: int, labels: list[str] | None = None, pooling: str = "first"):
        super().__init__()
        check_labels(num_labels, labels)
        if pooling not in POOLINGS:
            raise ValueError(f"pooling={pooling!r}; choose one of {', '.join(POOLINGS)}")
        self.cfg, self.num_labels, self.labels, self.pooling = cfg, num_labels, labels, pooling
        self.pool = POOLINGS[pooling]
        self.encoder = Encoder(cfg)
        self.dropout = Dropout(cfg.dropout)
        self.head = label_head(cfg.d_model, num_labels)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                return_attention: bool = False):
        out = self.encoder(input_ids, attention_mask, token_type_ids, return_attention=return_attention)
        hidden, attentions = out if return_attention else (out, None)
        logits = self.head(self.dropout(self.pool(hidden, attention_mask)))      # (B, num_labels)
        return (logits, attentions) if return_attention else logits


class EncoderTokenClassifier(nn.Module):
    """Token classification (named entities, BERT's recipe): every position's vector -> dropout ->
    linear -> label logits (B, T, num_labels). Padded positions get logits too; callers ignore them."""

    kind = "tagger"
    is_encoder_decoder = False

    def __init__(self, cfg: ModelConfig, num_labels: int, labels: list[str] | None = None):
        super().__init__()
        check_labels(num_labels, labels)
        self.cfg, self.num_labels, self.labels = cfg, num_labels, labels
        self.encoder = Encoder(cfg)
        self.dropout = Dropout(cfg.dropout)
        self.head = label_head(cfg.d_model, num_labels)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                return_attention: bool = False):
        out = self.encoder(input_ids, attention_mask, token_type_ids, return_attention=return_attention)
        hidden, attentions = out if return_attention else (out, None)
        logits = self.head(self.dropout(hidden))                                 # (B, T, num_labels)
        return (logits, attentions) if return_attention else logits
