"""The peer for the Bible en->es run: a Hugging Face MarianMTModel of the same size, trained for the
same time on the same batches (the tformer run's tokenizer, TranslateTask's length-grouped batches of
the same seed, the recipe's learning rate, warm-up + cosine schedule, batch, dropout, AdamW, label
smoothing, and its moving average of the weights, which is what is scored, as tformer scores best/;
bf16 autocast only where the CPU computes bf16 natively, as `--precision auto`), then scored with the
same beam search on the same held-out chapters.

Marian's own block is the 2017 one (post-norm, sinusoidal positions, GELU feed-forward, token
embeddings scaled by sqrt(d_model) as in the paper and in every opus-mt checkpoint; MarianConfig's
default leaves them unscaled, `--no-scale-embedding`, and then the 0.02-std vectors are lost under
the sinusoids); it takes the recipe's layers, width, heads and feed-forward size (a SwiGLU's hidden
size is scaled by 3/2 so the parameter counts match).

    python benchmarks/bible_marian_peer.py --time-budget 1200 --limit 500 > marian.json

Prints one JSON line: steps, val_loss (of the scored weights), val_loss_live (the last step's
weights), bleu, chrf, exact_match. `--max-steps N` trains N steps instead (the cosine then follows
the steps), for comparisons at equal steps.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F


def marian_peer(task, scale_embedding: bool = True):
    """A MarianMTModel with the shape of `task`'s model (a TranslateTask), on its tokenizer."""
    from transformers import MarianConfig, MarianMTModel

    tok, m = task.tokenizer, task.cfg
    glu = m.activation in ("swiglu", "geglu")
    d_ff = m.d_ff * 3 // 2 if glu else m.d_ff        # a GLU feed-forward has three matrices, GELU's two
    return MarianMTModel(MarianConfig(
        vocab_size=tok.vocab_size, d_model=m.d_model, encoder_layers=m.n_layers, decoder_layers=m.decoder_layers,
        encoder_attention_heads=m.n_heads, decoder_attention_heads=m.n_heads, encoder_ffn_dim=d_ff,
        decoder_ffn_dim=d_ff, max_position_embeddings=m.max_seq_len, dropout=m.dropout,
        attention_dropout=m.attention_dropout, activation_function="gelu", pad_token_id=tok.pad_id,
        eos_token_id=tok.eos_id, bos_token_id=tok.bos_id, decoder_start_token_id=tok.bos_id, forced_eos_token_id=None,
        scale_embedding=scale_embedding, share_encoder_decoder_embeddings=True, tie_word_embeddings=True))


