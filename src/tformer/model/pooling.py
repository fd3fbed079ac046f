"""Poolings: how a classifier reads one vector (B, D) from an encoder's output (B, T, D)."""

from __future__ import annotations

from torch import Tensor


def first_token(hidden: Tensor, attention_mask: Tensor | None) -> Tensor:
    """BERT's pooling: the vector of the first token ([CLS]). (B, T, D) -> (B, D)."""
    return hidden[:, 0]


def mean_tokens(hidden: Tensor, attention_mask: Tensor | None) -> Tensor:
    """The mean of the real (non-padding) tokens' vectors: the pooling sentence-transformers models
    such as all-MiniLM-L6-v2 were trained with, so their first token carries no sentence meaning."""
    if attention_mask is None:
        return hidden.mean(1)
    weights = attention_mask.unsqueeze(-1).to(hidden.dtype)                    # (B, T, 1)
    return (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)


POOLINGS = {"first": first_token, "mean": mean_tokens}
