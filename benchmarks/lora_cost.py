"""What LoRA costs and saves in training (issue 46): peak memory, seconds a step and adapter size.

GPT-2-small's shape (12 layers, width 768, 12 heads, vocabulary 50,257, context 1,024), random weights: one HF
`GPT2LMHeadModel` (dropout 0) saved with save_pretrained and read by `tformer.from_hf` and by HF, so every arm
starts from the same weights. Batches of 4 x 128 tokens (short, so a step takes seconds on 2 cores), the same for
every arm; fp32 (`--precision bf16`: each forward and loss under bf16 autocast); AdamW (lr 1e-4) over the
parameters that train; loss = the mean cross entropy of each position's label, as each library trains: tformer's
arms `model(x, labels=y)`, the loss `tformer train` computes (model/lm_loss.py: the output layer and cross-entropy
a block of rows at a time, the logits never whole); peft's HF model F.cross_entropy(model(x).logits, y), what HF's
own `labels=` path computes (ForCausalLMLoss: F.cross_entropy on the fp32 logits; here without its shift, as the
labels are already each position's next token). Arms, each in its own process:

    full    tformer, full fine-tuning
    lora    tformer, apply_lora(r=8, alpha=16, targets=("qkv",)): one adapter on the fused [q; k; v]
            matrix, which is what peft's default for gpt2 (target c_attn) adapts
    int8    tformer, the `--lora-int8` path (training/lora.py add_adapters): quantize_base (every linear
            layer int8, quantize_int8, and the token embedding int8, shared with the tied output layer),
            then the same adapters on the frozen int8 base (Int8LoRALinear)
    peft    peft LoRA r=8, alpha 16, target c_attn, fan_in_fan_out=True, on HF's GPT2LMHeadModel

and two model-only baselines (import + build the model, no step): `tformer-base` (from_hf) for the
tformer arms, `hf-base` (from_pretrained) for peft. Each process runs `--warmup` steps, then `--steps`
timed ones (forward + loss + backward + AdamW step + zero_grad), and reports its median step and
`ru_maxrss` (peak RSS). The arms alternate (full, lora, int8, peft, full, ...) over `--repeats` rounds,
so load from other processes hits all alike; figures are medians over rounds (range). Also: the adapter
file (lora_state_dict saved with safetensors, as checkpoints/adapter.py writes adapter_model.safetensors)
against the model's model.safetensors (`tformer.save`), and peft's adapter_model.safetensors.

    .venv/bin/python benchmarks/lora_cost.py [--repeats 3] [--warmup 2] [--steps 8] [--precision bf16]
        [--activation-checkpointing] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYERS, WIDTH, HEADS, VOCAB, CONTEXT = 12, 768, 12, 50257, 1024
BATCH, SEQ = 4, 128
R, ALPHA = 8, 16
ARMS = ("full", "lora", "int8", "peft")
BASELINE = {"full": "tformer-base", "lora": "tformer-base", "int8": "tformer-base", "peft": "hf-base"}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024      # kB on Linux


def status_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process, MB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def settle() -> float:
    """Resident MB once the model is built, after returning freed heap to the system; then the peak is
    reset to it (Linux: `5` into /proc/self/clear_refs), so VmHWM afterwards is the training's peak."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    resident = status_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return resident


# --- worker: one arm in this process --------------------------------------------------------------

def build(arm: str, hf_dir: str, recompute: bool = False):
    """(model, loss_of) for `arm`, with its trainable parameters set: loss_of(model, x, y) is the mean cross
    entropy of labels y (B, T) as each library trains. `recompute`: activation checkpointing of every layer
    (tformer's `--activation-checkpointing`, HF's gradient_checkpointing_enable, both non-reentrant)."""
    import torch
    import torch.nn.functional as F

    if arm in ("peft", "hf-base"):
        from transformers import GPT2LMHeadModel

        model = GPT2LMHeadModel.from_pretrained(hf_dir, dtype=torch.float32)
        if recompute:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if arm == "peft":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0,
                                                     target_modules=["c_attn"], fan_in_fan_out=True))
        return model.train(), lambda m, x, y: F.cross_entropy(
            m(input_ids=x, use_cache=False).logits.float().flatten(0, 1), y.flatten())
    import tformer
    from tformer.model.layers import checkpoint_activations
    from tformer.model.lora import apply_lora

    model = tformer.from_hf(hf_dir)
    if arm == "int8":                   # as tformer.training.lora.add_adapters does for --lora-int8
        from tformer.inference.int8_embedding import quantize_base

        quantize_base(model)
    if arm in ("lora", "int8"):
        apply_lora(model, r=R, alpha=ALPHA, targets=("qkv",))
    checkpoint_activations(model, recompute)
    return model.train(), lambda m, x, y: m(x, labels=y)


