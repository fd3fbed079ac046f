"""Seeing inside a model: turn text into model inputs, collect attention maps, and trace one input
through every step (embeddings, Q/K/V, scores, mask, softmax, weighted sum, concat, W_O, FFN, norm,
residual) with shapes and a few numbers.

The trace does not re-implement the model: it runs the model's own forward with PyTorch forward
hooks on every submodule and prints what each module received and returned. The only arithmetic
done here is for display (scores S = QKᵀ/√d_k, which the fused kernels never expose), and it is
checked against the model: softmax(S) must equal the α the model returned, α·V must equal what the
model fed into W_O, and the traced output must equal a plain forward.
"""

from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .errors import ConfigError, DataError
from .viz import AttentionMap


@dataclass
class Inputs:
    """One text (the source for an encoder-decoder) and, for an encoder-decoder, the decoder input."""

    ids: Tensor                       # (1, T)
    tokens: list[str]                 # a display label per id
    target_ids: Tensor | None = None  # (1, T_tgt): decoder start token + target tokens
    target_tokens: list[str] | None = None


def model_kind(model: nn.Module) -> str:
    """"encoder", "classifier", "decoder" or "encoder-decoder"."""
    from .models import Decoder, Encoder, EncoderClassifier, EncoderDecoder

    for cls, kind in ((EncoderClassifier, "classifier"), (EncoderDecoder, "encoder-decoder"),
                      (Decoder, "decoder"), (Encoder, "encoder")):
        if isinstance(model, cls):
            return kind
    raise ConfigError(f"cannot inspect a {type(model).__name__} (expected a tformer model)")


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
    from .tokenizers import check_text

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
    kind, cfg = model_kind(model), model.cfg
    if target is not None and kind != "encoder-decoder":
        raise ConfigError(f"--target is only for encoder-decoder models (this is a {kind})")
    src_tok = source_tokenizer or tokenizer
    ids = _encode(src_tok, text, cfg, "the text")
    inputs = Inputs(torch.tensor([ids]), [token_label(src_tok, i) for i in ids])
    if kind == "encoder-decoder":
        start = next((i for i in (cfg.decoder_start_token_id, cfg.pad_token_id, cfg.bos_token_id) if i is not None),
                     None)
        if start is None:
            raise ConfigError("the model config has no decoder_start_token_id, pad_token_id or bos_token_id "
                              "(set one in config.json)")
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
    if not hasattr(model, "generate"):
        raise ConfigError("this encoder-decoder cannot generate a target yet (pass --target \"...\")")
    eos = model.cfg.eos_token_id if model.cfg.eos_token_id is not None else tokenizer.eos_id
    with torch.no_grad():
        out = model.generate(src, max_new_tokens=min(24, model.cfg.max_seq_len - 1), do_sample=False,
                             eos_token_id=eos)
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
    if isinstance(weights, dict):  # encoder-decoder
        maps = [AttentionMap("encoder self-attention", rows(weights["encoder"]), src, src),
                AttentionMap("decoder self-attention", rows(weights["decoder"]), tgt, tgt, causal=True),
                AttentionMap("cross-attention", rows(weights["cross"]), tgt, src)]
    elif model_kind(model) == "decoder":
        maps = [AttentionMap("self-attention (causal)", rows(weights), src, src, causal=True)]
    else:
        maps = [AttentionMap("self-attention", rows(weights), src, src)]
    return maps + relative_bias_maps(model, inputs)


@torch.no_grad()
def relative_bias_maps(model: nn.Module, inputs: Inputs) -> list[AttentionMap]:
    """T5's relative position bias on its own, softmax(b) per head: which offsets each head favours
    before any content enters. One map (one row) per stack that has a bias table."""
    from .masks import causal_mask
    from .positional import RelativePositionBias

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


# ----------------------------------------------------------------------------- recording calls

@dataclass
class Call:
    start: int      # sequence numbers of entering and leaving the module
    end: int
    args: tuple
    kwargs: dict
    output: object


