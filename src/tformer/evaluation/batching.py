"""Batches for scoring: padding token lists to one width, and grouping rows of similar length so that
little compute goes to padding. Training's batches (tasks) use the same padding."""

from __future__ import annotations

import torch
from torch import Tensor


def pad(seqs: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad token lists to the longest: ids (B, T) and the HF-style mask (B, T) of 1 = token, 0 = pad."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids, mask


def length_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (sorted), so evaluation pads little."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