def worker(arm: str, work: str, warmup: int, steps: int, precision: str = "fp32", recompute: bool = False) -> dict:
    import torch

    model, loss_of = build(arm, str(Path(work) / "hf"), recompute)
    out = {"arm": arm, "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
           "params": sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())}
    out["load_peak_mb"] = peak_rss_mb()               # ru_maxrss before the reset: loading's peak
    out["built_mb"] = settle()
    if arm.endswith("-base"):
        out["peak_rss_mb"] = out["load_peak_mb"]
        return out
    batches = torch.load(Path(work) / "batches.pt")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    times, losses = [], []
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    out.update(step_s=statistics.median(times[warmup:]), steps_s=times, losses=losses,
               train_peak_mb=status_mb("VmHWM"), peak_rss_mb=max(out["load_peak_mb"], peak_rss_mb()))
    if arm in ("lora", "int8", "peft"):
        out["adapter_bytes"] = adapter_bytes(arm, model, Path(work) / f"adapter-{arm}")
    return out


def adapter_bytes(arm: str, model, where: Path) -> int:
    if arm == "peft":
        model.save_pretrained(str(where))
        return (where / "adapter_model.safetensors").stat().st_size
    from safetensors.torch import save_file

    from tformer.model.lora import lora_state_dict

    where.mkdir(parents=True, exist_ok=True)
    file = where / "adapter_model.safetensors"          # what checkpoints/adapter.py write_adapter writes
    save_file({k: v.contiguous().cpu() for k, v in lora_state_dict(model).items()}, str(file))
    return file.stat().st_size


# --- driver ---------------------------------------------------------------------------------------

