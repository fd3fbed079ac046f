"""Speculative decoding in `tformer serve` (--prompt-lookup, --draft-model) against the same server without it.

    python benchmarks/speculative.py --steps 200          # first: trains the model (GPT-2 small's shape) and a draft
    python benchmarks/serve_speculative.py [--model /tmp/tformer-speculative/target-gpt2-small] [--rounds 3]
    python benchmarks/serve_speculative.py --draft-model /tmp/tformer-speculative/draft-tiny

The model is benchmarks/speculative.py's target: GPT-2 small's shape (12 x 768, 85M parameters) trained
on the shipped Hamlet, characters as tokens. Two servers on 127.0.0.1, one plain and one with
`--prompt-lookup 3 --num-draft-tokens 8`, take the same "repeat the passage" requests (a held-out passage
of 100 characters, a line asking for it again, its first 20 characters; 100 greedy tokens each): once one
client at a time and once --clients at once, the two servers alternating, --rounds times. Printed: the
CPU, generated tokens/s of each (median and range over rounds), the ratio, the share of drafted tokens
accepted (the server's metrics), and whether every text is the same from both servers (it must be).
With --draft-model the second server drafts with that model (`--draft-model RUN --num-draft-tokens 4`)
and the requests continue the held-out passages (100 characters each) instead: no text to look up.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import one_request, start_server  # noqa: E402
from speculative import cpu_name  # noqa: E402

LOOKUP = ["--prompt-lookup", "3", "--num-draft-tokens", "8"]


def prompts(n: int, repeat: bool = True) -> list[str]:
    from tformer.data.files import read_text, split_text

    held_out = split_text(read_text("hamlet"))[1]
    starts = [m.start() + 1 for m in re.finditer(r"\n[A-Z]+\n", held_out)][:n]
    if not repeat:
        return [held_out[i:i + 100] for i in starts]
    return [f"{held_out[i:i + 100]}\n\nAgain, word for word:\n\n{held_out[i:i + 20]}" for i in starts]


def metric(base: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{base}/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


def phase(base: str, model: str, texts: list[str], clients: int, max_tokens: int) -> tuple[float, list[str]]:
    """(generated tokens/s, each request's text) of the requests sent by `clients` clients at once."""
    t = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: one_request(base, p, max_tokens, model), texts))
    wall = time.perf_counter() - t
    errors = [r.error for r in results if r.error]
    if errors:
        raise SystemExit(f"{len(errors)} requests failed: {errors[0]}")
    return sum(r.tokens for r in results) / wall, [r.text for r in results]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/tmp/tformer-speculative/target-gpt2-small")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--clients", type=int, default=8, help="clients at once in the concurrent phase (default 8)")
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--draft-model", default=None, help="draft with this model instead of prompt lookup")
    args = p.parse_args()
    drafting = LOOKUP if args.draft_model is None else ["--draft-model", args.draft_model, "--num-draft-tokens", "4"]
    if not Path(args.model).exists():
        raise SystemExit(f"{args.model} does not exist: run benchmarks/speculative.py first (it trains it)")
    print(f"CPU: {cpu_name()}")
    texts = prompts(args.requests, repeat=args.draft_model is None)
    name = Path(args.model).name
    servers = {arm: start_server(Path(args.model), 16, None, extra) for arm, extra in (("plain", []),
                                                                                       ("lookup", drafting))}
    try:
        for _, base in servers.values():                                     # warm-up: plans, first allocations
            phase(base, name, texts[:2], 2, 8)
        rates = {(arm, c): [] for arm in servers for c in (1, args.clients)}
        outputs: dict[str, list[str]] = {}
        for _ in range(args.rounds):
            for clients in (1, args.clients):
                for arm, (_, base) in servers.items():
                    rate, got = phase(base, name, texts, clients, args.max_tokens)
                    rates[arm, clients].append(rate)
                    outputs.setdefault(arm, got)
                    if got != outputs["plain" if "plain" in outputs else arm]:
                        print(f"  {arm}, {clients} clients: texts differ from the plain server's")
        lookup_base = servers["lookup"][1]
        drafted = metric(lookup_base, "tformer_speculative_draft_tokens_total")
        accepted = metric(lookup_base, "tformer_speculative_accepted_tokens_total")
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    print(f"{args.requests} '{'repeat' if args.draft_model is None else 'continue'} the passage' requests, "
          f"{args.max_tokens} greedy tokens each, {args.rounds} rounds; {' '.join(drafting)}")
    for clients in (1, args.clients):
        plain, lookup = rates["plain", clients], rates["lookup", clients]
        ratios = [b / a for a, b in zip(plain, lookup)]
        print(f"  {clients:2d} client(s) at once: plain {statistics.median(plain):6.1f} tok/s "
              f"({min(plain):.1f}-{max(plain):.1f}), drafting {statistics.median(lookup):6.1f} "
              f"({min(lookup):.1f}-{max(lookup):.1f}): x{statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f})")
    print(f"  drafts accepted: {accepted / drafted:.0%} of {drafted:.0f}" if drafted else "  nothing drafted")
    print(f"  every text the same from both servers: {outputs['plain'] == outputs['lookup']}")


if __name__ == "__main__":
    main()
