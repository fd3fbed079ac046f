"""The machinery shared by every family: a declarative key map and the two conversions it drives.

A family lists `Rule`s: one tformer tensor <- one or more Hugging Face tensors.

    Rule("stack.layers.0.attn.qkv_proj.weight", ("h.0.attn.c_attn.weight",), transpose=True)   # GPT-2 Conv1D
    Rule("layers.0.attn.qkv_proj.weight", ("...query.weight", "...key.weight", "...value.weight"))  # fuse

Several HF tensors are concatenated along dim 0 in the order given (Q, K, V -> qkv_proj rows
[q; k; v]; gate, up -> ffn.up rows [gate; up]); `transpose` flips a (in, out) Conv1D matrix to
nn.Linear's (out, in). The reverse (tformer -> HF) splits along dim 0 with the HF tensors' sizes.
HF names are written without the family's base-model prefix ("transformer.", "model.", "bert.").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from ...errors import CheckpointError, ConfigError
from ...model.config import ModelConfig
from ..format import key_mismatch


@dataclass(frozen=True)
class Rule:
    ours: str                    # tformer state_dict key (canonical name of tied tensors)
    hf: tuple[str, ...]          # HF keys, concatenated along dim 0 when more than one
    transpose: bool = False      # HF stores the matrix as (in, out): GPT-2's Conv1D


def layer_rules(template: list[tuple[str, tuple[str, ...] | str]], ours_prefix: str, hf_prefix: str,
                n_layers: int, transpose: tuple[str, ...] = ()) -> list[Rule]:
    """Rules for `n_layers` identical blocks: `template` pairs a tformer suffix with HF suffix(es);
    suffixes listed in `transpose` are Conv1D matrices."""
    rules = []
    for i in range(n_layers):
        for ours, hf in template:
            hf = (hf,) if isinstance(hf, str) else hf
            rules.append(Rule(f"{ours_prefix}{i}.{ours}", tuple(f"{hf_prefix}{i}.{h}" for h in hf),
                              transpose=ours in transpose))
    return rules


def ignored(key: str, patterns: dict[str, str]) -> str | None:
    """The declared reason for not importing `key`, or None when it must be imported."""
    return next((why for p, why in patterns.items() if re.fullmatch(p, key)), None)


def to_ours(rules: list[Rule], hf_state: dict[str, Tensor]) -> dict[str, Tensor]:
    """HF tensors -> tformer tensors (the caller has checked that every key is present)."""
    out = {}
    for r in rules:
        parts = [hf_state[k].t() if r.transpose else hf_state[k] for k in r.hf]
        out[r.ours] = (torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]).contiguous()
    return out


def fused_sizes(cfg: ModelConfig, rule: Rule) -> list[int]:
    """Dim-0 sizes of the HF parts of a fused tensor: [q; k; v] is uneven under grouped-query
    attention (fewer K/V heads); [k; v] and [gate; up] are halves. An encoder-decoder's decoder
    tensors take the decoder's own sizes."""
    cfg = cfg.stack_config("decoder") if rule.ours.startswith("decoder.") else cfg
    if ".qkv_proj." in rule.ours:
        kv = cfg.kv_heads * cfg.head_dim
        return [cfg.n_heads * cfg.head_dim, kv, kv]
    return [cfg.ffn_dim if ".ffn.up." in rule.ours else cfg.kv_heads * cfg.head_dim] * len(rule.hf)


