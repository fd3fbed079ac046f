"""LoRA adapters in peft's format, both ways: `to_peft(model, dir)` and `from_peft(model, dir)`.

peft saves adapter_config.json and adapter_model.safetensors, whose keys are the Hugging Face
module paths: base_model.model.<module>.lora_A.weight (r, in) and .lora_B.weight (out, r), with
out = base(x) + s · B A dropout(x), s = lora_alpha / r (use_rslora: / √r).

Which HF module an adapter belongs to comes from the family's key map, the Rules to_hf writes by: a
Rule stacks one or more HF weights along dim 0 into one tformer weight, so each HF linear is a row
range of one tformer linear:

    llama  stack.layers.0.attn.qkv_proj rows [0, q)      -> model.layers.0.self_attn.q_proj
                                        rows [q, q + kv) -> model.layers.0.self_attn.k_proj  ...
    gpt2   stack.layers.0.attn.qkv_proj rows [0, 3 D)    -> transformer.h.0.attn.c_attn  (Conv1D)

No rows are permuted: tformer's q/k rows are HF's (llama.py maps them unchanged; tformer's RoPE uses
HF's rotate-half convention), and GPT-2's Conv1D changes the base weight's layout, not A's or B's.

Export: the tformer adapters that write into one HF module's rows become one peft adapter,
A = [A_1; A_2; ...] (Σr, in) and B = each adapter's rows of B_i side by side, zeros elsewhere: exact,
of rank Σr (GPT-2's q, k and v adapters -> one c_attn adapter of rank 3r); an adapter over several HF
modules (qkv on Llama) gives each its rows of B and the same A. Ranks and alphas that differ from the
most common ones go into rank_pattern / alpha_pattern; target_modules gets the shortest module-name
suffixes that cover exactly the adapted modules. As peft does, an adapted lm_head also carries its
base weight (lm_head.base_layer.weight).
Import: each HF module's adapter becomes one tformer adapter on its rows (GPT-2's c_attn: "qkv").
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ...errors import CheckpointError, ConfigError
from ...model.lora import add_adapter, check_settings, lora_layers, refusal, slots, train_only_adapters
from ..files import atomic_dir, write_json_atomic
from ..format import read_safetensors
from . import export_layout, hf_family, keymap, rules_of

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
# peft's TOKEN_CLS would also train the whole classifier (modules_to_save), so a tagger's adapter names none.
TASK_TYPES = {"decoder": "CAUSAL_LM", "encoder-decoder": "SEQ_2_SEQ_LM", "encoder": "FEATURE_EXTRACTION",
              "tagger": None}
EMBEDDING_LAYERS = ("lm_head", "embed_tokens")      # peft saves their base weight with the adapter
# HF linears that tformer's models do not have, so a module-name suffix must not reach them.
OTHER_LINEARS = {"bert": ("pooler.dense",)}
# adapter_config.json settings that change what the adapter computes, beyond what tformer reproduces.
UNSUPPORTED = ("use_dora", "lora_bias", "modules_to_save", "layer_replication", "trainable_token_indices",
               "target_parameters", "alora_invocation_tokens", "use_qalora", "use_bdlora")
KINDS = ("lora_A", "lora_B", "base_layer")


class Span(NamedTuple):
    """An HF linear as rows [start, stop) of the tformer linear at `path`; conv1d: stored (in, out)."""
    path: str
    start: int
    stop: int
    conv1d: bool


def hf_modules(model: nn.Module) -> tuple[object, dict[str, Span]]:
    """(HF family, {HF module path as peft names it: Span}) for every linear of `model`."""
    family = hf_family(model)
    cfg = model.cfg
    rules = rules_of(family, model)
    _, prefix, heads = export_layout(family, model)
    layers = slots(model)
    spans = {}
    for rule in rules:
        path = rule.ours.removesuffix(".weight")
        if not rule.ours.endswith(".weight") or path not in layers:
            continue
        sizes = keymap.fused_sizes(cfg, rule) if len(rule.hf) > 1 else [model.get_submodule(path).out_features]
        start = 0
        for key, size in zip(rule.hf, sizes):
            spans[(key if key in heads else prefix + key).removesuffix(".weight")] = Span(
                path, start, start + size, rule.transpose)
            start += size
    if "lm_head" in layers and "lm_head.weight" in heads and "lm_head" not in spans:     # a head tied to the embedding
        spans["lm_head"] = Span("lm_head", 0, model.lm_head.out_features, False)
    return family, spans


def _suffixes(adapted: set[str], every: list[str]) -> list[str]:
    """The shortest suffix of each adapted module's path that names no module left without an adapter
    (peft matches target_modules as a module name or a suffix after a dot)."""
    out = set()
    for name in adapted:
        parts = name.split(".")
        for n in range(1, len(parts) + 1):
            suffix = ".".join(parts[-n:])
            if all(m in adapted for m in every if m == suffix or m.endswith("." + suffix)):
                out.add(suffix)
                break
    return sorted(out)


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def _stacked(parts: list, span: Span) -> tuple[Tensor, Tensor]:
    """The adapters `parts` (one layer's, overlapping `span`) as one peft adapter on the span's rows:
    A (Σr, in), B (rows, Σr), scaled to the first adapter's s."""
    s = parts[0].scaling
    a = torch.cat([p.a.detach().cpu() for p in parts])
    b = torch.zeros(span.stop - span.start, a.size(0), dtype=a.dtype)
    col = 0
    for p in parts:
        lo, hi = max(p.start, span.start), min(p.stop, span.stop)
        rows = p.b.detach()[lo - p.start:hi - p.start].cpu()
        b[lo - span.start:hi - span.start, col:col + p.r] = rows if p.scaling == s else rows * (p.scaling / s)
        col += p.r
    return a, b


def to_peft(model: nn.Module, path: str | os.PathLike, base_model_name_or_path: str | None = None) -> Path:
    """Write `model`'s (unmerged) adapters as peft saves them for the HF architecture to_hf writes,
    so that `PeftModel.from_pretrained(hf_model, path)` computes what `model` does. Returns the path."""
    from safetensors.torch import save_file

    family, spans = hf_modules(model)
    layers = lora_layers(model)
    adapters = [a for layer in layers.values() for a in layer.lora.values()]
    if not adapters:
        raise ConfigError("to_peft: the model has no LoRA adapters (apply_lora or from_peft first)")
    if any(layer.merged for layer in layers.values()):
        raise ConfigError("to_peft: the adapters are merged into the weights; unmerge(model) first")
    rslora = all(a.rslora for a in adapters)
    tensors, ranks, alphas = {}, {}, {}
    for name, span in spans.items():
        layer = layers.get(span.path)
        parts = [a for a in layer.lora.values() if a.start < span.stop and span.start < a.stop] if layer else []
        if not parts:
            continue
        key = KEY_PREFIX + name
        tensors[key + ".lora_A.weight"], tensors[key + ".lora_B.weight"] = _stacked(parts, span)
        if name.rpartition(".")[2] in EMBEDDING_LAYERS:
            base = layer.weight.detach()[span.start:span.stop].cpu()
            tensors[key + ".base_layer.weight"] = (base.t() if span.conv1d else base).contiguous()
        ranks[name] = rank = sum(a.r for a in parts)
        one = len(parts) == 1 and parts[0].rslora == rslora
        alphas[name] = _number(parts[0].alpha if one else parts[0].scaling * (math.sqrt(rank) if rslora else rank))
    (r, alpha), _ = Counter(zip(ranks.values(), alphas.values())).most_common(1)[0]
    every = list(spans) + [p + m for p in ("", family.PREFIX) for m in OTHER_LINEARS.get(family.MODEL_TYPE, ())]
    config = dict(
        peft_type="LORA", task_type=TASK_TYPES[model.kind], base_model_name_or_path=base_model_name_or_path,
        r=r, lora_alpha=alpha, lora_dropout=Counter(a.dropout.p for a in adapters).most_common(1)[0][0],
        target_modules=_suffixes(set(ranks), every), bias="none", use_rslora=rslora,
        fan_in_fan_out=any(spans[n].conv1d for n in ranks), init_lora_weights=True, inference_mode=True,
        rank_pattern={n: k for n, k in ranks.items() if k != r},
        alpha_pattern={n: a for n, a in alphas.items() if a != alpha},
        modules_to_save=None, use_dora=False, lora_bias=False)
    path = Path(path)
    with atomic_dir(path) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        write_json_atomic(tmp / CONFIG, config)
    return path


def read_peft_config(path: Path) -> dict:
    file = path / CONFIG
    if not file.exists():
        raise CheckpointError(f"{path} has no {CONFIG}; is it a peft adapter directory?")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise ConfigError(f"{file}: peft_type={config.get('peft_type') if isinstance(config, dict) else None!r}; "
                          f"tformer reads LORA adapters")
    used = [k for k in UNSUPPORTED if config.get(k) not in (None, False, [], {})]
    if config.get("bias", "none") != "none":
        used.append("bias")
    if used:
        raise ConfigError(f"{file}: {', '.join(f'{k}={config[k]!r}' for k in used)} is not supported "
                          f"(tformer reads plain LoRA: low-rank A and B only)")
    return config


def _pattern(patterns: dict | None, name: str, default):
    """peft's lookup (utils.other.get_pattern_key): the first key that matches the end of `name`."""
    return next((v for k, v in (patterns or {}).items() if re.fullmatch(rf"(.*\.)?({k})", name)), default)


def _split(key: str) -> tuple[str | None, str | None]:
    """base_model.model.<module>.lora_A.weight -> (module, "lora_A"); (None, None) for anything else."""
    for kind in KINDS:
        if key.startswith(KEY_PREFIX) and key.endswith(f".{kind}.weight"):
            return key[len(KEY_PREFIX):-len(f".{kind}.weight")], kind
    return None, None


def _adapters(model: nn.Module, state: dict[str, Tensor], config: dict, source: Path) -> list[tuple]:
    """(layer path, target, rows, r, alpha, A, B) for each adapter in `state`, checked against `model`."""
    _, spans = hf_modules(model)
    table = slots(model)
    found: dict[str, dict[str, Tensor]] = {}
    for key, t in state.items():
        name, kind = _split(key)
        if name not in spans:
            raise ConfigError(f"{source}: {key} names no LoRA weight of a linear layer of this tformer {model.kind} "
                              f"(such keys are {KEY_PREFIX}<module>.lora_A.weight, <module> like {next(iter(spans))})")
        found.setdefault(name, {})[kind] = t
    out = []
    for name, tensors in found.items():
        span = spans[name]
        linear = model.get_submodule(span.path)
        if "base_layer" in tensors:                # an embedding layer's base weight, saved by peft: the same?
            base = linear.weight.detach()[span.start:span.stop].cpu()
            base = base.t() if span.conv1d else base
            if not torch.equal(tensors["base_layer"], base.to(tensors["base_layer"].dtype)):
                raise ConfigError(f"{source}: {name}.base_layer.weight differs from this model's weight "
                                  f"(the adapter was saved with another base model)")
        if "lora_A" not in tensors or "lora_B" not in tensors:
            raise ConfigError(f"{source}: {name} lacks lora_A or lora_B")
        r = _pattern(config.get("rank_pattern"), name, config.get("r"))
        alpha = _pattern(config.get("alpha_pattern"), name, config.get("lora_alpha"))
        check_settings(r, alpha, float(config.get("lora_dropout") or 0.0))
        a, b = tensors["lora_A"], tensors["lora_B"]
        want = ((r, linear.in_features), (span.stop - span.start, r))
        if (tuple(a.shape), tuple(b.shape)) != want:
            raise ConfigError(f"{source}: {name} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                              f"this model with r={r} needs {want[0]} and {want[1]}")
        target = next(t for t, rows in table[span.path].items() if rows == (span.start, span.stop))
        why = refusal(model, span.path, target)
        if why is not None:
            raise ConfigError(f"{source}: {why}")
        out.append((span.path, target, (span.start, span.stop), r, alpha, a, b))
    return out


def from_peft(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Add the adapters of a peft LoRA directory, trained on the HF form of `model`'s architecture,
    to `model` (in place; only adapter weights then require grad). A tensor that names no linear of
    this model, or whose shape disagrees with it or with the config, is a ConfigError, and nothing
    changes then. Returns the model."""
    path = Path(path)
    config = read_peft_config(path)
    if not (path / WEIGHTS).exists():
        raise CheckpointError(f"{path} has no {WEIGHTS}")
    adapters = _adapters(model, read_safetensors(path / WEIGHTS), config, path / WEIGHTS)
    rslora, dropout = bool(config.get("use_rslora")), float(config.get("lora_dropout") or 0.0)
    for layer, target, rows, r, alpha, a, b in adapters:
        adapter = add_adapter(model, layer, target, rows, r, alpha, dropout, rslora)
        with torch.no_grad():
            adapter.a.copy_(a)
            adapter.b.copy_(b)
    train_only_adapters(model)
    return model