class Recorder:
    """Forward hooks on every submodule: `calls[module]` = each call's inputs and output, in order."""

    def __init__(self, model: nn.Module):
        self.calls: dict[nn.Module, list[Call]] = {}
        self._clock, self._open, self._handles = 0, {}, []
        for m in model.modules():
            self._handles.append(m.register_forward_pre_hook(self._enter, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._leave, with_kwargs=True))

    def _enter(self, module, args, kwargs):
        self._clock += 1
        self._open.setdefault(module, []).append(self._clock)

    def _leave(self, module, args, kwargs, output):
        self._clock += 1
        start = self._open[module].pop()
        self.calls.setdefault(module, []).append(Call(start, self._clock, args, kwargs, output))

    def within(self, module: nn.Module | None, parent: Call) -> list[Call]:
        """Calls of `module` made while `parent` was running."""
        return [c for c in self.calls.get(module, []) if parent.start < c.start and c.end < parent.end]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


# ----------------------------------------------------------------------------- the trace

def trace(model: nn.Module, inputs: Inputs, tokenizer=None, token: int | None = None, head: int = 0,
          n_numbers: int = 4) -> str:
    """A readable account of `inputs` going through `model`: one line per step with its shape and,
    for the followed `token` (default: the last; the first for a classifier) and `head`, a few numbers."""
    kind, cfg = model_kind(model), model.cfg
    heads = min(cfg.n_heads, cfg.stack_config("decoder").n_heads)    # an encoder-decoder's stacks may differ
    if not 0 <= head < heads:
        raise ConfigError(f"--head {head} is out of range (the model has heads 0..{heads - 1} in every stack)")
    rec = Recorder(model)
    try:
        traced, _ = run(model, inputs, return_attention=True)
    finally:
        rec.remove()
    p = _Printer(model, rec, tokenizer, head, n_numbers)
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


