"""Variants of a task's model trained side by side with the Hugging Face peer: the same batches, optimizer
set-up and schedule as benchmarks/equal_steps.py (its Side; no weight average without --score); prints each arm's mean
training loss over every 50 steps (batches no arm has seen before), and with --score each arm's figures on
the validation split at the end (the weights' average where the recipe keeps one). For finding what makes one
model learn more per step than another; never scores the test split.

    python benchmarks/equal_steps_arms.py --task bible --steps 1000 --run 700 peer recipe \\
        'post={"norm_position": "post"}' 'plain=|plain' 'fast=|lr1e-3'
    python benchmarks/equal_steps_arms.py --task sentiment --steps 1000 --score peer recipe \\
        'bert={"norm_position": "post", "embedding_norm": true}'

An arm is `peer`, `recipe` (the task's model), or NAME=FIELDS[|OPTIONS]: the recipe's model with the JSON
ModelConfig FIELDS laid over it; OPTIONS (comma-separated): `plain` (every matrix N(0, 0.02), no residual
scaling), `lrX` (peak learning rate X). `--steps` sets the schedule (warm-up + cosine), `--run` how many of its
steps to train (default all).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from equal_steps import Side, build  # noqa: E402
from equal_steps_peers import CASES, items  # noqa: E402
from tformer.checkpoints.format import build as build_model  # noqa: E402
from tformer.model.models import init_weights  # noqa: E402


def plain_init(model: nn.Module) -> None:
    """Every matrix N(0, 0.02), no residual scaling: tformer's initialisation of a post-norm model."""
    init_weights(model, 1, "post")


def variant(model: nn.Module, fields: dict) -> nn.Module:
    """A fresh model of `model`'s class (and labels, pooling) on its ModelConfig with `fields` laid over it,
    built as a checkpoint's config.json describes one (checkpoints.format.build)."""
    return build_model({"architecture": type(model).__name__, "config": model.cfg.replace(**fields).to_dict(),
                        **{k: getattr(model, k) for k in ("num_labels", "labels", "pooling") if hasattr(model, k)}})


def arm(spec: str, case, task, cfg, seed: int) -> Side:
    name, _, rest = spec.partition("=")
    torch.manual_seed(seed)
    if name == "peer":                       # initialised as equal_steps.pair initialises it
        twin = task.build_model()
        torch.manual_seed(seed)
        return Side(name, case.peer(task, twin), task, cfg)
    if name == "recipe":
        return Side(name, task.build_model(), task, cfg)
    fields, _, options = rest.partition("|")
    model = variant(task.build_model(), json.loads(fields or "{}"))
    for option in filter(None, options.split(",")):
        if option == "plain":
            torch.manual_seed(seed)
            plain_init(model)
        elif option.startswith("lr"):
            cfg = replace(cfg, lr=float(option[2:]))
        else:
            sys.exit(f"error: {spec}: unknown option {option!r} (plain, lrX)")
    return Side(name, model, task, cfg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("arms", nargs="+")
    p.add_argument("--task", default="bible", choices=sorted(CASES))
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--run", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--score", action="store_true", help="score each arm on the validation split at the end")
    a = p.parse_args()
    case = CASES[a.task]
    task, cfg = build(case, a.steps, a.seed, {})
    if not a.score:
        cfg = replace(cfg, ema=0)
    sides = [arm(spec, case, task, cfg, a.seed) for spec in a.arms]
    for side in sides:
        side.model.train()
        print(f"{side.name}: {sum(q.numel() for q in side.model.parameters()):,} parameters, lr {side.cfg.lr:g}",
              flush=True)
    start = time.time()
    for step in range(a.run or a.steps):
        batch = task.batch(step, "train")
        for side in sides:
            side.step(step, batch)
        if (step + 1) % 50 == 0:
            losses = "  ".join(f"{s.name} {sum(s.losses[-50:]) / 50:.4f}" for s in sides)
            print(f"step {step + 1}: {losses}  ({time.time() - start:.0f} s)", flush=True)
    if a.score:
        held = {"validation": items(task, "validation", case.limit)}
        for side in sides:
            figures = side.scores(case, held)["validation"]
            shown = "  ".join(f"{k} {v:.4f}" for k, v in figures.items() if isinstance(v, float))
            print(f"validation, {side.name}: {shown}  (median step {side.median_step() * 1000:.1f} ms)", flush=True)


if __name__ == "__main__":
    main()
