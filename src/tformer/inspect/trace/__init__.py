"""Seeing inside a model: turn text into model inputs, collect attention maps, and trace one input
through every step (embeddings, Q/K/V, scores, mask, softmax, weighted sum, concat, W_O, FFN, norm,
residual) with shapes and a few numbers.

The trace does not re-implement the model: it runs the model's own forward with PyTorch forward
hooks on every submodule and prints what each module received and returned. The only arithmetic
done here is for display (scores S = QKᵀ/√d_k, which the fused kernels never expose), and it is
checked against the model: softmax(S) must equal the α the model returned, α·V must equal what the
model fed into W_O, and the traced output must equal a plain forward.

    inputs.py    text -> model inputs, the plain forward, attention maps
    recorder.py  forward hooks: every submodule's inputs and output, in order
    printer.py   one line per step, with shapes and a few numbers
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import ConfigError
from .inputs import Inputs, attention_maps, inspected_kind, prepare, run, token_label
from .printer import Printer
from .recorder import Call, Recorder


def trace(model: nn.Module, inputs: Inputs, tokenizer=None, token: int | None = None, head: int = 0,
          n_numbers: int = 4) -> str:
    """A readable account of `inputs` going through `model`: one line per step with its shape and,
    for the followed `token` (default: the last; the first for a classifier) and `head`, a few numbers."""
    kind, cfg = inspected_kind(model), model.cfg
    heads = min(cfg.n_heads, cfg.stack_config("decoder").n_heads)    # an encoder-decoder's stacks may differ
    if not 0 <= head < heads:
        raise ConfigError(f"--head {head} is out of range (the model has heads 0..{heads - 1} in every stack)")
    rec = Recorder(model)
    try:
        traced, _ = run(model, inputs, return_attention=True)
    finally:
        rec.remove()
    p = Printer(model, rec, tokenizer, head, n_numbers)
    src_len = inputs.ids.size(1)
    p.token = p.pick(token, src_len, kind == "classifier")
    p.header(kind, inputs)
    call = rec.calls[model][0]
    if kind == "encoder-decoder":
        p.stack(model.encoder, rec.within(model.encoder, call)[0], "encoder (source, T_src tokens)", "T_src",
                inputs.tokens)
        p.token = p.pick(token, inputs.target_ids.size(1), False)
        p.stack(model.decoder, rec.within(model.decoder, call)[0], "decoder (target, T tokens)", "T",
                inputs.target_tokens, memory_tokens=inputs.tokens)
        p.logits(rec.within(model.lm_head, call)[0], inputs.target_tokens)
    elif kind == "decoder":
        p.stack(model.stack, rec.within(model.stack, call)[0], "decoder", "T", inputs.tokens)
        p.logits(rec.within(model.lm_head, call)[0], inputs.tokens)
    elif kind == "classifier":
        p.stack(model.encoder, rec.within(model.encoder, call)[0], "encoder", "T", inputs.tokens)
        p.classify(model, rec.within(model.head, call)[0])
    else:
        p.stack(model, call, "encoder", "T", inputs.tokens)
        p.line(0, "output: contextual vectors", p.shape(traced, "B T D"), p.vec(traced[0, p.token]))
    plain = run(model, inputs)  # the normal (fused) path, without weights
    diff = (traced.float() - plain.float()).abs().max().item()
    if not torch.allclose(traced.float(), plain.float(), atol=1e-4, rtol=1e-4):
        raise RuntimeError(f"traced output differs from the model's forward by {diff:.3g} (a tformer bug)")
    p.lines.append(f"check: traced output = model forward without weights (max |Δ| = {diff:.1e})")
    return "\n".join(p.lines)


__all__ = ["Inputs", "prepare", "run", "attention_maps", "token_label", "trace", "Recorder", "Call", "Printer"]
