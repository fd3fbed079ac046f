"""Checkpoints: a directory with `config.json` (architecture, ModelConfig, checksums) and
`model.safetensors` (+ `tokenizer.json` when the model has one, and `source_tokenizer.json` for a
translator with separate source and target vocabularies). Loading never executes code. A LoRA
checkpoint holds an adapter instead of model.safetensors and names its base (tformer.checkpoints.adapter).

Writes are atomic: everything goes into a hidden temporary directory next to the target, which
is renamed into place only when complete (tformer.checkpoints.files.atomic_dir). This module knows
one checkpoint; where the checkpoints of a training run are (`load(run_dir)`), tformer.checkpoints.layout
says.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data.tokenizers import Tokenizer
from ..errors import CheckpointError, ConfigError, TformerError
from ..model.config import ModelConfig
from ..model.heads import EncoderClassifier, EncoderTokenClassifier
from ..model.lora import refuse_adapters
from ..model.models import Decoder, Encoder, EncoderDecoder
from .adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    attach,
    base_dir,
    base_reference,
    check_base,
    read_adapter_config,
    write_adapter,
)
from .files import atomic_dir, write_json_atomic
from .layout import CONFIG, resolve

FORMAT = "tformer"
FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
# Every model class by name: what a checkpoint's "architecture" field names.
ARCHITECTURES: dict[str, type[nn.Module]] = {cls.__name__: cls for cls in (
    Encoder, EncoderClassifier, EncoderTokenClassifier, Decoder, EncoderDecoder)}
TOKENIZER = "tokenizer.json"
SOURCE_TOKENIZER = "source_tokenizer.json"  # the source side's, when it differs from the target's (tokenizer.json)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def unique_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict without the aliases of tied weights (e.g. lm_head.weight = token embedding)."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen and t.numel() > 0:
            continue
        seen.add(key)
        out[name] = t
    return out


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """alias name -> canonical name, for parameters that are the same tensor."""
    first: dict[tuple[int, int], str] = {}
    aliases = {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in first and t.numel() > 0:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def save(model: nn.Module, path: str | os.PathLike, tokenizer=None, meta: dict[str, Any] | None = None,
         extra_files: dict[str, bytes] | None = None, source_tokenizer=None,
         adapter_base: str | os.PathLike | None = None) -> Path:
    """Write `model` (and its tokenizer, anything with `.save(path)` writing tokenizer.json) to `path`.
    `source_tokenizer`: an EncoderDecoder's source-side tokenizer when it has its own vocabulary.
    `meta` is stored in config.json (task, label names, data split...). `adapter_base`: a checkpoint
    `model` is that one's model with LoRA adapters: only the adapter is written, naming that base
    (tformer.checkpoints.adapter). Returns the directory."""
    from safetensors.torch import save_file

    path = Path(path)
    arch = type(model).__name__
    if arch not in ARCHITECTURES:
        raise TypeError(f"cannot save a {arch}; expected one of {', '.join(ARCHITECTURES)}")
    if adapter_base is None:
        refuse_adapters(model, "save")   # a plain model could not load the adapter keys back
    else:
        base = read_config(adapter_base)      # checked (checksums) when loaded, not at every save
        if WEIGHTS not in (base.get("files") or {}):
            raise CheckpointError(f"LoRA base {base['_dir']} is not a full checkpoint (it has no {WEIGHTS})")
        base_record = (base_reference(Path(base["_dir"]), path), base["files"][WEIGHTS])
    with atomic_dir(path) as tmp:
        if adapter_base is None:
            state = {k: v.detach().contiguous().cpu() for k, v in unique_state_dict(model).items()}
            save_file(state, str(tmp / WEIGHTS))
            names = [WEIGHTS]
        else:
            names = write_adapter(tmp, model, *base_record)
        files = {name: sha256(tmp / name) for name in names}
        for name, tok in ((TOKENIZER, tokenizer), (SOURCE_TOKENIZER, source_tokenizer)):
            if tok is not None:
                tok.save(str(tmp / name))
                files[name] = sha256(tmp / name)
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
            files[name] = sha256(tmp / name)
        config: dict[str, Any] = {"format": FORMAT, "format_version": FORMAT_VERSION, "architecture": arch,
                                  "config": model.cfg.to_dict(), "files": files, "meta": meta or {}}
        if model.kind in ("classifier", "tagger"):
            config["num_labels"], config["labels"] = model.num_labels, model.labels
        if model.kind == "classifier":
            config["pooling"] = model.pooling
        write_json_atomic(tmp / CONFIG, config)
    return path


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed and checked config.json of a checkpoint directory (or run directory)."""
    path = resolve(path)
    try:
        data = json.loads((path / CONFIG).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / CONFIG} is corrupt ({e}); re-save or re-train the model") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        hint = " (a Hugging Face directory? use `tformer import-hf`)" if isinstance(data, dict) and \
            "model_type" in data else ""
        raise CheckpointError(f"{path / CONFIG} is not a tformer config{hint}")
    if data.get("architecture") not in ARCHITECTURES:
        raise CheckpointError(f"{path / CONFIG}: unknown architecture {data.get('architecture')!r}")
    data["_dir"] = str(path)
    return data


