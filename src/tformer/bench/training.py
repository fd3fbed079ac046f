"""Training step: tformer Decoder vs Hugging Face GPT2LMHeadModel of the same shape (the shape
nanoGPT uses for character Shakespeare), same weights, AdamW, fp32 and bf16 autocast.

MFU = model FLOPs per token x tokens/s / measured GEMM peak. FLOPs per token (PaLM appendix B, as
in nanoGPT): 6·N for the weight GEMMs forward + backward, plus 12·L·T·D for attention scores and
the weighted sum (QKᵀ and αV, forward + backward). N leaves out the position table (a lookup, not a
GEMM) but keeps the tied token embedding, which the output layer multiplies with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import from_hf_model, hf_gpt2, interleaved_times

SHAPE = dict(n_layers=6, n_heads=6, d_model=384, context=256, batch=16, vocab=65)


def flops_per_token(n_params: int, n_layers: int, d_model: int, context: int) -> float:
    return 6 * n_params + 12 * n_layers * d_model * context


def _step_fn(model, loss_of, batch, device, dtype):
    """One optimiser step: forward, loss, backward, AdamW update."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    x, y = batch

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def run(device: str, quick: bool, ceilings: dict) -> list[dict]:
    s = dict(SHAPE)
    if quick:  # same width and depth, fewer tokens per step
        s.update(batch=4, context=128)
    hf = hf_gpt2(s["n_layers"], s["d_model"], s["n_heads"], s["vocab"], s["context"]).to(device).train()
    ours = from_hf_model(hf).to(device).train()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, s["vocab"], (s["batch"], s["context"]), generator=g).to(device)
    y = torch.randint(0, s["vocab"], (s["batch"], s["context"]), generator=g).to(device)
    n_params = sum(p.numel() for n, p in ours.named_parameters() if "position" not in n)
    fpt = flops_per_token(n_params, s["n_layers"], s["d_model"], s["context"])
    tokens = s["batch"] * s["context"]

    def ours_loss(m, x, y):
        return F.cross_entropy(m(x).flatten(0, 1).float(), y.flatten())

    def hf_loss(m, x, y):
        return F.cross_entropy(m(input_ids=x).logits.flatten(0, 1).float(), y.flatten())

    rows = []
    for dtype in ("fp32", "bf16"):
        times = interleaved_times({
            "tformer": _step_fn(ours, ours_loss, (x, y), device, dtype),
            "hf": _step_fn(hf, hf_loss, (x, y), device, dtype),
        }, device, repeats=2 if quick else 5, warmup=1)
        peak = ceilings[f"gemm_{dtype}_GFLOPs"] * 1e9
        tps = {k: tokens / t for k, t in times.items()}
        rows.append({
            "bench": "train", "case": f"nanoGPT-char {dtype}", "unit": "tok/s",
            "tformer": tps["tformer"], "peer": tps["hf"], "peer_name": "HF GPT2LMHeadModel",
            "ratio": tps["tformer"] / tps["hf"],
            "ceiling": peak / fpt, "utilisation": tps["tformer"] * fpt / peak,
            "peer_utilisation": tps["hf"] * fpt / peak, "utilisation_name": "MFU",
            "target": 1.1 if dtype == "fp32" else 1.2,
        })
    return rows
