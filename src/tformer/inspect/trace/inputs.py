"""Text -> model inputs for inspection (the tokens as the model saw them in training), the model's
forward on them, and its attention maps."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ...errors import ConfigError, DataError
from ...model.masks import causal_mask
from ...model.positional import RelativePositionBias
from ..viz import AttentionMap


@dataclass
class Inputs:
    """One text (the source for an encoder-decoder) and, for an encoder-decoder, the decoder input."""

    ids: Tensor                       # (1, T)
    tokens: list[str]                 # a display label per id
    target_ids: Tensor | None = None  # (1, T_tgt): decoder start token + target tokens
    target_tokens: list[str] | None = None


def inspected_kind(model: nn.Module) -> str:
    """model.kind ("encoder", "classifier", "decoder" or "encoder-decoder"), or why it cannot be traced."""
    kind = getattr(model, "kind", None)
    if kind is None:
        raise ConfigError(f"cannot inspect a {type(model).__name__} (expected a tformer model)")
    return kind


def token_label(tokenizer, i: int) -> str:
    """What token id `i` looks like: its decoded text, with blanks made visible; special tokens
    (which decode to nothing) by their name."""
    text = tokenizer.decode([i], skip_special_tokens=False)
    if not text and hasattr(tokenizer, "hf"):
        text = tokenizer.hf.id_to_token(i) or ""
    if not text:
        return f"<{i}>"
    if not text.strip():
        return text.replace(" ", "␣").replace("\n", "⏎").replace("\t", "⇥")
    return text.strip().replace("\n", "⏎")


def _encode(tokenizer, text: str, cfg, what: str) -> list[int]:
    """Token ids as the model saw them in training. HF tokenizers with a post-processor (BERT's
    [CLS] ... [SEP]) add their special tokens; tformer's own char/BPE tokenizers have none. Padding
    and truncation that a tokenizer.json may switch on are undone / reported, not applied silently."""
    from ...data.tokenizers import check_text

    check_text(text)  # bytes that are not UTF-8 (from argv or stdin): a clear error, not a TypeError
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        ids = tokenizer.encode(text)
    else:
        if hf.padding or hf.truncation:  # a copy without them: the caller's tokenizer stays as it was
            from tokenizers import Tokenizer as HFTokenizer

            hf = HFTokenizer.from_str(hf.to_str())
            hf.no_padding()
            hf.no_truncation()
        ids = hf.encode(text, add_special_tokens=True).ids
    if not ids:
        raise DataError(f"{what} is empty after tokenization (give some text)")
    if len(ids) > cfg.max_seq_len:
        raise DataError(f"{what} is {len(ids)} tokens but the model's context is {cfg.max_seq_len} tokens "
                        "(shorten the text)")
    return ids


def prepare(model: nn.Module, tokenizer, text: str, target: str | None = None, source_tokenizer=None) -> Inputs:
    """Tokenize `text` (and `target`, the decoder side of an encoder-decoder) for `model`.
    An encoder-decoder without a target decodes greedily from the source to get one.
    `source_tokenizer` reads `text` when the source has its own vocabulary (src_vocab_size)."""
    kind, cfg = inspected_kind(model), model.cfg
    if target is not None and kind != "encoder-decoder":
        raise ConfigError(f"--target is only for encoder-decoder models (this is a {kind})")
    src_tok = source_tokenizer or tokenizer
    ids = _encode(src_tok, text, cfg, "the text")
    inputs = Inputs(torch.tensor([ids]), [token_label(src_tok, i) for i in ids])
    if kind == "encoder-decoder":
        start = cfg.decoder_start()
        if target is not None:
            tgt = [start] + _encode(tokenizer, target, cfg, "the target")
        else:
            tgt = _greedy_target(model, inputs.ids, start, tokenizer)
        if len(tgt) > cfg.max_seq_len:
            raise DataError(f"the target is {len(tgt)} tokens with the start token but the model's context "
                            f"is {cfg.max_seq_len} tokens (shorten the target)")
        inputs.target_ids = torch.tensor([tgt])
        inputs.target_tokens = [token_label(tokenizer, i) for i in tgt]
    return inputs


def _greedy_target(model, src: Tensor, start: int, tokenizer) -> list[int]:
    from ...generation import eos_ids, generate

    out = generate(model, src, max_new_tokens=min(24, model.cfg.max_seq_len - 1), do_sample=False,
                   eos_token_id=eos_ids(model, tokenizer=tokenizer))
    return [start] + out[0, 1:].tolist()


@torch.no_grad()
def run(model: nn.Module, inputs: Inputs, return_attention: bool = False):
    """The model's forward on `inputs` (in eval mode: no dropout), on the model's device."""
    model.eval()
    device = next(model.parameters()).device
    if inputs.target_ids is not None:
        return model(inputs.ids.to(device), inputs.target_ids.to(device), return_attention=return_attention)
    return model(inputs.ids.to(device), return_attention=return_attention)


def attention_maps(model: nn.Module, inputs: Inputs) -> list[AttentionMap]:
    """Every kind of attention of `model` on `inputs`, batch row 0, as AttentionMaps."""
    _, weights = run(model, inputs, return_attention=True)

    def rows(per_layer):  # list of (1, H, Tq, Tk) -> list of (H, Tq, Tk) nested lists
        return [w[0].float().tolist() for w in per_layer]

    src, tgt = inputs.tokens, inputs.target_tokens
    kind = inspected_kind(model)
    if kind == "encoder-decoder":
        maps = [AttentionMap("encoder self-attention", rows(weights["encoder"]), src, src),
                AttentionMap("decoder self-attention", rows(weights["decoder"]), tgt, tgt, causal=True),
                AttentionMap("cross-attention", rows(weights["cross"]), tgt, src)]
    elif kind == "decoder":
        maps = [AttentionMap("self-attention (causal)", rows(weights), src, src, causal=True)]
    else:
        maps = [AttentionMap("self-attention", rows(weights), src, src)]
    return maps + relative_bias_maps(model, inputs)


@torch.no_grad()
def relative_bias_maps(model: nn.Module, inputs: Inputs) -> list[AttentionMap]:
    """T5's relative position bias on its own, softmax(b) per head: which offsets each head favours
    before any content enters. One map (one row) per stack that has a bias table."""
    out = []
    for module in model.modules():
        if not isinstance(module, RelativePositionBias):
            continue
        causal = not module.bidirectional
        tokens = inputs.target_tokens if causal and inputs.target_tokens is not None else inputs.tokens
        b = module(len(tokens), len(tokens))                                     # (1, H, T, T)
        if causal:
            b = b.masked_fill(~causal_mask(len(tokens), device=b.device), float("-inf"))
        out.append(AttentionMap(f"{'decoder' if causal else 'encoder'} relative position bias, softmax(b) alone",
                                [b[0].softmax(-1).float().tolist()], tokens, tokens, causal=causal))
    return out
