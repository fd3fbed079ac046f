"""Seconds per training step of the Bible recipe's model against the HF Marian peer of
`bible_marian_peer.py`, in one process on the same batches: tformer eager, tformer compiled (as the
recipe trains) and Marian eager, in interleaved blocks so that a noisy host slows all three alike.

    python benchmarks/bible_step_times.py [--tokenizer-from RUN] [--blocks 6]

Prints each arm's median seconds per step and its blocks.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer-from", default=None, help="a tformer bible run whose tokenizer.json to reuse")
    p.add_argument("--blocks", type=int, default=6, help="timed blocks per arm (default 6)")
    p.add_argument("--block-steps", type=int, default=5, help="steps per block (default 5)")
    a = p.parse_args()

    from bible_marian_peer import marian_loss, marian_peer  # this folder is on the path of a script run from it
    from tformer.checkpoints.format import load_tokenizer
    from tformer.tasks.translate import TranslateOptions, TranslateTask
    from tformer.training.config import resolve_options
    from tformer.training.options import pick

    values, _ = resolve_options(TranslateTask, {"task": "translate", "data": "bible-en-es", "out": "unused",
                                                "time_budget": 1200, "seed": 0})
    tok = load_tokenizer(a.tokenizer_from) if a.tokenizer_from else None
    task = TranslateTask(pick(TranslateOptions, values), tokenizer=tok)
    torch.manual_seed(0)
    tformer_model = task.build_model()
    marian = marian_peer(task)

    arms = {"tformer eager": (tformer_model, task.loss), "tformer compiled": (tformer_model, torch.compile(task.loss)),
            "hf marian eager": (marian, lambda model, b: marian_loss(model, b, task.label_smoothing))}
    for name, (model, _) in arms.items():
        print(f"{name}: {sum(p.numel() for p in model.parameters()):,} parameters")
    opts = {name: torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True) for name, (model, _) in arms.items()}

    def step(name: str, b) -> None:
        model, loss_fn = arms[name]
        loss_fn(model, b).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)

    t = time.perf_counter()
    for i in range(8):  # warm-up: compiling, and the shapes' first allocations
        for name in arms:
            step(name, task.batch(i))
    print(f"warm-up: {time.perf_counter() - t:.0f} s")
    times: dict[str, list[float]] = {name: [] for name in arms}
    first = 100
    for _ in range(a.blocks):
        for name in arms:
            t = time.perf_counter()
            for i in range(a.block_steps):
                step(name, task.batch(first + i))
            times[name].append((time.perf_counter() - t) / a.block_steps)
        first += a.block_steps
    for name, ts in times.items():
        print(f"{name}: median {statistics.median(ts):.3f} s a step; blocks {', '.join(f'{x:.2f}' for x in ts)}")


if __name__ == "__main__":
    main()