class _Printer:
    WIDTH = 50

    def __init__(self, model, rec: Recorder, tokenizer, head: int, n: int):
        self.model, self.cfg, self.rec, self.tok = model, model.cfg, rec, tokenizer
        self.head, self.n, self.token, self.lines = head, n, 0, []

    @staticmethod
    def pick(token: int | None, length: int, first: bool) -> int:
        if token is None:
            return 0 if first else length - 1
        if not -length <= token < length:
            raise ConfigError(f"--token {token} is out of range (the input has {length} tokens)")
        return token % length

    # --- formatting ------------------------------------------------------------------------
    def line(self, depth: int, what: str, shape: str = "", numbers: str = "") -> None:
        # combining marks (the hat of x̂) take no column: pad by what the terminal shows
        pad = self.WIDTH - 2 * depth + sum(unicodedata.combining(ch) > 0 for ch in what)
        self.lines.append(f"{'  ' * depth}{what:<{pad}} {shape:<26} {numbers}".rstrip())

    @staticmethod
    def shape(t: Tensor, letters: str) -> str:
        names = letters.split()
        assert t.dim() == len(names), (tuple(t.shape), letters)
        return "(" + ", ".join(f"{n}={s}" for n, s in zip(names, t.shape)) + ")"

    def vec(self, v: Tensor, name: str = "") -> str:
        vals = ", ".join(f"{x:.3f}" for x in v[: self.n].tolist())
        return f"{name}[{vals}{', …' if v.numel() > self.n else ''}]"

    def header(self, kind: str, inputs: Inputs) -> None:
        c = self.cfg
        self.lines += [
            f"trace: {type(self.model).__name__} ({kind}), layers={c.n_layers}"
            + (f"+{c.decoder_layers}" if kind == "encoder-decoder" else "")
            + f", D={c.d_model}, H={c.n_heads}, d_k={c.head_dim}, d_ff={c.ffn_dim}, {c.norm_position}-norm "
            f"{c.norm}, {c.positional} positions, {c.activation}",
            "notation: B batch, T tokens" + (", T_src source tokens" if kind == "encoder-decoder" else "")
            + ", D model width, H heads, d_k = D/H head size, d_ff FFN width, V vocabulary",
            "input: " + " ".join(repr(t) for t in inputs.tokens),
        ]
        if inputs.target_tokens is not None:
            self.lines.append("target (decoder input): " + " ".join(repr(t) for t in inputs.target_tokens))
        self.lines.append(f"following one token (i = its position) and head h={self.head}; "
                          f"vectors show their first {self.n} numbers")

    # --- blocks --------------------------------------------------------------------------
    def stack(self, stack, call: Call, title: str, L: str, tokens: list[str], memory_tokens=None) -> None:
        i = self.token
        self.lines.append(f"\n== {title}: following token i={i} {tokens[i]!r}")
        self.embeddings(stack.embed, self.rec.within(stack.embed, call)[0], L)
        for n, layer in enumerate(stack.layers):
            lc = self.rec.within(layer, call)[0]
            self.lines.append(f"-- layer {n} ({type(layer).__name__})")
            for wrapper, sub in ((layer.attn_residual, layer.attn), (getattr(layer, "cross_residual", None),
                                                                      getattr(layer, "cross_attn", None)),
                                 (layer.ffn_residual, layer.ffn)):
                if wrapper is not None:
                    keys = memory_tokens if sub is getattr(layer, "cross_attn", None) else tokens
                    self.residual(wrapper, self.rec.within(wrapper, lc)[0], sub, L, keys)
        for c in self.rec.within(stack.norm, call):
            if not isinstance(stack.norm, nn.Identity):
                self.line(0, f"final norm ({type(stack.norm).__name__}, pre-norm models)",
                          self.shape(c.output, f"B {L} D"), self.vec(c.output[0, i], "x_i="))

    def embeddings(self, embed, c: Call, L: str) -> None:
        i, (token,) = self.token, self.rec.within(embed.token, c)
        scale = f" × √D = × {embed.scale:.2f}" if embed.scale != 1.0 else ""
        self.line(1, f"token embedding E[ids]{scale}", self.shape(token.output, f"B {L} D"),
                  self.vec(token.output[0, i] * embed.scale, "e_i="))
        if embed.position is not None:
            pos = self.rec.within(embed.position, c)[0].output
            letters = f"{L} D" if pos.dim() == 2 else f"B {L} D"
            self.line(1, f"+ position ({self.cfg.positional})", self.shape(pos, letters),
                      self.vec(pos.reshape(-1, pos.size(-1))[i], "p_i="))
        elif self.cfg.positional == "relative":
            self.line(1, "positions: a learned bias per head and distance bucket on every self-attention score")
        else:
            self.line(1, "positions: RoPE rotates Q and K inside every attention")
        if embed.token_type is not None:
            self.line(1, "+ segment (token type) embedding", self.shape(self.rec.within(embed.token_type, c)[0]
                                                                       .output, f"B {L} D"))
        if not isinstance(embed.norm, nn.Identity):
            self.line(1, f"embedding norm ({type(embed.norm).__name__})")
        self.line(1, "X = embeddings (dropout is off in eval)", self.shape(c.output, f"B {L} D"),
                  self.vec(c.output[0, i], "x_i="))

    def residual(self, wrapper, c: Call, sub, L: str, keys: list[str]) -> None:
        from .layers import PreNorm

        i, sub_call = self.token, self.rec.within(sub, c)[0]
        norm = type(wrapper.norm).__name__
        if isinstance(wrapper, PreNorm):
            out = self.rec.within(wrapper.norm, c)[0].output
            self.line(1, f"norm first (pre-norm): x̂ = {norm}(x)", self.shape(out, f"B {L} D"),
                      self.vec(out[0, i], "x̂_i="))
            self.sublayer(sub, sub_call, L, keys)
            self.line(1, "residual: x = x + sublayer(x̂)", self.shape(c.output, f"B {L} D"),
                      self.vec(c.output[0, i], "x_i="))
        else:
            self.sublayer(sub, sub_call, L, keys)
            self.line(1, f"add & norm (post-norm): x = {norm}(x + f(x))", self.shape(c.output, f"B {L} D"),
                      self.vec(c.output[0, i], "x_i="))

    def sublayer(self, sub, c: Call, L: str, keys: list[str]) -> None:
        from .attention import MultiHeadAttention

        if isinstance(sub, MultiHeadAttention):
            self.attention(sub, c, L, keys)
        else:
            self.ffn(sub, c, L)

    def attention(self, mha, c: Call, L: str, keys: list[str]) -> None:
        import inspect

        from .masks import causal_mask

        i, h, rec = self.token, self.head, self.rec
        bound = inspect.signature(mha.forward).bind(*c.args, **c.kwargs).arguments
        K = "T_src" if mha.cross else L
        Hk = "H_kv" if mha.n_kv_heads != mha.n_heads else "H"
        kind = "cross-attention: Q from the decoder, K and V from the encoder" if mha.cross else \
            "self-attention" + (" (causal)" if bound.get("is_causal") else "")
        self.line(1, f"{kind}, H={mha.n_heads} heads of d_k={mha.head_dim}")
        # Q, K, V as the model's own projections produced them (split into heads the way the layer does)
        if mha.cross:
            q = mha._heads(rec.within(mha.q_proj, c)[0].output, mha.n_heads)
            k, v = (mha._heads(t, mha.n_kv_heads) for t in rec.within(mha.kv_proj, c)[0].output.chunk(2, dim=-1))
        else:
            kv_dim = mha.n_kv_heads * mha.head_dim
            q, k, v = rec.within(mha.qkv_proj, c)[0].output.split([mha.n_heads * mha.head_dim, kv_dim, kv_dim], -1)
            q, k, v = mha._heads(q, mha.n_heads), mha._heads(k, mha.n_kv_heads), mha._heads(v, mha.n_kv_heads)
        src = "C" if mha.cross else "X"
        hk = h // (mha.n_heads // mha.n_kv_heads)  # the K/V head that query head h reads
        self.line(2, "Q = X W_Q, split into heads", self.shape(q, f"B H {L} d_k"), self.vec(q[0, h, i], "q_i="))
        # the key and value of token i itself (in cross-attention keys are source tokens: no "own" key)
        own = (lambda t, name: "") if mha.cross else (lambda t, name: self.vec(t[0, hk, i], name))
        self.line(2, f"K = {src} W_K", self.shape(k, f"B {Hk} {K} d_k"), own(k, "k_i="))
        self.line(2, f"V = {src} W_V", self.shape(v, f"B {Hk} {K} d_k"), own(v, "v_i="))
        rotated = rec.within(mha.rotary, c) if mha.rotary is not None else []
        if rotated:
            q, k = rotated[0].output, rotated[1].output
            self.line(2, "RoPE: rotate q and k by their positions", self.shape(q, f"B H {L} d_k"),
                      self.vec(q[0, h, i], "q_i="))
        k, v = (t.repeat_interleave(mha.n_heads // mha.n_kv_heads, dim=1) for t in (k, v))  # (B, H, K, d_k)
        if mha.scale is None:
            scores = q @ k.transpose(-2, -1) / math.sqrt(mha.head_dim)            # (B, H, T_q, T_k)
            formula = f"S = Q Kᵀ / √d_k  (√{mha.head_dim} = {math.sqrt(mha.head_dim):.2f})"
        else:
            scores = q @ k.transpose(-2, -1) * mha.scale
            formula = "S = Q Kᵀ  (unscaled, as in T5)" if mha.scale == 1 else f"S = Q Kᵀ × {mha.scale:g}"
        self.line(2, formula, self.shape(scores, f"B H {L} {K}"), self.vec(scores[0, h, i], "s_i·="))
        bias = bound.get("position_bias")
        if bias is not None:                     # T5: b[bucket(j - i), h], one table per stack
            scores = scores + bias
            self.line(2, "+ relative position bias b(bucket(j − i)), shared by the stack's layers",
                      self.shape(bias, f"1 H {L} {K}"), self.vec(bias[0, h, i], "b_i·="))
        mask = bound.get("mask")
        if bound.get("is_causal"):
            causal = causal_mask(q.size(2), k.size(2), device=q.device)
            mask = causal if mask is None else mask & causal
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
            hidden = [j for j, ok in enumerate(mask.expand_as(scores)[0, h, i].tolist()) if not ok]
            self.line(2, "mask: keys j > i → −∞ (causal)" if bound.get("is_causal") else "mask: padded keys → −∞",
                      self.shape(mask, f"{L} {K}") if mask.dim() == 2 else str(tuple(mask.shape)),
                      f"token i masks {len(hidden)} of {scores.size(-1)} keys"
                      + (f": j = {hidden[0]}..{hidden[-1]}" if hidden else ""))
        else:
            self.line(2, "mask: none (no padding, not causal: every query sees every key)")
        alpha = c.output[1]
        check = torch.nan_to_num(torch.softmax(scores.float(), dim=-1))
        if not torch.allclose(check, alpha.float(), atol=1e-5):
            raise RuntimeError("softmax(QKᵀ/√d_k) differs from the layer's α (a tformer bug)")
        row = ", ".join(f"{keys[j]!r}:{a:.2f}" for j, a in enumerate(alpha[0, h, i].tolist()[:12]))
        self.line(2, "α = softmax(S) over keys (each row sums to 1)", self.shape(alpha, f"B H {L} {K}"),
                  f"α_i· = {row}{' …' if alpha.size(-1) > 12 else ''}")
        o = alpha @ v                                                             # (B, H, T_q, d_k)
        self.line(2, "o = α V (weighted sum of values)", self.shape(o, f"B H {L} d_k"), self.vec(o[0, h, i], "o_i="))
        concat = rec.within(mha.out_proj, c)[0].args[0]
        if not torch.allclose(o.transpose(1, 2).reshape(concat.shape), concat, atol=1e-5):
            raise RuntimeError("α·V differs from what the layer fed into W_O (a tformer bug)")
        self.line(2, "concat heads", self.shape(concat, f"B {L} H·d_k"), self.vec(concat[0, i], "o_i="))
        self.line(2, "output projection: · W_O", self.shape(c.output[0], f"B {L} D"),
                  self.vec(c.output[0][0, i], "y_i="))

    def ffn(self, ffn, c: Call, L: str) -> None:
        i, up, down = self.token, self.rec.within(ffn.up, c)[0], self.rec.within(ffn.down, c)[0]
        act = self.cfg.activation
        self.line(1, f"FFN, per token: {act}(x W_1 + b_1) W_2 + b_2")
        if ffn.gated:
            self.line(2, f"[gate; up] = x W_1 ({act})", self.shape(up.output, f"B {L} 2·d_ff"),
                      self.vec(up.output[0, i], "h_i="))
            gate = "silu" if act == "swiglu" else "gelu"
            self.line(2, f"{gate}(gate) ⊙ up", self.shape(down.args[0], f"B {L} d_ff"), self.vec(down.args[0][0, i], "a_i="))
        else:
            self.line(2, "h = x W_1 + b_1 (up)", self.shape(up.output, f"B {L} d_ff"), self.vec(up.output[0, i], "h_i="))
            self.line(2, f"{act}(h)", self.shape(down.args[0], f"B {L} d_ff"), self.vec(down.args[0][0, i], "a_i="))
        self.line(2, "W_2 (down) back to D", self.shape(down.output, f"B {L} D"), self.vec(down.output[0, i], "f_i="))

    # --- heads ---------------------------------------------------------------------------
    def logits(self, c: Call, tokens: list[str]) -> None:
        i, logits = self.token, c.output
        probs = torch.softmax(logits[0, i].float(), dim=-1)
        top = probs.topk(min(3, probs.numel()))
        names = [token_label(self.tok, j) if self.tok is not None else str(j) for j in top.indices.tolist()]
        best = ", ".join(f"{n!r} {p:.2f}" for n, p in zip(names, top.values.tolist()))
        self.line(0, "logits = x W_vocab (lm_head)", self.shape(logits, "B T V"),
                  f"next token after {tokens[i]!r}: {best}")

    def classify(self, model, c: Call) -> None:
        logits = c.output
        self.line(0, "first token's vector → dropout → linear (head)", self.shape(c.args[0], "B D"),
                  self.vec(c.args[0][0], "x_0="))
        probs = torch.softmax(logits[0].float(), dim=-1).tolist()
        labels = model.labels or [str(j) for j in range(len(probs))]
        self.line(0, "label logits → softmax", self.shape(logits, "B labels"),
                  ", ".join(f"{n}: {p:.2f}" for n, p in zip(labels, probs)))
