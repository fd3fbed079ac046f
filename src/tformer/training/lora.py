"""The model a run trains: the task's (restored from a checkpoint on --resume), or with `--lora-r` that
model frozen under LoRA adapters (tformer.model.lora), int8-quantised first with `--lora-int8`.

A LoRA run's checkpoints hold the adapter and name its base (tformer.checkpoints.adapter): the --init
checkpoint when the task's model is exactly that checkpoint's (same architecture, config and tensors),
else the model as the task built it (a classifier's new head, a Hugging Face --init, no --init), saved
once as RUN/base/. On --resume the checkpoint gives base + adapter back, as tformer.load does.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..checkpoints.adapter import base_dir, read_adapter_config
from ..checkpoints.format import WEIGHTS, load, load_state, read_config, read_safetensors, unique_state_dict
from ..errors import CheckpointError
from ..inference.int8_embedding import quantize_base
from ..model.lora import apply_lora
from .config import Task, TrainConfig
from .rundir import RunDir


def same_model(model: nn.Module, init: str | None) -> Path | None:
    """The checkpoint directory `init` when it holds exactly `model` (architecture, config, every
    tensor), else None (no --init, a Hugging Face one, a LoRA run, or a model the task changed)."""
    if init is None:
        return None
    try:
        data = read_config(init)
    except CheckpointError:
        return None
    ckpt = Path(data["_dir"])
    if (data["architecture"] != type(model).__name__ or data.get("config") != model.cfg.to_dict()
            or WEIGHTS not in (data.get("files") or {})):
        return None
    saved, ours = read_safetensors(ckpt / WEIGHTS), unique_state_dict(model)
    same = saved.keys() == ours.keys() and all(torch.equal(saved[k], ours[k].detach().cpu()) for k in ours)
    return ckpt if same else None


def add_adapters(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """`model` frozen (int8 with --lora-int8) under adapters as cfg's --lora-* options say; in place."""
    if cfg.lora_int8:
        quantize_base(model)                  # linear layers and token embeddings int8
    return apply_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets.split(","),
                      cfg.lora_rslora)


def model_to_train(task: Task, cfg: TrainConfig, run_dir: RunDir, ckpt: Path | None) -> nn.Module:
    """The model to train, on the CPU in train mode: `ckpt`'s when resuming. A LoRA run's base is set on
    `run_dir` (its checkpoints then hold the adapter only)."""
    if cfg.lora_r is None:
        model = task.build_model()
        if ckpt is not None:
            load_state(model, read_safetensors(ckpt / WEIGHTS), str(ckpt))
        return model
    if ckpt is not None:          # base + adapter, checked against the base's checksum
        run_dir.base = base_dir(ckpt, read_adapter_config(ckpt))
        return load(ckpt).train()
    model = task.build_model()
    run_dir.base = same_model(model, getattr(task, "init", None)) or run_dir.save_base(model, task)
    return add_adapters(model, cfg)
