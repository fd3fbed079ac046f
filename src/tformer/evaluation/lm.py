"""Language models, scoring: the validation loss that training logs and `tformer eval` reproduces."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.files import lm_windows


def mean_loss(model: nn.Module, ids: Tensor, context: int, batch_windows: int = 64) -> float:
    """Mean cross-entropy (nats per token) of `model` over every token of `ids` (cut into consecutive
    windows of `context`; each token predicted exactly once), in fp32."""
    device = next(model.parameters()).device
    windows = lm_windows(ids, context)
    total, count = 0.0, 0
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        full = [w for w in windows if len(w[0]) == context]
        rest = [w for w in windows if len(w[0]) != context]
        groups = [full[i:i + batch_windows] for i in range(0, len(full), batch_windows)] + [[w] for w in rest]
        for group in groups:
            x = torch.stack([w[0] for w in group]).to(device)                # (b, T)
            y = torch.stack([w[1] for w in group]).to(device)
            logits = model(x).float()
            total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            count += y.numel()
    return total / count
