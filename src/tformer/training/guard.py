"""The numeric guard of training: a NaN/inf loss or gradient skips the update (at most
--skip-nonfinite times) and then stops the run; weights an update made NaN/inf are never saved."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..errors import TformerError
from .distributed import Dist


class NonFiniteError(TformerError):
    """A NaN or infinite loss, gradient or weight stopped the run (after --skip-nonfinite skipped steps)."""

    def __init__(self, step: int, what: str, message: str | None = None):
        super().__init__(message or f"step {step}: {what} is not finite")
        self.step, self.what = step, what


class NumericGuard:
    """Watches `model` (the trained, possibly wrapped module); every process takes the same decision."""

    def __init__(self, model: nn.Module, dist: Dist, device: torch.device, grad_clip: float, skip_nonfinite: int,
                 say: Callable[[str], None]):
        self.model, self.dist, self.device = model, dist, device
        self.grad_clip, self.skip_nonfinite, self.say = grad_clip, skip_nonfinite, say
        self.skipped = 0  # steps skipped for a NaN/inf loss or gradient

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm, after clipping to --grad-clip when set."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.grad_clip:
            norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def healthy(self, loss: float, norm: torch.Tensor, step: int) -> bool:
        """Whether step `step` may update the weights. A NaN/inf loss or gradient skips the update
        (at most --skip-nonfinite times), then stops the run before the bad step touches anything."""
        bad = not (math.isfinite(loss) and bool(torch.isfinite(norm)))
        if self.dist.world > 1:  # every process must take the same decision
            bad = bool(self.dist.max([float(bad)], self.device)[0])
        if not bad:
            return True
        what = f"the loss ({loss})" if not math.isfinite(loss) else f"the gradient norm ({float(norm)})"
        self.skipped += 1
        if self.skipped > self.skip_nonfinite:
            raise NonFiniteError(step, what)
        self.say(f"warning: step {step}: {what} is not finite; update skipped "
                 f"({self.skipped} of --skip-nonfinite {self.skip_nonfinite})")
        return False

    def weights_finite(self) -> bool:
        local = all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())
                    for p in self.model.parameters())
        return not self.dist.max([float(not local)], self.device)[0]

    def check_weights(self, step: int) -> None:
        """Never save weights an update made NaN/inf (a finite but huge step can)."""
        if not self.weights_finite():
            raise NonFiniteError(step, "a weight after the update")


def stopped(e: NonFiniteError, run: Path, last_good: Path | None) -> NonFiniteError:
    """The error that ends the run: what was not finite, and where to go on from."""
    where = (f"the last good checkpoint is {last_good} (continue with `tformer train --resume {run} "
             "--skip-nonfinite N` to skip up to N such steps, or start again with a lower --lr)" if last_good else
             "no checkpoint was saved (start again with a lower --lr, or --skip-nonfinite N to skip such steps)")
    return NonFiniteError(e.step, e.what, f"step {e.step}: {e.what} is not finite, training stopped; {where}")
