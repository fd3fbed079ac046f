"""`tformer bench`: tformer side by side with the libraries users would otherwise pick (Hugging Face
transformers, sentence-transformers) and with the machine's own limits, measured in one run.

    ceilings  GEMM GFLOP/s (fp32, bf16) and memory read GB/s of this machine, now
    train     training step, nanoGPT character-Shakespeare shape, vs HF GPT2LMHeadModel (MFU)
    encoder   all-MiniLM-L6-v2 sentence embeddings vs sentence-transformers
    decode    greedy decoding (GPT-2-small and a small model), int8 weights, prefill latency,
              time per token vs context length, vs HF generate (share of the bandwidth ceiling)
    engines   GPT-2 decoding and Marian beam search vs CTranslate2, MiniLM embeddings vs ONNX
              Runtime, fp32 and int8 (needs the `bench` extra; missing peers are reported)

Every row is a ratio of medians of interleaved, warmed-up runs on the same weights; ratio > 1
means tformer is faster. Absolute numbers drift with the machine's load; ratios much less.
"""

from __future__ import annotations

import time
from typing import Callable

from .common import machine_info, measure_ceilings

BENCHES = ("train", "encoder", "decode", "engines")


def _module(name: str):
    from . import decode, encoder, engines, training
    return {"train": training, "encoder": encoder, "decode": decode, "engines": engines}[name]


def run(names: tuple[str, ...] = BENCHES, quick: bool = False, device: str = "cpu",
        progress: Callable[[str], None] | None = None, quality_model: str | None = None) -> dict:
    """Run the named benchmarks; returns {"machine", "ceilings", "rows", "notes", "seconds", ...}.
    `quality_model`: a trained language model (run or checkpoint dir) for the int8 perplexity check
    that goes with "decode"; default the newest runs/lm-* under the current directory."""
    say = progress or (lambda msg: None)
    start = time.perf_counter()
    say("ceilings")
    # Load from other processes makes a single reading of a peak low: take the better of two.
    first, second = measure_ceilings(device, quick), measure_ceilings(device, quick)
    ceilings = {k: max(v, second[k]) for k, v in first.items()}
    result = {"machine": machine_info(device), "quick": quick, "ceilings": ceilings, "rows": [], "notes": []}
    for name in names:
        say(name)
        t0 = time.perf_counter()
        rows = _module(name).run(device, quick, ceilings)
        for row in rows:
            row["seconds"] = round(time.perf_counter() - t0, 1)
        result["rows"] += rows
        if name == "decode":
            _int8_quality(result, quality_model, device, quick)
        if name == "engines" and (note := _module(name).missing_note()):
            result["notes"].append(note)
    result["seconds"] = time.perf_counter() - start
    return result


def _int8_quality(result: dict, quality_model: str | None, device: str, quick: bool) -> None:
    from pathlib import Path

    from . import quality

    path = Path(quality_model) if quality_model else quality.newest_lm_run()
    if path is None:
        result["notes"].append("int8 quality: no trained language model found under runs/ (train one with "
                               "`tformer train`, or pass --quality-model DIR); perplexity check skipped")
        return
    result["rows"].append(quality.run(path, device, quick))


def _fmt(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def format_table(result: dict) -> str:
    """Markdown table: one row per case; ratio > 1 means tformer is faster."""
    m, c = result["machine"], result["ceilings"]
    lines = [f"machine: {m['cpu']}, {m['cores']} cores, {m['threads']} torch threads, torch {m['torch']}"
             + (f", transformers {m['transformers']}" if "transformers" in m else "")
             + (f", GPU {m['gpu']}" if "gpu" in m else ""),
             *([f"kernel: {m['kernel']}"] if "kernel" in m else []),
             f"ceilings: GEMM fp32 {_fmt(c['gemm_fp32_GFLOPs'])} GFLOP/s, GEMM bf16 {_fmt(c['gemm_bf16_GFLOPs'])} "
             f"GFLOP/s, memory read {_fmt(c['read_GBps'])} GB/s",
             "",
             "| bench | case | unit | tformer | peer | ratio | target | ceiling | tformer util. | peer util. | check |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        util_name = r.get("utilisation_name", "")
        util = f"{r['utilisation']:.0%} {util_name}" if r.get("utilisation") is not None else "-"
        peer_util = f"{r['peer_utilisation']:.0%}" if r.get("peer_utilisation") is not None else "-"
        check = _check(r)
        target = f">= {r['target']}" if r.get("target") else "-"
        lines.append(f"| {r['bench']} | {r['case']} | {r['unit']} | {_fmt(r['tformer'])} | {_fmt(r['peer'])} "
                     f"({r['peer_name']}) | **{r['ratio']:.2f}x** | {target} | {_fmt(r.get('ceiling'))} | "
                     f"{util} | {peer_util} | {check} |")
    lines.append("")
    lines += [f"note: {n}" for n in result.get("notes", [])]
    lines.append("ratio = tformer speed / peer speed (for times: peer time / tformer time); > 1 = tformer faster. "
                 f"Total {result['seconds']:.0f} s.")
    return "\n".join(lines)


def _check(r: dict) -> str:
    parts = []
    if "min_cosine" in r:
        parts.append(f"min cos {r['min_cosine']:.6f}" + ("" if r.get("ok", True) else " FAILS"))
    if "peer_min_cosine" in r:
        parts.append(f"peer min cos {r['peer_min_cosine']:.6f}")
    if "same_tokens" in r:
        parts.append("same tokens" if r["same_tokens"] else "tokens differ")
    if "same_output" in r:
        parts.append(f"same output as peer {r['same_output']:.0%}")
    if "same_as_hf" in r:
        parts.append("= HF beam search" if r["same_as_hf"] else "differs from HF beam search")
    if "ppl_change" in r:
        parts.append(f"ppl {r['ppl']['fp32']:.3f} -> {r['ppl']['int8']:.3f}, by steps {r['ppl']['int8 by steps']:.3f} "
                     f"({r['ppl_change']:+.2%})"
                     + ("" if r["ok"] else " FAILS <= 1%"))
    if "growth" in r:
        parts.append(f"x{r['growth']:.2f} vs shortest")
    return ", ".join(parts) or "-"


def write_json(result: dict, path: str) -> None:
    from pathlib import Path

    from ..checkpoints.files import write_json_atomic
    write_json_atomic(Path(path), result)


__all__ = ["run", "format_table", "write_json", "BENCHES"]
