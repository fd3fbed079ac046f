"""Hugging Face checkpoints in and out: `from_hf(dir)` -> tformer model, `to_hf(model, dir)`.

One small module per family (gpt2, bert, marian, bart, llama, t5) declares its key map (keymap.Rule),
how config.json maps to ModelConfig (refusing what tformer cannot reproduce exactly), and the
reverse. This package needs only torch and safetensors: `transformers` is not imported.

Import is strict: every tensor the key map names must be present with the right shape, and any
other tensor is an error unless the family declares it as left out, with the reason (IGNORED:
BERT's pooler and pre-training heads, old causal-mask buffers...; `convert_hf` returns them).
Loaded weights go into fp32 parameters; HF's dropout rates map to dropout (embeddings and sublayer
outputs), attn_dropout (attention weights) and ffn_dropout (activation_dropout).
Optional family hooks: prepare_import (Marian/BART: final_logits_bias, position-table check),
export_state (Marian: re-basing an interleaved position table), export_extra (copies HF expects).

    model = tformer.from_hf("hf_dir")        # config.json + model.safetensors | pytorch_model.bin
    tformer.to_hf(model, "out_dir")          # config.json + model.safetensors (+ tokenizer.json)
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from ...errors import CheckpointError, ConfigError
from ...model.lora import refuse_adapters
from ..files import atomic_dir, write_json_atomic
from ..format import load_state, unique_state_dict
from . import bart, bert, gpt2, keymap, llama, marian, t5

log = logging.getLogger(__name__)
FAMILIES = {f.MODEL_TYPE: f for f in (gpt2, bert, marian, bart, llama, t5)}
# Export: which HF family each tformer model kind may become, tried in this order.
EXPORT_ORDER = {"decoder": (gpt2, llama), "encoder": (bert, t5), "encoder-decoder": (marian, bart, t5),
                "tagger": (bert,)}


def read_hf_config(path: Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory (pass a Hugging Face model directory)")
    file = path / "config.json"
    if not file.exists():
        raise CheckpointError(f"{path} has no config.json; is it a Hugging Face model directory?")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} is not a JSON object")
    if data.get("format") == "tformer":
        raise CheckpointError(f"{path} is already a tformer checkpoint (load it with tformer.load)")
    return data


def read_hf_weights(path: Path) -> dict[str, Tensor]:
    """model.safetensors (or its sharded index), else pytorch_model.bin loaded with weights_only=True."""
    from ..format import read_safetensors

    for single, index, load in (("model.safetensors", "model.safetensors.index.json", read_safetensors),
                                ("pytorch_model.bin", "pytorch_model.bin.index.json", _read_bin)):
        if (path / single).exists():
            return load(path / single)
        if (path / index).exists():
            try:
                files = sorted(set(json.loads((path / index).read_text(encoding="utf-8"))["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, AttributeError) as e:
                raise CheckpointError(f"{path / index} is not a valid shard index ({e})") from None
            state = {}
            for name in files:
                if not (path / name).exists():
                    raise CheckpointError(f"{path / name} is missing (listed in {index})")
                state.update(load(path / name))
            return state
    raise CheckpointError(f"{path} has no model.safetensors or pytorch_model.bin")


def _read_bin(file: Path) -> dict[str, Tensor]:
    try:  # weights_only: a pickle that would run code is refused instead of executed
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{file} cannot be read as a PyTorch state dict ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} does not hold a state dict")
    return state


def _strip_prefix(state: dict[str, Tensor], family) -> dict[str, Tensor]:
    """HF names without the base-model prefix, so GPT2Model and GPT2LMHeadModel files read alike."""
    p = family.PREFIX
    return {k[len(p):] if k.startswith(p) else k: v for k, v in state.items()}


def from_hf(path: str | os.PathLike) -> nn.Module:
    """A tformer model (in eval mode, fp32 parameters) with the weights of a Hugging Face directory.
    Raises ConfigError for a model tformer cannot represent exactly and CheckpointError for missing,
    unexpected or wrongly shaped tensors, each naming what is wrong. Tensors a family declares as
    not part of the tformer model (BERT's pooler, say) are logged at INFO level."""
    model, dropped = convert_hf(path)
    for key, why in dropped.items():
        log.info("%s: not imported: %s (%s)", path, key, why)
    return model


def convert_hf(path: str | os.PathLike) -> tuple[nn.Module, dict[str, str]]:
    """from_hf, also returning the HF tensors left out on purpose: {name: declared reason}."""
    path = Path(path)
    hf_config = read_hf_config(path)
    model_type = hf_config.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"{path / 'config.json'}: model_type={model_type!r} is not supported "
                          f"(tformer imports {', '.join(FAMILIES)})")
    family = FAMILIES[model_type]
    cfg = family.config_from_hf(hf_config)
    # A family with task heads (BERT: token classification) builds the model `architectures` names.
    model = family.build_for(hf_config, cfg) if hasattr(family, "build_for") else family.build(cfg)
    source = str(path)
    hf_state = _strip_prefix(read_hf_weights(path), family)
    keymap.merge_copies(hf_state, family.copies(cfg), source, "tformer keeps one tensor for both (tied weights)")
    if hasattr(family, "prepare_import"):
        family.prepare_import(hf_state, cfg, source)
    rules = rules_of(family, model)
    expected = {k: tuple(v.shape) for k, v in keymap.to_hf(rules, unique_state_dict(model), cfg).items()}
    keymap.check_hf_state(hf_state, expected, family.IGNORED, source)
    load_state(model, keymap.to_ours(rules, hf_state), source)
    dropped = {k: keymap.ignored(k, family.IGNORED) for k in sorted(hf_state) if k not in expected}
    return model.eval(), dropped


