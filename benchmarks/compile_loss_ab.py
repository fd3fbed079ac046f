"""What compiling the loss with the model buys: an interleaved A/B of a training step (a benchmark, not
a test). Two copies of a task's model (same weights, same batches): one with the model compiled and the
loss eager (`--compile` before), one with model and loss compiled as one function (the trainer's
`--compile` now), or `--eager` against the latter. Both warm up, then run blocks of steps in turn,
alternating which goes first, so a burst of load from elsewhere hits both alike: compare the ratio.
bf16 autocast where the CPU computes bf16 itself (as `--precision auto`), fp32 elsewhere.

    python benchmarks/compile_loss_ab.py --task translate --data bible-en-es      # BENCHMARKS.md
    python benchmarks/compile_loss_ab.py --eager                                   # the demo's recipe
"""

from __future__ import annotations

import argparse
import copy
import time
from functools import partial

import torch

from tformer.cli import build_parser
from tformer.cli.train import prepare
from tformer.data.files import varying_dims
from tformer.devices import native_bf16
from tformer.training.optim import make_optimizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="lm")
    p.add_argument("--data", default=None)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--steps", type=int, default=10, help="steps per block")
    p.add_argument("--eager", action="store_true", help="compare with nothing compiled instead")
    a = p.parse_args()
    argv = ["train", "--task", a.task, "--max-steps", "100000", "--out", "unused"]
    task, cfg, *_ = prepare(build_parser().parse_args(argv + (["--data", a.data] if a.data else [])))
    torch.manual_seed(0)
    model = task.build_model().train()
    twin = copy.deepcopy(model)
    before = partial(task.loss, model) if a.eager else partial(task.loss, torch.compile(model))
    runs = {"eager" if a.eager else "model compiled, loss eager": (before, model),
            "model and loss compiled": (torch.compile(partial(task.loss, twin)), twin)}
    opts = {name: make_optimizer(m, cfg)[0] for name, (_, m) in runs.items()}
    dims = varying_dims([task.batch(s) for s in range(4)])
    bf16 = native_bf16(torch.device("cpu"))

    def step(name: str, s: int) -> float:
        loss_of, m = runs[name]
        batch = task.batch(s)
        for k, d in dims.items():
            torch._dynamo.maybe_mark_dynamic(batch[k], d)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_of(batch)
        loss.backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        return loss.item()

    print(f"{task.name}, {'bf16' if bf16 else 'fp32'}")
    for name in runs:
        t0 = time.perf_counter()
        losses = [step(name, s) for s in range(12)]
        print(f"{name}: warm-up (12 steps, compiling) {time.perf_counter() - t0:.0f} s, losses {losses[-1]:.4f}")
    ms: dict[str, list[float]] = {name: [] for name in runs}
    for b in range(a.blocks):
        for name in (list(runs) if b % 2 == 0 else list(runs)[::-1]):
            t0 = time.perf_counter()
            for s in range(12 + b * a.steps, 12 + (b + 1) * a.steps):
                step(name, s)
            ms[name].append((time.perf_counter() - t0) / a.steps * 1e3)
    for name, v in ms.items():
        print(f"{name:28s}", " ".join(f"{x:5.0f}" for x in v), f"  mean {sum(v) / len(v):.0f} ms a step")
    first, second = ms.values()
    ratios = [x / y for x, y in zip(first, second)]
    print("ratio per block", " ".join(f"{r:.2f}" for r in ratios), f"  mean {sum(ratios) / len(ratios):.2f}")


if __name__ == "__main__":
    main()