def to_hf(rules: list[Rule], state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """tformer tensors -> HF tensors (fused tensors split along dim 0, Conv1D matrices transposed)."""
    out = {}
    for r in rules:
        t = state[r.ours]
        parts = t.split(fused_sizes(cfg, r), dim=0) if len(r.hf) > 1 else (t,)
        for k, p in zip(r.hf, parts):
            out[k] = (p.t() if r.transpose else p).contiguous().clone()
    return out


def check_hf_state(hf_state: dict[str, Tensor], expected: dict[str, tuple[int, ...]], ignore: dict[str, str],
                   source: str) -> None:
    """Strict check in HF's own names: nothing missing, nothing unexpected, every shape right."""
    missing = sorted(k for k in expected if k not in hf_state)
    unexpected = sorted(k for k in hf_state if k not in expected and ignored(k, ignore) is None)
    if missing or unexpected:
        raise CheckpointError(f"{source}: weights do not match config.json: "
                              f"{key_mismatch(missing, unexpected, 'tensor(s) ')} "
                              f"(is the checkpoint complete and its config.json the right one?)")
    for k, shape in expected.items():
        if k in hf_state and tuple(hf_state[k].shape) != tuple(shape):
            raise CheckpointError(f"{source}: tensor {k} has shape {tuple(hf_state[k].shape)}, "
                                  f"config.json implies {tuple(shape)}")


def check_copies(hf_state: dict[str, Tensor], groups: list[tuple[str, ...]], source: str, why: str) -> None:
    """Tensors HF may store more than once (tied embeddings) must be equal: tformer keeps one."""
    for group in groups:
        present = [k for k in group if k in hf_state]
        for k in present[1:]:
            if not torch.equal(hf_state[present[0]], hf_state[k]):
                raise CheckpointError(f"{source}: {present[0]} and {k} differ, but {why}; "
                                      f"tformer cannot represent this checkpoint exactly")


# HF activation names (ACT2FN keys) <-> tformer's. "gelu_new" is GPT-2's tanh approximation.
ACT_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
               "silu": "silu", "swish": "silu"}
ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}


def hf_activation(name, key: str, family: str) -> str:
    if name not in ACT_FROM_HF:
        raise ConfigError(f"{family}: {key}={name!r} is not supported (tformer reads {', '.join(ACT_FROM_HF)})")
    return ACT_FROM_HF[name]


def settings(hf: dict, defaults: dict) -> dict:
    """config.json values over the family's defaults (older files omit values equal to the default)."""
    return {**defaults, **{k: v for k, v in hf.items() if k in defaults}}


def refuse_unless(ok: bool, family: str, what: str) -> None:
    """Refuse a configuration tformer cannot reproduce exactly, naming it."""
    if not ok:
        raise ConfigError(f"{family} checkpoint uses {what}, which tformer cannot represent exactly")


# What every family but T5 needs: heads of d_model / n_heads, scores scaled by 1/√d_k, a plain output layer.
STANDARD_ATTENTION = dict(head_size=(lambda v: v is None, "None: heads of d_model / n_heads"), attention_scale=True,
                          output_scale=False)


def mismatches(cfg: ModelConfig, wanted: dict) -> list[str]:
    """Fields of `cfg` that differ from what an HF family requires, as "field=value (needs X)".
    A requirement is a value, a list of allowed values, or (predicate, description)."""
    out = []
    for field, need in wanted.items():
        have = getattr(cfg, field)
        if isinstance(need, tuple):
            ok, text = need[0](have), need[1]
        elif isinstance(need, list):
            ok, text = have in need, "one of " + ", ".join(map(repr, need))
        else:
            ok, text = have == need, repr(need)
        if not ok:
            out.append(f"{field}={have!r} (needs {text})")
    return out


def token_id(value, key: str, family: str):
    """A special-token id; lists (several EOS ids) cannot be represented by tformer's single id."""
    if isinstance(value, list):
        refuse_unless(len(value) == 1, family, f"several {key}s {value}")
        return value[0]
    return value


def merge_copies(hf_state: dict[str, Tensor], groups: list[tuple[str, ...]], source: str, why: str) -> None:
    """Keep one tensor per group of copies (named by the group's first key), after checking they agree."""
    check_copies(hf_state, groups, source, why)
    for group in groups:
        present = [k for k in group if k in hf_state]
        if present:
            hf_state[group[0]] = hf_state[present[0]]
            for k in group[1:]:
                hf_state.pop(k, None)
