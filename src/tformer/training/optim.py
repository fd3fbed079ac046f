"""The optimiser side of training: the learning-rate schedule, AdamW's parameter groups, and its
state keyed by parameter name (so a checkpoint's optimizer.safetensors is readable and portable)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import ConfigError
from .config import TrainConfig


def lr_at(cfg: TrainConfig, step: int, progress: float) -> float:
    """Linear warm-up over `cfg.warmup` steps, then cosine from lr to lr * min_lr_ratio as `progress`
    (the fraction of the post-warm-up phase done, by steps or by time) goes from 0 to 1."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    p = min(max(progress, 0.0), 1.0)
    low = cfg.lr * cfg.min_lr_ratio
    return low + 0.5 * (cfg.lr - low) * (1.0 + math.cos(math.pi * p))


def progress_of(cfg: TrainConfig, step: int, elapsed: float, warm_elapsed: float | None) -> float:
    """Fraction of the decay phase done: by steps for --max-steps, by seconds for --time-budget
    (the larger when both are given). By steps only, it is deterministic."""
    by_steps = (step - cfg.warmup) / max(1, cfg.max_steps - cfg.warmup) if cfg.max_steps else 0.0
    by_time = 0.0
    if cfg.time_budget and warm_elapsed is not None:
        by_time = (elapsed - warm_elapsed) / max(1e-9, cfg.time_budget - warm_elapsed)
    return max(by_steps, by_time)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay the weight matrices only: norms, biases and embedding tables are left alone (decaying
    them pulls gains towards 0 and rare tokens' vectors towards the origin)."""
    decay, no_decay = [], []
    embeddings = {id(m.weight) for m in model.modules()
                  if isinstance(m, nn.Embedding) or type(m).__name__ == "LearnedPositions"}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append((name, p))
    return [{"names": [n for n, _ in decay], "params": [p for _, p in decay], "weight_decay": weight_decay},
            {"names": [n for n, _ in no_decay], "params": [p for _, p in no_decay], "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> tuple[torch.optim.AdamW, list[str]]:
    """AdamW over `model` and the parameter names in optimizer order (for saving its state by name).
    Plain tensors on a CPU or a CUDA GPU get PyTorch's fused AdamW, one kernel for every parameter's
    update: the same update, faster than its loop over the parameters on the CPU (BENCHMARKS.md, "What
    makes a CPU training step fast"). FSDP's sharded parameters keep the loop."""
    groups = param_groups(model, cfg.weight_decay)
    names = [n for g in groups for n in g.pop("names")]
    params = [p for g in groups for p in g["params"]]
    fused = not cfg.fsdp and all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda")
                                 and p.is_floating_point() for p in params)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay,
                            fused=fused or None)
    return opt, names


def optimizer_tensors(opt: torch.optim.Optimizer, names: list[str]) -> tuple[dict[str, Tensor], list[dict]]:
    """Optimizer state keyed by parameter name ("NAME/exp_avg"...) + the groups' hyperparameters."""
    sd = opt.state_dict()
    tensors = {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            t = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"{names[idx]}/{key}"] = t.detach().cpu().contiguous()
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [names[i] for i in g["params"]]}
              for g in sd["param_groups"]]
    return tensors, groups


def load_optimizer_tensors(opt: torch.optim.Optimizer, names: list[str], tensors: dict[str, Tensor],
                           groups: list[dict], source: str) -> None:
    index = {n: i for i, n in enumerate(names)}
    state: dict[int, dict[str, Tensor]] = {}
    for key, t in tensors.items():
        name, _, field = key.rpartition("/")
        if name not in index:
            raise ConfigError(f"{source}: optimizer state for unknown parameter {name!r}")
        state.setdefault(index[name], {})[field] = t
    saved_groups = [dict(g, params=[index[n] for n in g["params"]]) for g in groups]
    try:
        opt.load_state_dict({"state": state, "param_groups": saved_groups})
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{source}: optimizer state does not fit the model ({e})") from None