def verify_files(path: Path, files: dict[str, str]) -> None:
    for name, digest in files.items():
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(f"{path / CONFIG}: {name!r} in 'files' is not a file name of the checkpoint")
        f = path / name
        if not f.exists():
            raise CheckpointError(f"{f} is missing; the checkpoint is incomplete")
        if sha256(f) != digest:
            raise CheckpointError(f"{f} is corrupt: its checksum does not match config.json (truncated or altered)")


def verify(path: str | os.PathLike) -> dict[str, Any]:
    """The checked config.json of a checkpoint (or run directory), after verifying that every file it
    lists matches its sha256: a truncated or altered file is named before anything reads it."""
    data = read_config(path)
    files = data.get("files") or {}
    if not isinstance(files, dict):
        raise CheckpointError(f"{Path(data['_dir']) / CONFIG}: 'files' must map file names to sha256 checksums")
    if WEIGHTS not in files and ADAPTER_WEIGHTS not in files:  # save() records one: else damage would go unnoticed
        raise CheckpointError(f"{Path(data['_dir']) / CONFIG} records no checksum for {WEIGHTS} "
                              "(not written by tformer.save; re-save the model)")
    verify_files(Path(data["_dir"]), files)
    return data


def build(data: dict[str, Any]) -> nn.Module:
    """An untrained model of the architecture described by a config.json dict."""
    try:
        cfg = ModelConfig.from_dict(data["config"])
    except TformerError as e:
        raise CheckpointError(f"{data.get('_dir', '')}/{CONFIG}: {e}") from None
    except KeyError:
        raise CheckpointError(f"{data.get('_dir', '')}/{CONFIG} has no 'config' section") from None
    cls = ARCHITECTURES[data["architecture"]]
    if cls.kind in ("classifier", "tagger") and not isinstance(data.get("num_labels"), int):
        raise CheckpointError(f"{data.get('_dir', '')}/{CONFIG} has no valid 'num_labels' for an {cls.__name__}")
    if cls.kind == "classifier":
        return cls(cfg, data["num_labels"], data.get("labels"), data.get("pooling", "first"))
    if cls.kind == "tagger":
        return cls(cfg, data["num_labels"], data.get("labels"))
    return cls(cfg)


def key_mismatch(missing: list[str], unexpected: list[str], noun: str = "") -> str:
    """'missing a, b; unexpected c' (at most five names each), for strict-loading errors."""
    def names(keys: list[str]) -> str:
        return ", ".join(keys[:5]) + (" ..." if len(keys) > 5 else "")

    parts = [f"missing {noun}{names(missing)}"] if missing else []
    parts += [f"unexpected {noun}{names(unexpected)}"] if unexpected else []
    return "; ".join(parts)


