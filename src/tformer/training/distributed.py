"""Where this process stands under `torchrun`: rank, world size, and the few collective operations
the training loop needs (PyTorch's own process group; gloo on CPU, nccl on GPU). World 1 without
torchrun, when every operation is a no-op. Also how the model is spread over the processes: DDP
(a whole copy each) or FSDP2 (`--fsdp`: parameters, gradients and optimizer state sharded)."""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Callable

import torch
from torch import nn

from ..checkpoints.format import load_state, tied_aliases
from ..errors import CheckpointError


class Dist:
    """This process's place under torchrun (rank, world size); world 1 without torchrun."""

    def __init__(self, device_pref: str):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.owned = False
        if self.world > 1 and not torch.distributed.is_initialized():
            cuda = device_pref in ("auto", "cuda") and torch.cuda.is_available()
            if cuda:
                torch.cuda.set_device(self.local_rank)
            torch.distributed.init_process_group("nccl" if cuda else "gloo")
            self.owned = True

    @property
    def main(self) -> bool:
        return self.rank == 0

    def max(self, values: list[float], device) -> list[float]:
        """Element-wise max over processes (so all agree on the clock and on stopping)."""
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return t.tolist()

    def mean(self, value: float, device) -> float:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t)
        return t.item() / self.world

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def close(self) -> None:
        if self.owned:
            torch.distributed.destroy_process_group()

    def broadcast(self, value):
        """Rank 0's `value` on every process."""
        if self.world == 1:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]


def wrap(model: nn.Module, dist: Dist, device: torch.device, fsdp: bool) -> nn.Module:
    """`model` as trained: sharded (FSDP2), replicated (DDP), or itself in a single process."""
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        if dist.world == 1 and not torch.distributed.is_initialized():
            raise CheckpointError("--fsdp needs torchrun (e.g. torchrun --nproc_per_node 2 -m tformer train ...)")
        for p in model.parameters():  # FSDP2 shards contiguous tensors only
            p.data = p.data.contiguous()
        for layer in (m for m in model.modules() if type(m).__name__.endswith("Layer")):
            fully_shard(layer)
        return fully_shard(model)
    if dist.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


def grad_sync(model: nn.Module, dist: Dist, fsdp: bool, last: bool):
    """Gradient accumulation: exchange gradients only in the last micro-batch's backward."""
    if dist.world == 1:
        return nullcontext()
    if fsdp:
        model.set_requires_gradient_sync(last)
        return nullcontext()
    return nullcontext() if last else model.no_sync()


def gather_model(model: nn.Module, build: Callable[[], nn.Module], main: bool) -> nn.Module | None:
    """A plain copy of the FSDP-sharded `model` (a fresh `build()` loaded with the gathered weights)
    on the main process, None on the others. Every process must call this (each shard is gathered)."""
    weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    if not main:
        return None
    plain = build()
    aliases = tied_aliases(plain)
    load_state(plain, {k: v.cpu() for k, v in weights.items() if k not in aliases}, "FSDP state")
    return plain


def shard_like(model: nn.Module, tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Optimizer state tensors ("NAME/field") sharded like the FSDP parameter NAME they belong to."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = dict(model.named_parameters())
    out = {}
    for key, t in tensors.items():
        p = params.get(key.rpartition("/")[0])
        if isinstance(p, DTensor) and t.shape == p.shape:
            t = distribute_tensor(t.to(device), p.device_mesh, p.placements)
        out[key] = t
    return out


def full_optimizer_tensors(opt: torch.optim.Optimizer, names: list[str]) -> dict[str, torch.Tensor]:
    """The whole of each sharded optimizer state tensor ("NAME/field"), on the CPU. Every process must
    call this: each takes part in gathering each shard, in the same order."""
    out = {}
    state = opt.state_dict()["state"]
    for idx in sorted(state):
        for field, v in state[idx].items():
            if hasattr(v, "full_tensor"):
                out[f"{names[idx]}/{field}"] = v.full_tensor().cpu()
    return out
