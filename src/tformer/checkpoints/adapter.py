"""A LoRA checkpoint: the adapter of a training run (`tformer train --lora-r`), not a copy of the model.

    step-0000200/config.json                 as every checkpoint's (architecture, ModelConfig, checksums,
                                             meta), listing the two files below instead of model.safetensors
    step-0000200/adapter_model.safetensors   tformer.model.lora.lora_state_dict: `<layer>.lora.<target>.a` / `.b`
    step-0000200/adapter_config.json         peft's field names (r, lora_alpha, lora_dropout, target_modules
                                             as tformer targets, use_rslora) + int8 (the base quantised
                                             first), base (its path: relative to this checkpoint when it
                                             lies in the same run, else absolute) and base_sha256 (the
                                             checksum of the base's model.safetensors)

tformer.checkpoints.format writes one (`save(..., adapter_base=BASE)`) and `load` reads it transparently:
the base is loaded (and checked: a missing one, or one whose model.safetensors has another checksum,
is a CheckpointError naming its path and both checksums), int8-quantised when the adapter says so, and
the adapter applied. peft's own format (Hugging Face module names): tformer.checkpoints.hf.lora.to_peft.

Starting a new run from a LoRA checkpoint (`--init LORA_RUN`) starts from base + adapter merged into one
plain model (`merged`, peft's merge_and_unload); an adapter on an int8 base cannot be merged, and
`refuse_int8_init` says so before the run starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor, nn

from ..errors import CheckpointError, ConfigError
from ..inference.int8_embedding import quantize_base
from ..inference.quant import Int8LoRALinear
from ..model.lora import TARGETS, apply_lora, load_lora_state_dict, lora_layers, lora_state_dict, merge, remove_lora
from .files import write_json_atomic
from .layout import resolve, run_dir_of

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
FIELDS = ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "int8", "base", "base_sha256")


def settings_of(model: nn.Module) -> dict[str, Any]:
    """r, alpha, dropout, targets, rslora and int8 of `model`'s adapters (apply_lora's: one setting for all)."""
    layers = lora_layers(model)
    adapters = [(t, a) for layer in layers.values() for t, a in layer.lora.items()]
    if not adapters:
        raise ConfigError("the model has no LoRA adapters to save")
    if len({(a.r, a.alpha, a.rslora, a.dropout.p) for _, a in adapters}) > 1:
        raise ConfigError("LoRA adapters of different ranks or scalings: save them with to_peft instead")
    _, a = adapters[0]
    targets = [t for t in TARGETS if any(t == name for name, _ in adapters)]
    return {"peft_type": "LORA", "r": a.r, "lora_alpha": a.alpha, "lora_dropout": a.dropout.p,
            "target_modules": targets, "use_rslora": a.rslora,
            "int8": any(isinstance(layer, Int8LoRALinear) for layer in layers.values())}


def base_reference(base: Path, path: Path) -> str:
    """How the checkpoint at `path` names its base: relative when both lie in one run directory (RUN/base/
    and RUN/best/ or RUN/checkpoints/step-*: the run can move), else the absolute path."""
    base, path = base.resolve(), path.resolve()
    run = run_dir_of(path) if run_dir_of(path) != path else path.parent
    return os.path.relpath(base, path) if base.is_relative_to(run) else str(base)


def write_adapter(tmp: Path, model: nn.Module, base: str, base_sha256: str) -> list[str]:
    """Write the adapter files of `model` into the directory `tmp`; returns their names."""
    config = {**settings_of(model), "base": base, "base_sha256": base_sha256}
    save_file({k: v.contiguous().cpu() for k, v in lora_state_dict(model).items()}, str(tmp / ADAPTER_WEIGHTS))
    write_json_atomic(tmp / ADAPTER_CONFIG, config)
    return [ADAPTER_WEIGHTS, ADAPTER_CONFIG]


def read_adapter_config(ckpt: Path) -> dict[str, Any]:
    file = ckpt / ADAPTER_CONFIG
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} cannot be read ({e})") from None
    missing = [k for k in FIELDS if not isinstance(config, dict) or k not in config]
    if missing:
        raise CheckpointError(f"{file} lacks {', '.join(missing)}; not a tformer LoRA checkpoint")
    return config


def base_dir(ckpt: Path, config: dict[str, Any]) -> Path:
    """The base checkpoint the adapter in `ckpt` was trained on."""
    return Path(os.path.normpath(ckpt / config["base"]))


def check_base(ckpt: Path, base: Path, want: str, have: str | None) -> None:
    """A one-line CheckpointError unless the base's model.safetensors has the checksum the adapter recorded."""
    if have is None:
        raise CheckpointError(f"{ckpt}: the LoRA adapter's base {base} is missing or not a full checkpoint "
                              f"(the adapter was trained on model.safetensors sha256 {want})")
    if have != want:
        raise CheckpointError(f"{ckpt}: the LoRA adapter's base {base} has changed: its model.safetensors has "
                              f"sha256 {have}, the adapter was trained on {want}")


def attach(model: nn.Module, config: dict[str, Any], state: dict[str, Tensor], source: str) -> nn.Module:
    """The base `model` with the adapter: int8-quantised first when it was trained so, then apply_lora
    and the adapter's tensors (strictly). In place; returns the model."""
    if config["int8"]:
        quantize_base(model)
    try:
        apply_lora(model, config["r"], config["lora_alpha"], config["lora_dropout"], config["target_modules"],
                   config["use_rslora"])
        return load_lora_state_dict(model, state)
    except ConfigError as e:
        raise CheckpointError(f"{source}: {e}") from None


def refuse_int8_init(init: str | os.PathLike) -> None:
    """A one-line CheckpointError when the checkpoint `init` (to start a run from) is a LoRA adapter on an int8
    base: int8 weights cannot take the adapter in (`merged`). Any other path: nothing (others check it)."""
    try:
        ckpt = resolve(init)
    except CheckpointError:
        return
    if not (ckpt / ADAPTER_CONFIG).is_file():
        return
    config = read_adapter_config(ckpt)
    if config["int8"]:
        raise CheckpointError(f"--init {init} is a LoRA adapter on an int8 base (--lora-int8), which cannot be "
                              f"merged into full weights: start from its base {base_dir(ckpt, config)} instead")


def merged(model: nn.Module, source: str | os.PathLike) -> nn.Module:
    """`model` as one plain model: LoRA adapters (a LoRA checkpoint as format.load gives it: base + adapter)
    merged into the weights and removed, as peft's merge_and_unload; a model without adapters as it is. What
    a run started from `source` (--init) trains. In place; returns the model."""
    layers = lora_layers(model)
    if not layers:
        return model
    if any(isinstance(layer, Int8LoRALinear) for layer in layers.values()):
        raise CheckpointError(f"{source}: a LoRA adapter on an int8 base cannot be merged into full weights")
    try:
        return remove_lora(merge(model))
    except ConfigError as e:   # an adapter on a weight tied to another (lm_head = embeddings)
        raise CheckpointError(f"{source}: {e}") from None
