"""Decoding and prefill: tformer `generate` vs Hugging Face `generate`, same weights (a randomly
initialised GPT2LMHeadModel converted with tformer.from_hf), greedy, EOS off so every run makes
exactly the requested tokens.

Ceiling (roofline): each step reads every weight once (the token embedding through the tied
output layer; the position table only one row) and does 2 FLOPs per weight per batch row, so
tokens/s <= batch / max(weight bytes / read bandwidth, 2·weights·batch / GEMM peak). At batch 1
bandwidth decides. The read bandwidth is sampled between the timed runs of each case (ReadProbe).
"""

from __future__ import annotations

import statistics
import time

import torch

from ..model.positional import LearnedPositions
from .common import ReadProbe, from_hf_model, hf_gpt2, interleaved_times, sync, weight_bytes

GPT2 = dict(n_layers=12, d_model=768, n_heads=12, vocab=50257, n_positions=1024)
SMALL = dict(n_layers=4, d_model=256, n_heads=4, vocab=2048, n_positions=512)
# So small that the arithmetic is nothing: time per token is the framework's own per-step overhead.
OVERHEAD = dict(n_layers=4, d_model=32, n_heads=4, vocab=64, n_positions=512)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _peers(shape: dict, dtype: torch.dtype, device: str):
    hf = hf_gpt2(**shape)
    hf.generation_config.eos_token_id = None        # never stop early: both make exactly N tokens
    hf.generation_config.pad_token_id = 0
    ours = from_hf_model(hf)
    return ours.to(device, dtype).eval(), hf.to(device, dtype).eval()


def _generators(ours, hf, ids: torch.Tensor, new: int):
    def run_ours(n=new):
        return ours.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=[])

    def run_hf(n=new):
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False)
    return run_ours, run_hf


def bytes_per_token(model: torch.nn.Module, screened: bool = True) -> int:
    """Bytes one decoding step reads: every weight, except the position table (one row is read); an
    output layer that has picked greedy tokens through its bf16 screen (linear.Gemv.argmax) reads
    that instead of its fp32 weight (screened=False: the fp32 weight, as a peer reads it)."""
    tables = [m.weight for m in model.modules() if isinstance(m, LearnedPositions)]
    total = weight_bytes(model) - sum(t.numel() * t.element_size() for t in tables)
    head = getattr(model, "lm_head", None)
    screen = getattr(getattr(head, "plan", None), "screen", None)
    if screened and screen is not None:
        total += screen.numel() * screen.element_size() - head.weight.numel() * head.weight.element_size()
    return total


class StepClock:
    """A generation streamer that notes when each new token arrives; the median gap between
    consecutive tokens is the time of one decoding step (prefill excluded, robust to hiccups).
    Works as tformer's `streamer(tokens)` and as HF's streamer (put / end; HF puts the prompt first)."""

    def __init__(self, device: str):
        self.device, self.gaps, self.last = device, [], None

    def put(self, tokens) -> None:
        sync(self.device)
        now = time.perf_counter()
        if self.last is not None:
            self.gaps.append(now - self.last)
        self.last = now

    __call__ = put

    def end(self) -> None:
        self.last = None                       # the next generate() starts a new series

    def median_ms(self) -> float:
        # HF's first gap of each series is the prefill (it puts the prompt, then the first token):
        # one outlier among `new` gaps, which the median ignores.
        return statistics.median(self.gaps) * 1e3


def _gemm_weights(model) -> list[torch.Tensor]:
    return [m.weight for m in model.modules() if hasattr(m, "in_features")]      # nn.Linear and Int8Linear


def _row(case, unit, ours_rate, peer_rate, **extra) -> dict:
    return {"bench": "decode", "case": case, "unit": unit, "tformer": ours_rate, "peer": peer_rate,
            "peer_name": "HF generate", "ratio": ours_rate / peer_rate, **extra}


def _decode_case(ours, hf, batch, prompt, new, device, repeats, case, ceilings=None, target=None, probe=None):
    """tformer vs HF generate, greedy. With `ceilings` (and a ReadProbe timed between the runs, for
    the bandwidth at the same moment) the row also gives the roofline and both utilisations."""
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, ours.cfg.vocab_size, (batch, prompt), generator=g).to(device)
    run_ours, run_hf = _generators(ours, hf, ids, new)
    run_ours(4), run_hf(4)                                                     # warm-up, short
    out = {}
    runs = {"tformer": lambda: out.update(ours=run_ours()), "hf": lambda: out.update(hf=run_hf())}
    times = interleaved_times({**runs, **({"read": probe} if probe else {})}, device, repeats=repeats, warmup=0)
    read_gbps = probe.gbps(times.pop("read")) if probe else ceilings and ceilings["read_GBps"]
    same = torch.equal(out["ours"], out["hf"])
    rates = {k: batch * new / t for k, t in times.items()}
    extra = {"same_tokens": same, "target": target}
    if ceilings is not None:
        # Roofline: a step reads every weight once (bandwidth) and does 2 FLOPs per weight per row
        # (GEMM peak); it cannot beat the slower of the two. At batch 1 bandwidth decides.
        dtype = "bf16" if ours.lm_head.weight.dtype != torch.float32 else "fp32"
        read_s = bytes_per_token(ours) / (read_gbps * 1e9)
        gemm_s = 2 * sum(p.numel() for p in _gemm_weights(ours)) * batch / (ceilings[f"gemm_{dtype}_GFLOPs"] * 1e9)
        ceiling = batch / max(read_s, gemm_s)
        extra.update(ceiling=ceiling, read_GBps=read_gbps, utilisation=rates["tformer"] / ceiling,
                     peer_utilisation=rates["hf"] / ceiling,
                     utilisation_name=(f"of roofline (BW {read_gbps:.0f} GB/s)" if read_s >= gemm_s
                                       else "of roofline (GEMM)"))
    return _row(case, "tok/s", rates["tformer"], rates["hf"], **extra)


