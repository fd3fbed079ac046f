"""Time to first token with and without the prefix cache of `tformer serve` (a benchmark, not a test).

    .venv/bin/python benchmarks/serve_prefix.py                 # 16 requests sharing a 1,000-token prefix, 2 rounds

Two servers of serve_load.py's model (a random GPT-2-small-shaped decoder, fp32, word-level tokens)
run side by side: `--prefix-cache-mb 0` and the default cache. Each round makes a new 1,000-token
prefix (random words: no earlier round helps) and 16 prompts = the prefix + 16 tokens of their own,
8 new tokens each (greedy). Each server answers them one at a time, then all 16 at once; the servers
take turns (a, b, a, b). Printed per server and mode: the first request's time to first token and
the median of the 15 later ones (at once: the median of all 16), and the ratio without / with the
cache; the two servers' texts are compared (the same greedy tokens).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from serve_load import build, one_request, start_server


def ask(base: str, prompts: list[str], at_once: bool, max_tokens: int) -> tuple[list[float], list]:
    """Time to first token of each prompt (seconds), and the results."""
    if at_once:
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: one_request(base, p, max_tokens), prompts))
    else:
        results = [one_request(base, p, max_tokens) for p in prompts]
    for r in results:
        if r.error:
            raise SystemExit(f"a request failed: {r.error}")
    return [r.times[0] - r.start for r in results], results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=1000, help="shared prefix, tokens")
    ap.add_argument("--tail", type=int, default=16, help="each prompt's own tokens after the prefix")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    words = lambda n: " ".join(f"w{rng.randrange(3, 50257)}" for _ in range(n))     # noqa: E731
    servers = {"no prefix cache": ["--prefix-cache-mb", "0"], "prefix cache": []}
    ttft = {(name, mode): [] for name in servers for mode in ("one at a time", "16 at once")}
    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp))
        running = {name: start_server(path, 16, None, extra) for name, extra in servers.items()}
        try:
            for name, (_, base) in running.items():
                one_request(base, words(64), 4)                                      # warm-up
            for _ in range(args.rounds):
                for mode in ("one at a time", "16 at once"):
                    prefix = words(args.prefix)
                    prompts = [f"{prefix} {words(args.tail)}" for _ in range(args.requests)]
                    texts = {}
                    for name, (_, base) in running.items():
                        times, results = ask(base, prompts, mode == "16 at once", args.max_tokens)
                        ttft[name, mode].append(times)
                        texts[name] = [r.text for r in results]
                        print(f"  {name:16s} {mode:14s} first {times[0]:6.2f} s, later ones median "
                              f"{statistics.median(times[1:]):6.2f} s", flush=True)
                    if len(set(map(tuple, texts.values()))) != 1:
                        raise SystemExit("the servers with and without the prefix cache answered differently")
        finally:
            for proc, _ in running.values():
                proc.terminate()
                proc.wait(120)
    print(f"\n{args.requests} requests sharing a {args.prefix}-token prefix (+ {args.tail} own tokens), "
          f"{args.max_tokens} new tokens; medians over {args.rounds} rounds")
    for mode in ("one at a time", "16 at once"):
        later = {name: statistics.median(t for times in ttft[name, mode]
                                         for t in (times[1:] if mode == "one at a time" else times))
                 for name in servers}
        first = {name: statistics.median(times[0] for times in ttft[name, mode]) for name in servers}
        what = "median of the later ones" if mode == "one at a time" else "median of all 16"
        print(f"{mode}: first request {first['no prefix cache']:.2f} s vs {first['prefix cache']:.2f} s; "
              f"TTFT ({what}): {later['no prefix cache']:.3f} s without the cache, {later['prefix cache']:.3f} s "
              f"with it: {later['no prefix cache'] / later['prefix cache']:.1f}x lower")


if __name__ == "__main__":
    main()
