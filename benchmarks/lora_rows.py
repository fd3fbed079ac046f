"""What serving several LoRA adapters in one batch costs (model/lora_batched.py, issue 48).

1. One layer: GPT-2-small's qkv matrix (2304 x 768, fp32) times 16 rows (a decoding step of 16 requests),
   with N adapters of rank 8 on its q rows: the plain Linear; the StackedLoRALinear with every row on the
   base, every row on adapter 1 (a prefill's case), and the rows spread over all N adapters and the base,
   run both ways a mixed step can go (all adapters' products, masked per row; or A and B gathered per row).
2. A whole decoding step of a GPT-2-small-shaped decoder (random weights, 16 rows, 64 cached tokens),
   four adapters on q and v: plain, every row on the base, every row on adapter 1, rows mixed.

The arms alternate within each round, so load from other processes hits all alike; figures are the
10th percentile of each arm's timings (the least disturbed), in milliseconds, and the ratio to the plain layer
or step of the same round.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lora_rows.py [--rounds 3] [--calls 200] [--steps 20]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import tformer
import tformer.model.lora_batched as lb
from tformer.model.linear import Linear
from tformer.model.lora import apply_lora
from tformer.model.lora_adapter import Adapter
from tformer.model.plans import plan_decoding

ROWS, WIDTH, RANK = 16, 768, 8


def timed(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 10] * 1e3


def layer_arms(n: int):
    torch.manual_seed(n)
    plain = nn.Module()
    plain.proj = Linear(WIDTH, 3 * WIDTH)
    holder = nn.Module()
    holder.proj = Linear(WIDTH, 3 * WIDTH)
    holder.proj.weight, holder.proj.bias = plain.proj.weight, plain.proj.bias
    adapters = []
    for _ in range(n):
        a = Adapter(WIDTH, 0, WIDTH, RANK, 2 * RANK)
        nn.init.normal_(a.b, std=0.02)
        adapters.append({"proj": {"q": a}})
    lb.stack_adapters(holder, adapters)
    x = torch.randn(ROWS, 1, WIDTH)
    mixed = [i % (n + 1) for i in range(ROWS)]

    def run(rows, dense=True):
        def call():
            lb.DENSE_RANK = 1 << 30 if dense else 0
            holder.proj(x)
        return lambda: (lb.select_adapters(holder, rows), call())

    return {"plain": lambda: plain.proj(x), "all base": run([0] * ROWS), "all adapter 1": run([1] * ROWS),
            "mixed, all run": run(mixed, True), "mixed, gathered": run(mixed, False)}


def step_arms(steps: int):
    torch.manual_seed(0)
    cfg = tformer.ModelConfig(kind="decoder", vocab_size=50257, d_model=768, n_heads=12, n_layers=12, d_ff=3072,
                              max_seq_len=1024)
    plain = tformer.Decoder(cfg).eval()
    adapters = []
    for k in range(4):
        model = tformer.Decoder(cfg).eval()
        model.load_state_dict(plain.state_dict())
        torch.manual_seed(k + 1)
        apply_lora(model, RANK, 2 * RANK, targets=("q", "v"))
        adapters.append(lb.take_adapters(model))
    stacked = tformer.Decoder(cfg).eval()
    stacked.load_state_dict(plain.state_dict())
    lb.stack_adapters(stacked, adapters)
    ids = torch.randint(0, cfg.vocab_size, (ROWS, 64))
    token = torch.randint(0, cfg.vocab_size, (ROWS, 1))

    def arm(model, rows):
        plan_decoding(model, ROWS)
        lb.select_adapters(model, rows)
        cache = model.new_cache(ROWS, 64 + steps)
        model.step(ids, cache)
        return lambda: (lb.select_adapters(model, rows), model.step(token, cache))

    return {"plain": arm(plain, [0] * ROWS), "all base": arm(stacked, [0] * ROWS),
            "all adapter 1": arm(stacked, [1] * ROWS), "mixed 0..4": arm(stacked, [i % 5 for i in range(ROWS)])}


def report(title: str, arms: dict, rounds: int, calls: int) -> None:
    best = {name: float("inf") for name in arms}
    for _ in range(rounds):
        for name, fn in arms.items():
            best[name] = min(best[name], timed(fn, calls))
    print(title + ": " + ", ".join(f"{k} {v:.3f} ms ({v / best['plain']:.2f}x)" for k, v in best.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--steps", type=int, default=20, help="decoding steps per arm and round (0: no whole steps)")
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    default = lb.DENSE_RANK
    with torch.inference_mode():
        for n in (1, 4, 16, 32, 64):
            report(f"layer, N={n}", layer_arms(n), args.rounds, args.calls)
        lb.DENSE_RANK = default
        if args.steps:
            report("GPT-2-small step, N=4", step_arms(args.rounds * args.steps), args.rounds, args.steps)


if __name__ == "__main__":
    main()