def run(device: str, quick: bool, ceilings: dict) -> list[dict]:
    rows = []
    new, repeats = (16, 1) if quick else (128, 3)
    shape = dict(GPT2, n_layers=2) if quick else GPT2
    name = "GPT-2-small" if not quick else "GPT-2 2-layer"
    probe = ReadProbe(device, 256 if quick else 1024)
    for dname, dtype in DTYPES.items():
        ours, hf = _peers(shape, dtype, device)
        for batch in (1, 8):
            target = (1.0 if batch == 1 else 1.3)
            rows.append(_decode_case(ours, hf, batch, 32, new, device, repeats,
                                     f"{name} b{batch} {dname} p32+{new}", ceilings, target, probe))
        if dname == "bf16":
            rows.append(_int8_case(ours, hf, new, device, repeats, name, ceilings, probe))
        if dname == "fp32":
            rows += _prefill_and_context(ours, hf, device, quick)
        del ours, hf
    n = 50 if quick else 200
    ours, hf = _peers(SMALL, torch.float32, device)
    rows.append(_decode_case(ours, hf, 1, 32, n, device, repeats, f"small 4L/256/V2048 b1 fp32 p32+{n}", ceilings, 2.0,
                             probe))
    ours, hf = _peers(OVERHEAD, torch.float32, device)
    rows.append(_decode_case(ours, hf, 1, 32, n, device, repeats, f"overhead only: 4L/32/V64 b1 p32+{n}"))
    return rows


def _int8_case(ours, hf_bf16, new, device, repeats, name, ceilings, probe) -> dict:
    """tformer with int8 weights (bf16 activations) vs HF with bf16 weights: fewer bytes per token."""
    from ..inference.quant import quantize_int8

    quantize_int8(ours)
    row = _decode_case(ours, hf_bf16, 1, 32, new, device, repeats, f"{name} b1 int8 vs HF bf16 p32+{new}", ceilings,
                       1.5,
                       probe)
    row["peer_name"] = "HF generate bf16"
    return row


def _prefill_and_context(ours, hf, device, quick) -> list[dict]:
    """Time to first token (prefill + one step) for several prompt lengths, and the time per
    decoded token as the context grows (with a KV cache it should stay nearly flat)."""
    rows = []
    lengths = (1, 64) if quick else (1, 256, 1024 - 1)
    g = torch.Generator().manual_seed(0)
    for n in lengths:
        ids = torch.randint(0, ours.cfg.vocab_size, (1, n), generator=g).to(device)
        run_ours, run_hf = _generators(ours, hf, ids, 1)
        times = interleaved_times({"tformer": run_ours, "hf": run_hf}, device, repeats=2 if quick else 3, warmup=1)
        rows.append(_row(f"prefill {n} tok fp32 (time to 1st token)", "ms", times["tformer"] * 1e3,
                         times["hf"] * 1e3, ratio=times["hf"] / times["tformer"]))
    contexts = (16, 64) if quick else (32, 256, 768)
    new = 4 if quick else 16
    first = None
    for n in contexts:
        ids = torch.randint(0, ours.cfg.vocab_size, (1, n), generator=g).to(device)
        ours_clock, hf_clock = StepClock(device), StepClock(device)
        run_ours = lambda: (ours.generate(ids, max_new_tokens=new + 1, eos_token_id=[], streamer=ours_clock),  # noqa: E731
                            ours_clock.end())
        run_hf = lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new + 1,  # noqa: E731
                                     min_new_tokens=new + 1, do_sample=False, streamer=hf_clock)
        interleaved_times({"ours": run_ours, "hf": run_hf}, device, repeats=2 if quick else 3, warmup=0)
        ours_ms, hf_ms = ours_clock.median_ms(), hf_clock.median_ms()
        first = first or ours_ms
        rows.append(_row(f"decode ms/token at context {n} fp32", "ms", ours_ms, hf_ms, ratio=hf_ms / ours_ms,
                         growth=ours_ms / first))
    return rows
