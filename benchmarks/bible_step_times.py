"""Seconds per training step of the Bible recipe's model against the HF Marian peer of
`bible_marian_peer.py`, in one process on the same batches: tformer eager, tformer compiled (as the
recipe trains) and Marian eager, in interleaved blocks so that a noisy host slows all three alike.

    python benchmarks/bible_step_times.py [--tokenizer-from RUN] [--blocks 6]

Prints each arm's median seconds per step and its blocks.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer-from", default=None, help="a tformer bible run whose tokenizer.json to reuse")
    p.add_argument("--blocks", type=int, default=6, help="timed blocks per arm (default 6)")
    p.add_argument("--block-steps", type=int, default=5, help="steps per block (default 5)")
    a = p.parse_args()

    from transformers import MarianConfig, MarianMTModel

    from tformer.options import pick
    from tformer.tasks.translate import IGNORE, TranslateOptions, TranslateTask
    from tformer.tokenizers import load_tokenizer
    from tformer.train import resolve_options

    values, _ = resolve_options(TranslateTask, {"task": "translate", "data": "bible-en-es", "out": "unused",
                                                "time_budget": 1200, "seed": 0})
    tok = load_tokenizer(a.tokenizer_from) if a.tokenizer_from else None
    task = TranslateTask(pick(TranslateOptions, values), tokenizer=tok)
    m, tok = task.cfg, task.tokenizer
    torch.manual_seed(0)
    tformer_model = task.build_model()
    glu = m.activation in ("swiglu", "geglu")
    d_ff = m.d_ff * 3 // 2 if glu else m.d_ff  # the peer's sizes (bible_marian_peer.py)
    marian = MarianMTModel(MarianConfig(
        vocab_size=tok.vocab_size, d_model=m.d_model, encoder_layers=m.n_layers, decoder_layers=m.decoder_layers,
        encoder_attention_heads=m.n_heads, decoder_attention_heads=m.n_heads, encoder_ffn_dim=d_ff,
        decoder_ffn_dim=d_ff, max_position_embeddings=m.max_seq_len, dropout=m.dropout,
        attention_dropout=m.attention_dropout, activation_function="gelu", pad_token_id=tok.pad_id,
        eos_token_id=tok.eos_id, bos_token_id=tok.bos_id, decoder_start_token_id=tok.bos_id, scale_embedding=True,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True))

    def marian_loss(model, b):
        logits = model(input_ids=b["src_ids"], attention_mask=b["src_mask"], decoder_input_ids=b["tgt_ids"]).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), b["labels"].flatten(), ignore_index=IGNORE,
                               label_smoothing=task.label_smoothing)

    arms = {"tformer eager": (tformer_model, task.loss), "tformer compiled": (tformer_model, torch.compile(task.loss)),
            "hf marian eager": (marian, marian_loss)}
    for name, (model, _) in arms.items():
        print(f"{name}: {sum(p.numel() for p in model.parameters()):,} parameters")
    opts = {name: torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True) for name, (model, _) in arms.items()}

    def step(name: str, b) -> None:
        model, loss_fn = arms[name]
        loss_fn(model, b).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)

    t = time.perf_counter()
    for i in range(8):  # warm-up: compiling, and the shapes' first allocations
        for name in arms:
            step(name, task.batch(i))
    print(f"warm-up: {time.perf_counter() - t:.0f} s")
    times: dict[str, list[float]] = {name: [] for name in arms}
    first = 100
    for _ in range(a.blocks):
        for name in arms:
            t = time.perf_counter()
            for i in range(a.block_steps):
                step(name, task.batch(first + i))
            times[name].append((time.perf_counter() - t) / a.block_steps)
        first += a.block_steps
    for name, ts in times.items():
        print(f"{name}: median {statistics.median(ts):.3f} s a step; blocks {', '.join(f'{x:.2f}' for x in ts)}")


if __name__ == "__main__":
    main()
