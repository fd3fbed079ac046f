"""Equal-step comparisons, the reference protocol: a task's default tformer recipe against a same-shape
Hugging Face peer (benchmarks/equal_steps_peers.py), both trained N steps on the same batches and scored on
the test split.

    python benchmarks/equal_steps.py --task sentiment --steps 1000 --seeds 0,1,2 --json out.json

Cases (--task): sentiment (from scratch: BertForSequenceClassification), sentiment-minilm (both from the
shipped all-MiniLM-L6-v2), wnut16 (tagging from MiniLM: BertForTokenClassification), hamlet (char LM: GPT-2,
nanoGPT's shape), bible (en->es: MarianMTModel, beam 4 on the first 500 test pairs), numbers (fr->en: Marian).

The protocol, per seed:
- tformer's side is the run `tformer train --task T [--data D] [--init MINILM] --max-steps N --seed S` makes
  (tformer.training.session.prepare: the task's recipe, its tokenizer, its model); the peer takes the model's
  shape and the recipe's dropout (equal_steps_peers).
- One training set-up for both, the recipe's: the task's batch(step) (one batch object per step, fed to both),
  the task's loss, AdamW with tformer's parameter groups, betas and weight decay, linear warm-up + cosine over
  N steps (tformer.training.optim.lr_at), gradient clipping, the dropout seed of each step, bf16 autocast where
  `--precision auto` picks it, and the recipe's weight average (--ema) where it has one. Each side gets its own
  optimizer and average. The learning rate is the recipe's for both, or `--lr`; `--lrs a,b,..` searches those
  on the VALIDATION split at the first seed, each side keeping its best.
- The steps alternate (tformer first on even steps, the peer first on odd ones), each timed: the step-time
  ratio (peer's median / tformer's, after the first tenth of the steps) is measured side by side, under the same
  load. tformer's side is torch.compile'd where its recipe says so (bible), the peer runs eager (HF's default).
- At step N each side's weights (its average, where the recipe keeps one) are scored by the same
  tformer.evaluation function on the same items: the validation split and the test split, rebuilt as
  `tformer eval` rebuilds them (Task.heldout). No keep-best: the figure is the one at N steps.

Prints a table per seed and the mean; --json writes every figure, the CPU, the settings and the invariants
(tokens seen, a digest of the batches and of the scored items, parameter counts).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))   # equal_steps_peers, bible_marian_peer

from equal_steps_peers import CASES, PARAM_TOLERANCE, Case, digest, items, score  # noqa: E402


def params(model: torch.nn.Module) -> int:
    """Trained parameters: not a frozen table (HF Marian's sinusoidal positions, a pretrained model's frozen
    embeddings; tformer computes sinusoidal positions and freezes the same embeddings)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def batch_bytes(batch: dict[str, torch.Tensor]) -> bytes:
    return b"".join(k.encode() + batch[k].contiguous().numpy().tobytes() for k in sorted(batch))