def rules_of(family, model: nn.Module) -> list[keymap.Rule]:
    """The family's key-map rules for this model (a family may choose them per model: rules_for)."""
    return family.rules_for(model) if hasattr(family, "rules_for") else family.rules(model.cfg)


def export_layout(family, model: nn.Module) -> tuple[dict, str, tuple[str, ...]]:
    """(extra config entries, key prefix, keys written without the prefix) of the model's HF export."""
    return family.export_for(model) if hasattr(family, "export_for") else ({}, family.EXPORT_PREFIX, family.HEAD_KEYS)


def hf_family(model: nn.Module):
    """The HF family that represents `model` exactly, or ConfigError saying why none does."""
    cfg = getattr(model, "cfg", None)
    if getattr(model, "kind", None) not in EXPORT_ORDER or cfg is None:
        raise ConfigError(f"cannot export a {type(model).__name__} to Hugging Face format "
                          f"(export a Decoder, Encoder, EncoderTokenClassifier or EncoderDecoder; for a classifier, "
                          f"its .encoder)")
    reasons = []
    for family in EXPORT_ORDER[model.kind]:
        problems = family.fits(cfg)
        if not problems:
            return family
        reasons.append(f"{family.MODEL_TYPE} does not fit: {', '.join(problems)}")
    raise ConfigError(f"no Hugging Face family represents this {cfg.kind} exactly: {'; '.join(reasons)}")


def hf_state_dict(model: nn.Module) -> tuple[object, dict[str, Tensor]]:
    """(family, tensors): the tensors `to_hf` writes, by their HF names without the base-model prefix
    ("h.0.attn.c_attn.weight", "layers.0.self_attn.q_proj.weight"), on the CPU. The GGUF export
    starts from these, as llama.cpp's converter starts from an HF directory."""
    refuse_adapters(model, "export", merged_ok=True)   # the key map would write the base weights alone
    family = hf_family(model)
    cfg = model.cfg
    state = {k: v.detach().cpu() for k, v in unique_state_dict(model).items()}
    if hasattr(family, "export_state"):          # Marian: an interleaved position table, re-based
        state = family.export_state(state, cfg)
    state = keymap.to_hf(rules_of(family, model), state, cfg)
    if hasattr(family, "export_extra"):
        family.export_extra(state, cfg)
    return family, state


def to_hf(model: nn.Module, path: str | os.PathLike, tokenizer=None,
          extra_files: dict[str, bytes] | None = None) -> Path:
    """Write `model` as a Hugging Face directory (config.json + model.safetensors, + tokenizer.json
    when `tokenizer` — anything with .save(path) — is given) that transformers loads with
    `AutoModel*.from_pretrained(path)`. `extra_files` (name -> bytes: a chat template, a fuller
    tokenizer_config.json) are written too. An existing directory at `path` is replaced atomically."""
    from safetensors.torch import save_file

    family, state = hf_state_dict(model)
    cfg = model.cfg
    extra, p, heads = export_layout(family, model)
    state = {(k if k in heads else p + k): v.contiguous() for k, v in state.items()}
    hf_config = {**family.config_to_hf(cfg), **extra,
                 "dtype": str(next(iter(state.values())).dtype).removeprefix("torch.")}
    path = Path(path)
    with atomic_dir(path) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_json_atomic(tmp / "config.json", hf_config)
        if tokenizer is not None:
            tokenizer.save(str(tmp / "tokenizer.json"))
            write_json_atomic(tmp / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast"})
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
    return path


def load_hf_tokenizer(path: str | os.PathLike):
    """The tokenizer.json of an HF directory as a tformer Tokenizer (read with the `tokenizers`
    library), or None when the directory has none."""
    from ...data.tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json"
    return Tokenizer.from_file(file) if file.exists() else None


__all__ = ["from_hf", "convert_hf", "to_hf", "hf_state_dict", "load_hf_tokenizer", "hf_family", "read_hf_config",
           "FAMILIES"]
