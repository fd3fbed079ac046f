"""Training throughput of the default preset (`small`: 4 layers, width 256, 4 heads, context 128,
char vocabulary of Hamlet) against Hugging Face GPT2LMHeadModel of the same shape, in one run.

Each peer does full optimizer steps (forward, loss, backward, clip, AdamW, zero_grad) on the same
batch of 32 x 128 tokens, timed interleaved (a, b, a, b, ...) so load from other processes hits both
alike; fp32 and bf16 autocast. Also: tformer's own trainer (`tformer.training.loop.fit`, data sampling and
bookkeeping included) for a few steps, and the machine's GEMM ceiling measured in the same run.

    .venv/bin/python benchmarks/bench_train_default.py [--repeats 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
import torch.nn.functional as F

import tformer
from tformer.bench.common import interleaved_times, machine_info, measure_ceilings
from tformer.training.config import TrainConfig
from tformer.training.loop import fit

VOCAB, BATCH, CONTEXT = 70, 32, 128


def hf_same_shape(cfg: tformer.ModelConfig):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=cfg.n_layers, n_embd=cfg.d_model, n_head=cfg.n_heads,
                                      n_inner=cfg.ffn_dim, vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      activation_function="gelu", attn_implementation="sdpa"))


def step_fn(model, logits_of, x, y, precision: str, device: str):
    """One optimizer step as the trainer does it."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99))
    model.train()

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = F.cross_entropy(logits_of(model, x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def trainer_tokens_per_s(precision: str, device: str, steps: int) -> float:
    """tokens/s that `tformer train` itself reports (last log window; warm-up steps excluded)."""
    from tformer.cli import build_parser
    from tformer.cli.train import prepare

    with tempfile.TemporaryDirectory() as out:
        args = build_parser().parse_args(["train", "--max-steps", str(steps), "--log-every", str(steps // 2),
                                          "--eval-every", str(10 * steps), "--precision", precision,
                                          "--dropout", "0", "--device", device, "--no-progress", "--out", out])
        task, cfg, _, saved = prepare(args)
        records = fit(task, TrainConfig(**{**cfg.to_dict(), "save_every": 10 * steps}), args=saved).records
    return [r for r in records if "tokens_per_s" in r][-1]["tokens_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--trainer-steps", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    opts = p.parse_args()
    device = opts.device
    cfg = tformer.preset("small", vocab_size=VOCAB, dropout=0.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=g).to(device)
    y = torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=g).to(device)
    torch.manual_seed(0)
    ours = tformer.Decoder(cfg).to(device)
    hf = hf_same_shape(cfg).to(device)
    n_ours = sum(p.numel() for p in ours.parameters())
    n_hf = sum(p.numel() for p in hf.parameters())
    result = {"machine": machine_info(device), "ceilings": measure_ceilings(device, quick=True),
              "shape": {"preset": "small", "layers": cfg.n_layers, "d_model": cfg.d_model, "heads": cfg.n_heads,
                        "context": CONTEXT, "batch": BATCH, "vocab": VOCAB, "params_tformer": n_ours,
                        "params_hf": n_hf}, "rows": []}
    tokens = BATCH * CONTEXT
    for precision in ("fp32", "bf16"):
        times = interleaved_times({
            "tformer": step_fn(ours, lambda m, x: m(x), x, y, precision, device),
            "hf": step_fn(hf, lambda m, x: m(input_ids=x).logits, x, y, precision, device),
        }, device, repeats=opts.repeats, warmup=2)
        row = {"precision": precision, "tformer_tok_s": tokens / times["tformer"], "hf_tok_s": tokens / times["hf"],
               "speedup": times["hf"] / times["tformer"]}
        row["trainer_tok_s"] = trainer_tokens_per_s(precision, device, opts.trainer_steps)
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps(result, indent=2))
    print("\n| precision | tformer step tok/s | HF GPT2LMHeadModel tok/s | tformer / HF | `tformer train` tok/s |")
    print("| --- | --- | --- | --- | --- |")
    for r in result["rows"]:
        print(f"| {r['precision']} | {r['tformer_tok_s']:,.0f} | {r['hf_tok_s']:,.0f} | {r['speedup']:.2f}x "
              f"| {r['trainer_tok_s']:,.0f} |")


if __name__ == "__main__":
    main()
