"""Time one training step of the demo's shape (preset small, vocabulary 65, bf16 autocast, AdamW,
clipping) under model-config variants, e.g.

    python benchmarks/train_step_variants.py dropout=0.1 attn_dropout=0.0
    python benchmarks/train_step_variants.py dropout=0.0 batch=24 precision=fp32

Prints the median and minimum of 10 steps after 2 warm-up steps (BENCHMARKS.md, "Demo")."""

import sys
import time

import torch
import torch.nn.functional as F

from tformer.model.config import preset
from tformer.model.models import Decoder
from tformer.training.config import TrainConfig
from tformer.training.optim import make_optimizer


def main(argv: list[str]) -> None:
    kw = dict(a.split("=", 1) for a in argv)
    batch, steps, precision = int(kw.pop("batch", 32)), int(kw.pop("steps", 12)), kw.pop("precision", "bf16")
    overrides = {k: None if v == "None" else float(v) if "." in v else int(v) for k, v in kw.items()}
    torch.manual_seed(0)
    model = Decoder(preset("small", vocab_size=65, **overrides)).train()
    opt, _ = make_optimizer(model, TrainConfig(out="unused", lr=1e-3))
    x, y = torch.randint(0, 65, (2, batch, model.cfg.max_seq_len))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(x)
        F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    times = sorted(times[2:])
    print(" ".join(argv) or "defaults", f"median {times[len(times) // 2] * 1e3:.0f} ms  min {times[0] * 1e3:.0f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