class Side:
    """One model in training: its optimizer, its weight average, its step times, what it was fed."""

    def __init__(self, name: str, model: torch.nn.Module, task, cfg, compiled: bool = False):
        from tformer.devices import native_bf16
        from tformer.training.ema import EMA
        from tformer.training.optim import make_optimizer
        from tformer.training.steplog import loss_and_metrics

        self.name, self.model, self.task, self.cfg = name, model, task, cfg
        self.opt, _ = make_optimizer(model, cfg)
        self.ema = EMA(model, cfg.ema) if cfg.ema else None
        self.bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and native_bf16(torch.device("cpu")))
        self.loss = loss_and_metrics(task, model)
        self.varying: dict[str, list[int]] = {}
        if compiled:
            from tformer.data.files import varying_dims
            self.loss = torch.compile(self.loss)
            self.varying = varying_dims([task.batch(s, "train") for s in range(4)])
        self.times: list[float] = []
        self.tokens, self.fed, self.losses = 0, hashlib.sha256(), []

    def step(self, step: int, batch: dict[str, torch.Tensor]) -> None:
        from tformer.training.optim import lr_at, progress_of

        self.tokens += self.task.tokens(batch)
        self.fed.update(batch_bytes(batch))
        cfg, start = self.cfg, time.perf_counter()
        for g in self.opt.param_groups:
            g["lr"] = lr_at(cfg, step, progress_of(cfg, step, 0.0, None))
        torch.manual_seed((cfg.seed * 1_000_003 + step) * 131)           # dropout: f(seed, step), as the Trainer
        for k in self.varying.keys() & batch.keys():
            torch._dynamo.maybe_mark_dynamic(batch[k], self.varying[k])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            loss, _ = self.loss(batch)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.grad is not None], cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update(step)
        self.times.append(time.perf_counter() - start)
        self.losses.append(loss.item())

    def scores(self, case: Case, held: dict[str, Any]) -> dict[str, Any]:
        """Each split's figures of the weights at the last step (their average where the recipe keeps one)."""
        out = {}
        with self.ema.applied() if self.ema is not None else nullcontext(), torch.no_grad():
            for split, data in held.items():
                out[split] = {**score(self.task, self.model, data, case.num_beams), "items": digest(data)}
        return out

    def median_step(self) -> float:
        return statistics.median(self.times[len(self.times) // 10:])


def build(case: Case, steps: int, seed: int, overrides: dict[str, Any]):
    """(task, cfg): the run `tformer train` makes of the case's options, --max-steps `steps`, --seed `seed`."""
    from tformer.training.session import prepare

    options = {**case.options(), **overrides, "max_steps": steps, "seed": seed, "out": "unused-equal-steps",
               "progress": False}
    plan = prepare(case.task, **options)
    return plan.task, plan.cfg


def pair(case: Case, steps: int, seed: int, lrs: tuple[float | None, float | None] = (None, None),
         splits: tuple[str, ...] = ("validation", "test"), overrides: dict[str, Any] | None = None,
         limit: int | None = None, compile_ours: bool = True) -> dict[str, Any]:
    """Train tformer's recipe and the peer side by side for `steps` steps; their figures on `splits`."""
    task, cfg = build(case, steps, seed, overrides or {})
    torch.manual_seed(seed)
    ours = task.build_model()
    torch.manual_seed(seed)
    peer = case.peer(task, ours)
    sides = [Side("tformer", ours, task, replace(cfg, lr=lrs[0] or cfg.lr), compiled=cfg.compile and compile_ours),
             Side("hf", peer, task, replace(cfg, lr=lrs[1] or cfg.lr))]
    for side in sides:
        side.model.train()
    for step in range(steps):
        batch = task.batch(step, "train")          # one batch, both sides
        for side in (sides if step % 2 == 0 else sides[::-1]):
            side.step(step, batch)
        if (step + 1) % 100 == 0:
            print(f"seed {seed} step {step + 1}: train loss tformer {sides[0].losses[-1]:.4f}, peer "
                  f"{sides[1].losses[-1]:.4f}", file=sys.stderr, flush=True)
    limit = case.limit if limit is None else limit
    held = {split: items(task, split, limit) for split in splits}
    out: dict[str, Any] = {"seed": seed, "steps": steps, "recipe_lr": cfg.lr, "ema": cfg.ema,
                           "bf16": sides[0].bf16, "compiled": bool(cfg.compile and compile_ours)}
    for side in sides:
        out[side.name] = {"lr": side.cfg.lr, "params": params(side.model), "tokens": side.tokens,
                          "batches": side.fed.hexdigest()[:16], "final_train_loss": side.losses[-1],
                          "step_s": side.median_step(), **side.scores(case, held)}
    out["param_ratio"] = out["hf"]["params"] / out["tformer"]["params"]
    out["step_time_ratio"] = out["hf"]["step_s"] / out["tformer"]["step_s"]   # > 1: tformer's step is faster
    return out


def better(case: Case, a: float, b: float) -> bool:
    return a > b if case.higher_is_better else a < b


def search(case: Case, steps: int, seed: int, candidates: list[float], overrides: dict[str, Any],
           limit: int | None, compile_ours: bool = True) -> tuple[tuple[float, float], list[dict]]:
    """Each side's best learning rate of `candidates` on the validation split (one run each, at `seed`)."""
    runs, best = [], [None, None]
    for lr in candidates:
        r = pair(case, steps, seed, (lr, lr), ("validation",), overrides, limit, compile_ours)
        runs.append({"lr": lr, "tformer": r["tformer"]["validation"][case.metric],
                     "hf": r["hf"]["validation"][case.metric]})
        for i, side in enumerate(("tformer", "hf")):
            if best[i] is None or better(case, runs[-1][side], best[i][1]):
                best[i] = (lr, runs[-1][side])
    return (best[0][0], best[1][0]), runs


def cpu() -> str:
    from tformer.kernels.build import cpu as cpu_info

    name, features = cpu_info()
    return f"{name}; {' '.join(features) or 'no AVX-512/AMX'}; {torch.get_num_threads()} torch threads"


def report(name: str, case: Case, result: dict[str, Any]) -> str:
    m = case.metric
    lines = [f"equal steps: {name}, {result['steps']} steps, tformer {case.task} recipe vs {case.peer_name}",
             f"CPU: {result['cpu']}",
             f"learning rate: tformer {result['lr']['tformer']:g}, peer {result['lr']['hf']:g} ({result['lr']['how']})",
             f"{'seed':>6}  {'tformer test ' + m:>22}  {'peer test ' + m:>22}  {'val (tformer / peer)':>22}  "
             f"{'peer/tformer step time':>22}  params peer/tformer"]
    for r in result["seeds"]:
        lines.append(f"{r['seed']:>6}  {r['tformer']['test'][m]:>22.4f}  {r['hf']['test'][m]:>22.4f}  "
                     f"{r['tformer']['validation'][m]:>10.4f} / {r['hf']['validation'][m]:<9.4f}  "
                     f"{r['step_time_ratio']:>21.2f}x  {r['param_ratio']:.3f}")
    mean = result["mean"]
    lines.append(f"{'mean':>6}  {mean['tformer']:>22.4f}  {mean['hf']:>22.4f}  {'':>22}  "
                 f"{mean['step_time_ratio']:>21.2f}x")
    verdict = "behind" if better(case, mean["hf"], mean["tformer"]) else "at least level with"
    lines.append(f"tformer is {verdict} the peer on the mean test {m} at {result['steps']} steps")
    return "\n".join(lines)


def run(name: str, steps: int, seeds: list[int], lr: float | None = None, lrs: list[float] | None = None,
        overrides: dict[str, Any] | None = None, limit: int | None = None, compile_ours: bool = True) -> dict[str, Any]:
    case, overrides = CASES[name], overrides or {}
    chosen, how, searched = (lr, lr), "given (--lr)" if lr else "the recipe's", []
    if lrs:
        chosen, searched = search(case, steps, seeds[0], lrs, overrides, limit, compile_ours)
        how = f"each side's best on validation of {', '.join(f'{x:g}' for x in lrs)} (seed {seeds[0]})"
    runs = []
    for seed in seeds:      # each seed's figures printed as it ends: a run cut short keeps the seeds it finished
        runs.append(pair(case, steps, seed, chosen, ("validation", "test"), overrides, limit, compile_ours))
        r, m = runs[-1], case.metric
        print(f"seed {seed} done: test {m} tformer {r['tformer']['test'][m]:.4f}, peer {r['hf']['test'][m]:.4f}; "
              f"validation {r['tformer']['validation'][m]:.4f} / {r['hf']['validation'][m]:.4f}; "
              f"step time peer/tformer {r['step_time_ratio']:.2f}x", flush=True)
    mean = {side: statistics.mean(r[side]["test"][case.metric] for r in runs) for side in ("tformer", "hf")}
    mean["step_time_ratio"] = statistics.mean(r["step_time_ratio"] for r in runs)
    return {"case": name, "task": case.task, "peer": case.peer_name, "metric": case.metric, "steps": steps,
            "cpu": cpu(), "lr": {"tformer": runs[0]["tformer"]["lr"], "hf": runs[0]["hf"]["lr"], "how": how,
                                 "search": searched},
            "param_tolerance": PARAM_TOLERANCE, "num_beams": case.num_beams, "limit": limit or case.limit,
            "overrides": overrides, "seeds": runs, "mean": mean}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", required=True, choices=list(CASES))
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seeds", default="0,1,2", help="comma-separated (default 0,1,2)")
    p.add_argument("--lr", type=float, default=None, help="one learning rate for both (default: the recipe's)")
    p.add_argument("--lrs", default=None, help="comma-separated learning rates searched on the validation split")
    p.add_argument("--limit", type=int, default=None, help="scored items per split (default: the case's)")
    p.add_argument("--no-compile", action="store_true", help="tformer's side eager too, even where its recipe "
                   "compiles (bible: minutes of compiling on a small CPU)")
    p.add_argument("--json", default=None, help="write every figure here")
    a = p.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    seeds = [int(s) for s in a.seeds.split(",")]
    lrs = [float(x) for x in a.lrs.split(",")] if a.lrs else None
    result = run(a.task, a.steps, seeds, a.lr, lrs, limit=a.limit, compile_ours=not a.no_compile)
    result["command"] = " ".join(sys.argv)
    print(report(a.task, CASES[a.task], result))
    if a.json:
        from tformer.checkpoints.files import write_json_atomic

        write_json_atomic(Path(a.json), result)


if __name__ == "__main__":
    main()
