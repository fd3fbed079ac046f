"""Int8 token embeddings, for a frozen base under LoRA adapters: `--lora-int8` quantises its base with
`quantize_base` (quant.py's quantize_int8 in fp32, then the token embeddings). The table E (V, D) is stored as
quant.py stores a linear layer's weight: one scale per row (per token), s_t = max_k |E_tk| / 127, and
q_tk = round(E_tk / s_t) in [-127, 127]. A lookup gathers the rows of q and s and multiplies:

    e(t) = s_t · q_t        (D,), exactly row t of the dequantised table s ⊙ q

so each value is within s_t / 2 of the fp32 table's. A table tied to the output layer (GPT-2, BERT,
Marian) is that layer's weight, whose int8 copy quantize_int8 made per output row (per token) the same
way: the embedding shares that copy's q and s, and the table exists once, in int8 (GPT-2: the 154 MB fp32
table goes, the 38.6 MB int8 one serves both). The table is a buffer: it takes no gradient.
Inference (`quantize_int8` alone) keeps fp32 tables: a lookup reads one row per token, there is little to gain.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..model.embeddings import Embeddings
from .quant import Int8Linear, quantize_int8, quantize_weight


class Int8Embedding(nn.Module):
    """A frozen nn.Embedding stored as int8 rows with one scale each. forward(ids (...)) -> (..., D) in
    the scales' dtype."""

    def __init__(self, weight: Tensor, scales: Tensor):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.register_buffer("weight", weight)          # (V, D) int8
        self.register_buffer("scales", scales)          # (V,)

    def forward(self, ids: Tensor) -> Tensor:
        return self.weight[ids].to(self.scales.dtype) * self.scales[ids].unsqueeze(-1)   # (..., D)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 per row"


def quantize_base(model: nn.Module) -> nn.Module:
    """The frozen base of `--lora-int8`, in place: every nn.Linear int8 (quantize_int8), then every token
    embedding (Embeddings.token, an encoder-decoder's shared table wherever it is held) an Int8Embedding,
    sharing the q and s of the Int8Linear that holds the very same numbers (its tied output layer)."""
    quantize_int8(model, dtype=torch.float32)          # the adapters train in fp32 around it, any model kind
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    tables = {id(m.token): m.token for m in model.modules()
              if isinstance(m, Embeddings) and isinstance(m.token, nn.Embedding)}
    new = {}
    for key, table in tables.items():
        q, scales = quantize_weight(table.weight)
        scales = scales.to(table.weight.dtype)
        same = next((m for m in layers if m.weight.shape == q.shape and torch.equal(m.weight, q)
                     and torch.equal(m.scales, scales)), None)
        new[key] = Int8Embedding(same.weight, same.scales) if same is not None else Int8Embedding(q, scales)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in new:
                setattr(parent, name, new[id(child)])
    return model