def marian_loss(model, batch, label_smoothing: float):
    """The task's loss (TranslateTask.loss) for the Marian peer: label-smoothed cross-entropy per token."""
    from tformer.evaluation.translate import IGNORE

    logits = model(input_ids=batch["src_ids"], attention_mask=batch["src_mask"],
                   decoder_input_ids=batch["tgt_ids"]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=IGNORE,
                           label_smoothing=label_smoothing)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer-from", default=None, help="a tformer bible run whose tokenizer.json to reuse "
                   "(default: train the same BPE the tformer run trains, from the same texts)")
    p.add_argument("--time-budget", type=float, default=1200.0)
    p.add_argument("--num-beams", type=int, default=4)
    p.add_argument("--limit", type=int, default=500, help="held-out verses translated for BLEU/chrF")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the tformer recipe's)")
    p.add_argument("--max-steps", type=int, default=None, help="train this many steps, not --time-budget seconds")
    p.add_argument("--scale-embedding", action=argparse.BooleanOptionalAction, default=True,
                   help="multiply token embeddings by sqrt(d_model), as the 2017 paper and opus-mt (default: on)")
    a = p.parse_args()

    from tformer.checkpoints.format import load_tokenizer
    from tformer.devices import native_bf16
    from tformer.evaluation import metrics
    from tformer.evaluation.translate import teacher_forced_loss
    from tformer.tasks.translate import TranslateOptions, TranslateTask
    from tformer.training.config import TrainConfig, resolve_options
    from tformer.training.ema import EMA
    from tformer.training.optim import lr_at, param_groups, progress_of
    from tformer.training.options import pick

    # What `tformer train --task translate --data bible-en-es --time-budget T --seed S` would use.
    values, _ = resolve_options(TranslateTask, {"task": "translate", "data": "bible-en-es", "out": "unused",
                                                "time_budget": a.time_budget, "seed": a.seed})
    torch.manual_seed(a.seed)
    tok = load_tokenizer(a.tokenizer_from) if a.tokenizer_from else None
    task = TranslateTask(pick(TranslateOptions, values), tokenizer=tok)
    tok = task.tokenizer
    model = marian_peer(task, a.scale_embedding)
    tc = pick(TrainConfig, values)
    if a.lr is not None:
        tc.lr = a.lr
    if a.max_steps is not None:
        tc.max_steps, tc.time_budget = a.max_steps, None
    bf16 = tc.precision == "bf16" or (tc.precision == "auto" and native_bf16(torch.device("cpu")))
    groups = param_groups(model, tc.weight_decay)
    opt = torch.optim.AdamW([{k: v for k, v in g.items() if k != "names"} for g in groups],
                            lr=tc.lr, betas=(tc.beta1, tc.beta2))
    ema = EMA(model, tc.ema) if tc.ema else None
    start, step, warm = time.perf_counter(), 0, None
    model.train()
    while (elapsed := time.perf_counter() - start) < (tc.time_budget or math.inf) and step < (tc.max_steps or math.inf):
        for g in opt.param_groups:
            g["lr"] = lr_at(tc, step, progress_of(tc, step, elapsed, warm))
        torch.manual_seed(a.seed * 1_000_003 + step)
        b = task.batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = marian_loss(model, b, task.label_smoothing)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update(step)
        step += 1
        if warm is None and step >= tc.warmup:
            warm = time.perf_counter() - start
    model.eval()

    class Wrapped(torch.nn.Module):  # teacher_forced_loss calls model(src, tgt, src_mask)
        def __init__(self, hf):
            super().__init__()
            self.hf = hf

        def forward(self, src, tgt, src_mask=None):
            return self.hf(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt).logits

    sources, targets = task.val
    val_loss_live = teacher_forced_loss(Wrapped(model), tok, sources, targets, task.max_len)
    val_loss = val_loss_live
    if ema is not None:  # from here on the average is scored, as tformer eval scores best/
        unknown = model.load_state_dict(ema.tensors(), strict=False).unexpected_keys
        if unknown:
            raise SystemExit(f"error: the weight average names parameters the model lacks: {unknown[:3]}")
        val_loss = teacher_forced_loss(Wrapped(model), tok, sources, targets, task.max_len)
    hyps = []
    with torch.no_grad():
        for i in range(0, min(a.limit, len(sources)), 64):
            chunk = sources[i:min(i + 64, a.limit)]
            src = [ids[:task.max_len - 1] + [tok.eos_id] for ids in tok.encode_batch(chunk)]
            width = max(map(len, src))
            ids = torch.tensor([s + [tok.pad_id] * (width - len(s)) for s in src])
            mask = (torch.arange(width)[None] < torch.tensor([len(s) for s in src])[:, None]).long()
            out = model.generate(input_ids=ids, attention_mask=mask, num_beams=a.num_beams, do_sample=False,
                                 max_new_tokens=min(task.max_len - 1, 2 * width + 10))
            for row in out[:, 1:].tolist():
                row = row[:row.index(tok.eos_id)] if tok.eos_id in row else row
                hyps.append(tok.decode(row).strip())
    refs = targets[:len(hyps)]
    print(json.dumps({"model": "hf-marian", "steps": step, "num_beams": a.num_beams, "bf16": bf16,
                      "train_seconds": round(time.perf_counter() - start),
                      "val_loss": val_loss, "val_loss_live": val_loss_live, "ema": tc.ema,
                      "scale_embedding": a.scale_embedding, "perplexity": math.exp(min(val_loss, 50)),
                      "bleu": metrics.bleu(hyps, refs), "chrf": metrics.chrf(hyps, refs),
                      "exact_match": metrics.exact_match(hyps, refs), "examples": list(zip(sources[:3], hyps[:3]))}))


if __name__ == "__main__":
    main()