def prepare(work: Path) -> int:
    """The HF directory and the batches in `work` (run in a child: the driver keeps a small RSS, which
    the workers would inherit as their ru_maxrss floor); returns the size of tformer's model.safetensors."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import tformer

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, vocab_size=VOCAB,
                                    n_positions=CONTEXT, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    hf.save_pretrained(str(work / "hf"))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
               for _ in range(4)]
    torch.save(batches, work / "batches.pt")
    tformer.save(tformer.from_hf(work / "hf"), work / "tformer")
    return (work / "tformer" / "model.safetensors").stat().st_size


def run_arm(arm: str, work: Path, opts) -> dict:
    cmd = [sys.executable, __file__, "--worker", arm, "--work", str(work),
           "--warmup", str(opts.warmup), "--steps", str(opts.steps), "--precision", opts.precision]
    cmd += ["--activation-checkpointing"] * opts.activation_checkpointing
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{arm} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine() -> dict:
    info = {"cores": os.cpu_count(), "python": sys.version.split()[0]}
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    info["vectors"] = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    versions = subprocess.run([sys.executable, "-c", "import torch, transformers, peft; "
                               "print(torch.__version__, transformers.__version__, peft.__version__)"],
                              capture_output=True, text=True).stdout.split()
    info.update(zip(("torch", "transformers", "peft"), versions))
    return info


def med_range(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: every arm's forward and loss under torch.autocast(bfloat16), as `tformer train "
                        "--precision bf16` and HF's Trainer(bf16=True) run them (default fp32)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="every arm recomputes its layers in the backward (tformer's --activation-checkpointing; "
                        "HF's gradient checkpointing for peft's model), as QLoRA recipes train (peft's "
                        "prepare_model_for_kbit_training turns it on by default)")
    p.add_argument("--json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.worker == "prepare":
        print(json.dumps({"model_bytes": prepare(Path(opts.work))}), flush=True)
        return
    if opts.worker:
        print(json.dumps(worker(opts.worker, opts.work, opts.warmup, opts.steps, opts.precision,
                                opts.activation_checkpointing)), flush=True)
        return
    # The driver imports no torch: a child's ru_maxrss starts at its parent's peak (kept across fork + exec).
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_bytes = run_arm("prepare", work, opts)["model_bytes"]
        print(f"driver peak RSS {peak_rss_mb():.0f} MB", flush=True)
        runs: dict[str, list[dict]] = {}
        for rnd in range(opts.repeats):
            for arm in ("tformer-base", "hf-base", *ARMS):
                r = run_arm(arm, work, opts)
                runs.setdefault(arm, []).append(r)
                print(json.dumps({"round": rnd, **{k: v for k, v in r.items() if k != "steps_s"}}), flush=True)
    base = {b: statistics.median(r["peak_rss_mb"] for r in runs[b]) for b in ("tformer-base", "hf-base")}
    rows = {}
    for arm in ARMS:
        rs = runs[arm]
        rows[arm] = {"step_s": [r["step_s"] for r in rs], "peak_rss_mb": [r["peak_rss_mb"] for r in rs],
                     "over_base_mb": [r["peak_rss_mb"] - base[BASELINE[arm]] for r in rs],
                     "train_peak_mb": [r["train_peak_mb"] for r in rs],
                     "train_over_built_mb": [r["train_peak_mb"] - r["built_mb"] for r in rs],
                     "trainable": rs[0]["trainable"], "adapter_bytes": rs[0].get("adapter_bytes"),
                     "first_loss": rs[0]["losses"][0]}
    med = {arm: {k: statistics.median(v) for k, v in row.items() if isinstance(v, list)} for arm, row in rows.items()}
    full = med["full"]
    ratios = {
        "lora_mem_train": med["lora"]["train_peak_mb"] / full["train_peak_mb"],
        "lora_mem_train_over_built": med["lora"]["train_over_built_mb"] / full["train_over_built_mb"],
        "int8_mem_train": med["int8"]["train_peak_mb"] / full["train_peak_mb"],
        "int8_mem_train_over_built": med["int8"]["train_over_built_mb"] / full["train_over_built_mb"],
        "lora_mem_raw": med["lora"]["peak_rss_mb"] / full["peak_rss_mb"],
        "lora_mem_over_base": med["lora"]["over_base_mb"] / full["over_base_mb"],
        "lora_step": med["lora"]["step_s"] / full["step_s"],
        "adapter_share": rows["lora"]["adapter_bytes"] / model_bytes,
        "int8_mem_raw": med["int8"]["peak_rss_mb"] / full["peak_rss_mb"],
        "int8_mem_over_base": med["int8"]["over_base_mb"] / full["over_base_mb"],
        "peft_over_lora_step": med["peft"]["step_s"] / med["lora"]["step_s"],
    }
    result = {"machine": machine(), "precision": opts.precision,
              "activation_checkpointing": opts.activation_checkpointing,
              "shape": {"layers": LAYERS, "width": WIDTH, "heads": HEADS,
              "vocab": VOCAB, "context": CONTEXT, "batch": BATCH, "seq": SEQ, "r": R, "alpha": ALPHA},
              "repeats": opts.repeats, "warmup": opts.warmup, "steps": opts.steps, "model_bytes": model_bytes,
              "baseline_rss_mb": base, "rows": rows, "ratios": ratios,
              "date": time.strftime("%Y-%m-%d %H:%M")}
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=2))
    print(json.dumps(result["machine"]))
    print(f"\nmodel-only peak RSS: tformer {base['tformer-base']:.0f} MB, HF {base['hf-base']:.0f} MB; "
          f"tformer model.safetensors {model_bytes / 1e6:.1f} MB\n")
    print("| arm | s / step | peak RSS MB (ru_maxrss) | minus model-only process | peak while training MB "
          "| training's own (peak - resident before step 1) | trainable | adapter file | first loss |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    names = {"full": "tformer full fine-tuning", "lora": "tformer LoRA r=8 (qkv)",
             "int8": "tformer LoRA r=8 (qkv), int8 base", "peft": "peft LoRA r=8 (c_attn), HF model"}
    for arm, row in rows.items():
        size = "" if row["adapter_bytes"] is None else f"{row['adapter_bytes'] / 1e6:.2f} MB"
        print(f"| {names[arm]} | {med_range(row['step_s'], '.2f')} | {med_range(row['peak_rss_mb'], '.0f')} "
              f"| {med_range(row['over_base_mb'], '.0f')} | {med_range(row['train_peak_mb'], '.0f')} "
              f"| {med_range(row['train_over_built_mb'], '.0f')} | {row['trainable']:,} | {size} "
              f"| {row['first_loss']:.4f} |")
    r = ratios
    # The targets are on the peak while training (the model built, then steps). The process's whole peak
    # (ru_maxrss) also holds the model's loading: from_hf's peak, the same for every tformer arm, can be the
    # larger of the two, and then "raw" and "over the model" say nothing about training.
    print(f"\nLoRA / full: peak while training {r['lora_mem_train']:.2f} (target <= 0.50; training's own "
          f"{r['lora_mem_train_over_built']:.2f}; whole process {r['lora_mem_raw']:.2f}); "
          f"step {r['lora_step']:.2f}x (target <= 0.8)")
    print(f"int8 LoRA / full: peak while training {r['int8_mem_train']:.2f} (target <= 0.35; training's own "
          f"{r['int8_mem_train_over_built']:.2f}; whole process {r['int8_mem_raw']:.2f})")
    print(f"adapter / model.safetensors: {100 * r['adapter_share']:.2f}% (target <= 2%)")
    print(f"peft step / tformer LoRA step: {r['peft_over_lora_step']:.2f}x (target >= 1.2)")


if __name__ == "__main__":
    main()
