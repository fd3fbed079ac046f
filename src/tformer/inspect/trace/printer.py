"""The trace's printer: one line per step of the forward (what it computes, its shape, a few numbers
of the followed token and head), read from the recorded calls. The only arithmetic here is for
display (S = QKᵀ/√d_k, α·V), checked against what the model computed."""

from __future__ import annotations

import inspect
import math
import unicodedata

import torch
from torch import Tensor, nn

from ...errors import ConfigError
from ...model.attention import MultiHeadAttention
from ...model.layers import PreNorm
from ...model.masks import with_causal
from .inputs import Inputs, token_label
from .recorder import Call, Recorder


class Printer:
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
        if isinstance(sub, MultiHeadAttention):
            self.attention(sub, c, L, keys)
        else:
            self.ffn(sub, c, L)

    def attention(self, mha, c: Call, L: str, keys: list[str]) -> None:
        i, h, rec = self.token, self.head, self.rec
        bound = inspect.signature(mha.forward).bind(*c.args, **c.kwargs).arguments
        K = "T_src" if mha.cross else L
        Hk = "H_kv" if mha.n_kv_heads != mha.n_heads else "H"
        kind = "cross-attention: Q from the decoder, K and V from the encoder" if mha.cross else \
            "self-attention" + (" (causal)" if bound.get("is_causal") else "")
        self.line(1, f"{kind}, H={mha.n_heads} heads of d_k={mha.head_dim}")
        # Q, K, V as the model's own projections produced them (split into heads the way the layer does)
        if mha.cross:
            q = mha.split_heads(rec.within(mha.q_proj, c)[0].output, mha.n_heads)
            k, v = mha.kv_heads(rec.within(mha.kv_proj, c)[0].output)
        else:
            q, k, v = mha.qkv_heads(rec.within(mha.qkv_proj, c)[0].output)
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
            mask = with_causal(mask, q.size(2), k.size(2), device=q.device)
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
            self.line(2, f"{gate}(gate) ⊙ up", self.shape(down.args[0], f"B {L} d_ff"),
                      self.vec(down.args[0][0, i], "a_i="))
        else:
            self.line(2, "h = x W_1 + b_1 (up)", self.shape(up.output, f"B {L} d_ff"),
                      self.vec(up.output[0, i], "h_i="))
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
