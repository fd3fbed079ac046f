"""An exponential moving average of a model's parameters (`tformer train --ema DECAY`): validated,
and kept as best, instead of the live weights; it smooths the noise of small-batch steps."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor, nn

from ..errors import CheckpointError


class EMA:
    """{parameter name: running average} of `model`'s trained parameters, on the model's device. Frozen
    ones (a LoRA run's base, frozen embeddings) are their own average: not copied."""

    def __init__(self, model: nn.Module, decay: float, saved: dict[str, Tensor] | None = None):
        self.model, self.decay = model, decay
        device = next(model.parameters()).device
        trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if saved is not None and trained.keys() - saved.keys():
            raise CheckpointError(f"the saved weight average lacks {sorted(trained.keys() - saved.keys())[:3]}")
        self.average = {n: saved[n].to(device) for n in trained} if saved is not None else \
            {n: p.detach().clone() for n, p in trained.items()}

    def update(self, step: int) -> None:
        """ema <- d * ema + (1 - d) * weights, with d growing to `decay` over the first steps
        (d = (1 + step) / (10 + step) until then), so the average soon forgets the random start."""
        d = min(self.decay, (1 + step) / (10 + step))
        params = dict(self.model.named_parameters())
        names = list(self.average)
        torch._foreach_lerp_([self.average[n] for n in names], [params[n].detach() for n in names], 1.0 - d)

    def _swap(self) -> None:
        """Exchange the live weights and their moving average (twice = back as before)."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name in self.average:
                p = params[name]
                live = p.detach().clone()
                p.copy_(self.average[name])
                self.average[name] = live

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The model holds the averaged weights inside the block, its live weights again after."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def tensors(self) -> dict[str, Tensor]:
        """The average on the CPU, for ema.safetensors."""
        return {n: t.detach().cpu().contiguous() for n, t in self.average.items()}
