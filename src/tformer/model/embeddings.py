"""The model's input vectors: token embedding (x √D in the 2017 model) + position vector (+ BERT's
segment vector), then an optional norm and dropout. Shapes: B batch, T length, D d_model."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..errors import ConfigError
from .config import ModelConfig
from .dropout import Dropout
from .layers import make_norm
from .positional import LearnedPositions, SinusoidalPositions


class Embeddings(nn.Module):
    """Token vector (x √D in the 2017 model) + position vector (+ segment vector in BERT) -> norm? -> dropout."""

    def __init__(self, cfg: ModelConfig, token: nn.Embedding | None = None):
        super().__init__()
        self.token = token if token is not None else nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.scale = math.sqrt(cfg.d_model) if cfg.embed_scale else 1.0
        if cfg.positional == "learned":
            self.position = LearnedPositions(cfg.max_seq_len, cfg.d_model, cfg.position_offset)
        elif cfg.positional == "sinusoidal":
            self.position = SinusoidalPositions(cfg.max_seq_len, cfg.d_model, cfg.sinusoidal_layout)
        else:
            self.position = None  # RoPE and T5's relative bias act inside attention instead
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.d_model) if cfg.type_vocab_size else None
        self.norm = make_norm(cfg) if cfg.embedding_norm else nn.Identity()
        self.dropout = Dropout(cfg.dropout)
        self.max_len = cfg.max_seq_len if self.position is not None else None  # RoPE has no table to run off

    def forward(self, ids: Tensor, positions: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        # Shape checks only (free): an index error deep inside an embedding says nothing to a user.
        if ids.dim() != 2 or ids.is_floating_point():
            raise ConfigError(f"token ids must be an integer tensor of shape (batch, length), got "
                              f"{ids.dtype} of shape {tuple(ids.shape)}")
        if self.max_len is not None and ids.size(1) > self.max_len:
            raise ConfigError(f"the input has {ids.size(1)} tokens but the model's context is "
                              f"max_seq_len={self.max_len} (shorten it)")
        x = self.token(ids) * self.scale                                         # (B, T, D)
        if self.position is not None:
            x = x + self.position(positions)
        if self.token_type is not None:
            x = x + self.token_type(token_type_ids if token_type_ids is not None else torch.zeros_like(ids))
        return self.dropout(self.norm(x))