def load_state(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Strict loading: every expected tensor present with the right shape, nothing unexpected."""
    aliases = tied_aliases(model)
    expected = {k: v for k, v in model.state_dict().items() if k not in aliases}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{source}: weights do not match the architecture: {key_mismatch(missing, unexpected)}")
    for k, v in expected.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise CheckpointError(f"{source}: tensor {k} has shape {tuple(state[k].shape)}, "
                                  f"the model expects {tuple(v.shape)}")
    full = dict(state)
    for alias, canonical in aliases.items():
        full[alias] = state[canonical]
    model.load_state_dict(full, strict=True)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for truncated/garbled files
        raise CheckpointError(f"{path} cannot be read as safetensors ({e})") from None


def load(path: str | os.PathLike, device: str | torch.device | None = None,
         dtype: torch.dtype | None = None) -> nn.Module:
    """Load a model saved by `save` (or from a run directory: its `best/` model if it has one, else its newest
    checkpoint; see `resolve`), in eval mode, on `device`, its weights (an adapter's too) in fp32 whatever
    the file stores (training's dtype), or in `dtype` (bf16: half the memory and the bytes a step reads)."""
    model = _load(verify(path), device)
    return model if dtype is None else model.to(dtype)


def _load(data: dict[str, Any], device) -> nn.Module:
    """load() of a verified config.json."""
    ckpt = Path(data["_dir"])
    if ADAPTER_CONFIG in data["files"]:   # a LoRA checkpoint: its base, then the adapter
        config = read_adapter_config(ckpt)
        base = base_dir(ckpt, config)
        base_data = verify(base) if (base / CONFIG).is_file() else {"files": {}}
        check_base(ckpt, base, config["base_sha256"], base_data["files"].get(WEIGHTS))
        model = attach(_load(base_data, None), config, read_safetensors(ckpt / ADAPTER_WEIGHTS), str(ckpt))
        return (model.to(device) if device is not None else model).eval()
    if not (ckpt / WEIGHTS).exists():
        raise CheckpointError(f"{ckpt / WEIGHTS} is missing")
    model = build(data)
    load_state(model, read_safetensors(ckpt / WEIGHTS), str(ckpt / WEIGHTS))
    if device is not None:
        model.to(device)
    return model.eval()


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer saved with a checkpoint (a checkpoint directory or a run directory)."""
    path = Path(path)
    if path.is_file() and path.name.endswith(".json"):
        return Tokenizer.from_file(path)
    ckpt = resolve(path)
    if not (ckpt / TOKENIZER).is_file():
        raise CheckpointError(f"{ckpt} has no {TOKENIZER} (pass token ids, or train with `tformer train`, "
                              "which saves the tokenizer with the model)")
    return Tokenizer.from_file(ckpt / TOKENIZER)


def load_source_tokenizer(path: str | os.PathLike) -> Tokenizer | None:
    """The source-side tokenizer of a translator trained with separate vocabularies (its
    `source_tokenizer.json`), or None when one tokenizer (`tokenizer.json`) serves both sides."""
    path = Path(path)
    if path.is_file():  # a bare tokenizer.json: there is no second one
        return None
    data = read_config(path)
    file = Path(data["_dir"]) / SOURCE_TOKENIZER
    separate = (data.get("config") or {}).get("src_vocab_size") is not None
    if separate and not file.is_file():
        raise CheckpointError(f"{data['_dir']} has no {SOURCE_TOKENIZER}, but its model has a separate source "
                              "vocabulary (src_vocab_size); save it with tformer.save(..., source_tokenizer=...)")
    if file.is_file() and not separate:
        raise CheckpointError(f"{data['_dir']} has a {SOURCE_TOKENIZER}, but its model shares one vocabulary "
                              "(no src_vocab_size); re-save it without source_tokenizer")
    return Tokenizer.from_file(file) if separate else None


def load_draft(path: str | os.PathLike, tokenizer: Tokenizer, context: int = 0, device=None,
               dtype: torch.dtype | None = None) -> nn.Module:
    """A draft model for speculative decoding (`--draft-model`): a decoder with the model's tokenizer
    (`tokenizer`'s vocabulary, token for token) and a context of at least `context` positions."""
    draft = load(path, device, dtype)
    if draft.kind != "decoder":
        raise ConfigError(f"--draft-model {path} holds a {type(draft).__name__}; a draft must be a decoder (GPT-style)")
    if load_tokenizer(path).hf.get_vocab(with_added_tokens=True) != tokenizer.hf.get_vocab(with_added_tokens=True):
        raise ConfigError(f"--draft-model {path} has another tokenizer than the model (a draft must be trained with "
                          f"the model's tokenizer: --tokenizer RUN/tokenizer.json)")
    if draft.cfg.max_seq_len < context:
        raise ConfigError(f"--draft-model {path} has a context of {draft.cfg.max_seq_len} positions, the model "
                          f"{context}: a draft must see as much of the text")
    return draft
