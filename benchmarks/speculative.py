"""Speculative decoding against plain greedy decoding, on a CPU, with models trained here.

    python benchmarks/speculative.py [--target gpt2-small] [--draft tiny] [--steps 150] [--runs 3]
                                     [--new-tokens 200] [--threads N] [--out DIR]

1. Trains on the shipped Hamlet (characters as tokens; `tformer.training.session.train` from a random
   --init checkpoint of each shape), for the same fixed number of steps and batch: the target, by default
   GPT-2 small's own shape (preset `gpt2-small`: 12 layers of width 768, learned positions, pre-LN; 85M
   parameters with a character vocabulary; learning rate 6e-4, GPT-2's for this size), and the draft,
   preset `tiny` (2 layers of width 64; learning rate 1e-3), both with a 256-token context. `--target small`
   (4 layers of width 256) is the shape of the first measurements (a target small enough to decode a token
   in one fused kernel call). Trained runs in --out are reused.
2. Times greedy decoding of --new-tokens tokens, interleaved (plain, speculative, plain, ...), median
   of --runs runs with their spread: the draft model (k = 2, 4, 6) on prompts from the held-out
   text; prompt lookup (n-gram 3, k = 4, 8) on a "repeat the passage" workload (a passage, a line
   asking for it again, its first words). Every speculative output is checked against plain greedy's.

Prints the CPU (from /proc/cpuinfo), each model's validation loss, tokens/s, speed-up and acceptance.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

CONTEXT = 256


def cpu_name() -> str:
    fields = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    family, model = fields.get("cpu family", "?"), fields.get("model", "?")
    return f"{fields.get('model name', '?')} (family {family} model {model}), {torch.get_num_threads()} threads"


LR = {"gpt2-small": 6e-4}                                      # the rest: 1e-3


def trained(name: str, preset: str, args) -> tuple[torch.nn.Module, float | None]:
    """The run `name` in --out, trained now if it is not there: (model, validation loss)."""
    import tformer
    from tformer import Decoder, ModelConfig
    from tformer.data.files import read_text, split_text
    from tformer.data.tokenizers import Tokenizer
    from tformer.model.config import PRESETS
    from tformer.training.session import train

    run = Path(args.out) / f"{name}-{preset}"
    if not (run / "checkpoints").exists():
        tokenizer = Tokenizer.char(split_text(read_text("hamlet"))[0])
        cfg = ModelConfig(**{**PRESETS[preset], "kind": "decoder", "vocab_size": tokenizer.vocab_size,
                             "pad_token_id": tokenizer.pad_id, "bos_token_id": tokenizer.bos_id,
                             "eos_token_id": tokenizer.eos_id, "max_seq_len": CONTEXT, "dropout": 0.0})
        torch.manual_seed(0)
        init = Path(args.out) / f"{name}-{preset}-init"
        tformer.save(Decoder(cfg), init, tokenizer=tokenizer)
        t = time.perf_counter()
        train("lm", data="hamlet", init=str(init), out=str(run), max_steps=args.steps, batch_size=8,
              context=CONTEXT, lr=LR.get(preset, 1e-3), warmup=20, eval_every=args.steps, save_every=args.steps,
              keep_best=False, progress=False, seed=0)
        print(f"trained {name} ({preset}): {args.steps} steps in {time.perf_counter() - t:.0f} s")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [r["val_loss"] for r in rows if "val_loss" in r]
    return tformer.load(run).eval(), (losses[-1] if losses else None)


def timed(model, ids: torch.Tensor, n: int, **kwargs) -> tuple[float, torch.Tensor]:
    t = time.perf_counter()
    out = model.generate(ids, max_new_tokens=n, eos_token_id=[], **kwargs)
    return time.perf_counter() - t, out


def compare(model, prompts: list[torch.Tensor], n: int, arms: dict[str, dict], runs: int) -> None:
    """Plain greedy against each arm, n tokens from every prompt, interleaved; prints tokens/s and acceptance."""
    from tformer.generation import SpeculativeStats

    for ids in prompts[:1]:                                   # warm-up: plans, kernels, the first allocations
        for kwargs in [{}, *arms.values()]:
            timed(model, ids, 16, **kwargs)
    times = {name: [] for name in ["plain", *arms]}
    stats = {name: SpeculativeStats() for name in arms}
    for _ in range(runs):
        run = dict.fromkeys(times, 0.0)
        for ids in prompts:
            seconds, plain = timed(model, ids, n)
            run["plain"] += seconds
            for name, kwargs in arms.items():
                seconds, out = timed(model, ids, n, speculative_stats=stats[name], **kwargs)
                run[name] += seconds
                if not torch.equal(out, plain):
                    first = int((out[0] != plain[0]).nonzero()[0])
                    print(f"  {name}: differs from plain greedy from token {first - ids.size(1)} (a near-tie?)")
        for name in times:
            times[name].append(len(prompts) * n / run[name])
    base = statistics.median(times["plain"])
    for name, tps in times.items():
        line = (f"  {name:28s} {statistics.median(tps):7.1f} tok/s  (runs {min(tps):.1f}-{max(tps):.1f})  "
                f"x{statistics.median(tps) / base:.2f}")
        if name in stats:
            line += f"  acceptance {stats[name].acceptance:.0%} of {stats[name].proposed} drafted"
        print(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="gpt2-small", help="the target's preset (default gpt2-small)")
    p.add_argument("--draft", default="tiny", help="the draft's preset (default tiny: 2 layers of width 64)")
    p.add_argument("--steps", type=int, default=150, help="training steps of each model (default 150)")
    p.add_argument("--threads", type=int, default=None, help="threads while decoding (default: torch's)")
    p.add_argument("--runs", type=int, default=3, help="timed runs per arm (default 3)")
    p.add_argument("--new-tokens", type=int, default=200, help="tokens generated per prompt (default 200)")
    p.add_argument("--out", default="/tmp/tformer-speculative", help="where the two runs are trained / found")
    args = p.parse_args()

    from tformer.checkpoints.format import load_tokenizer
    from tformer.data.files import read_text, split_text

    print(f"CPU: {cpu_name()}")
    target, target_loss = trained("target", args.target, args)
    draft, draft_loss = trained("draft", args.draft, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"decoding on {torch.get_num_threads()} thread(s)")
    for name, model, loss in (("target", target, target_loss), ("draft", draft, draft_loss)):
        print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
              f"validation loss {loss if loss is None else round(loss, 3)} after {args.steps} steps")
    tokenizer = load_tokenizer(Path(args.out) / f"target-{args.target}")
    held_out = split_text(read_text("hamlet"))[1]
    starts = [held_out.index(s) + 1 for s in ("\nHAMLET\n", "\nHORATIO\n")]
    prompts = [torch.tensor([tokenizer.encode(held_out[i:i + 40])]) for i in starts]
    context = target.cfg.max_seq_len

    with torch.no_grad():
        n = min(args.new_tokens, context - 40)
        print(f"draft model, {n} greedy tokens from each of {len(prompts)} held-out prompts of 40 characters:")
        compare(target, prompts, n, {f"draft k={k}": dict(draft_model=draft, num_draft_tokens=k) for k in (2, 4, 6)},
                args.runs)
        passage = held_out[starts[0]:starts[0] + 100]
        text = f"{passage}\n\nAgain, word for word:\n\n{passage[:20]}"
        repeat = [torch.tensor([tokenizer.encode(text)])]
        n = min(args.new_tokens, context - repeat[0].size(1))
        print(f"prompt lookup, {n} greedy tokens after a {len(text)}-character 'repeat the passage' prompt:")
        compare(target, repeat, n, {f"lookup n=3 k={k}": dict(prompt_lookup=3, num_draft_tokens=k) for k in (4, 8)},
                args.runs)


if __name__ == "__main__":
    main()
