"""`make demo` (= python -m tformer.cli.demo): train a character-level GPT on Hamlet for a few minutes,
then write with it. Training validates on the part of the play before its last 10% (the best validation
keeps the model); the last 10%, the test text, is scored once at the end, as `tformer eval` scores it.

The same run from the command line (`tformer train` on hamlet takes the same recipe by default):
    tformer train --time-budget 300 --seed 1337 --prompt "HAMLET:" --out runs/demo-...
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# What the demo sets itself; the rest is `tformer train`'s recipe for hamlet (tformer.tasks.lm.HAMLET).
DEMO = dict(task="lm", data="hamlet", time_budget=300.0, seed=1337, prompt="HAMLET:\n")
SAMPLES = [  # (what, generation settings): three deliberate variations on sampled text's defaults
    ("temperature 0.8, top-k 50", dict(temperature=0.8, top_k=50, top_p=None)),
    ("temperature 1.0, top-p 0.9", dict(temperature=1.0, top_k=None, top_p=0.9)),
    ("temperature 0.5, top-k 10, top-p 0.95", dict(temperature=0.5, top_k=10, top_p=0.95)),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tformer.cli.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--time-budget", type=float, default=DEMO["time_budget"], help="training seconds (default 300)")
    p.add_argument("--out", default=None, help="run directory (default runs/demo-<date>-<time>)")
    opts = p.parse_args(argv)

    from tformer.errors import TformerError
    from tformer.tasks.lm import LMOptions, LMTask, sample_text
    from tformer.training.config import TrainConfig, describe_recipe, resolve_options
    from tformer.training.loop import fit
    from tformer.training.options import pick

    t0 = time.perf_counter()
    out = opts.out or os.path.join("runs", f"demo-{time.strftime('%Y%m%d-%H%M%S')}")
    values, chosen = resolve_options(LMTask, {**DEMO, "time_budget": opts.time_budget, "out": out})
    args = pick(LMOptions, values)
    try:
        task = LMTask(args)
        cfg = pick(TrainConfig, values)
        print(f"tformer demo: a {task.cfg.n_layers}-layer, width-{task.cfg.d_model} GPT learns Hamlet character "
              f"by character ({len(task.train_ids):,} training / {len(task.val_ids):,} validation characters, "
              f"vocabulary {task.tokenizer.vocab_size}) for {opts.time_budget:.0f} s.\n"
              f"recipe: {describe_recipe(chosen)}", flush=True)
        result = fit(task, cfg, command=[sys.executable, "-m", "tformer.cli.demo", *(argv or sys.argv[1:])],
                     args={k: v for k, v in values.items() if k in vars(args)})
    except TformerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if result.reason == "interrupted":
        return 130

    import torch

    from tformer.checkpoints.format import load
    from tformer.checkpoints.layout import METRICS, PLOT
    from tformer.evaluation.lm import mean_loss

    model = load(result.best_checkpoint or result.checkpoint)   # best/: the averaged weights
    test = torch.tensor(task.tokenizer.encode(LMTask.heldout(task.meta(), split="test")), dtype=torch.long)
    print(f"\ntrained {result.step} steps in {result.elapsed:.0f} s; "
          f"best validation loss {result.best_val_loss:.4f} nats/char "
          f"(mean cross-entropy over the whole validation text)\n"
          f"test loss {mean_loss(model, test, task.context):.4f} nats/char on the test text ({len(test):,} "
          f"characters, never used in training; `tformer eval --model RUN` scores the same)\n")
    for what, settings in SAMPLES:
        text = sample_text(model, task.tokenizer, args.prompt, seed=1, **settings)   # TEXT_DEFAULTS' length
        print(f"--- sample ({what}) ---\n{text}\n")
    run = result.run_dir
    print(f"checkpoint:  {result.best_checkpoint or result.checkpoint}")
    print(f"loss curve:  {os.path.join(run, PLOT)}   metrics: {os.path.join(run, METRICS)}")
    print(f"write more:  tformer generate --model {run} --prompt \"HAMLET\" --max-new-tokens 200 --seed 1")
    print(f"demo finished in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
