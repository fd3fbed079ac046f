"""Where this process stands under `torchrun`: rank, world size, and the few collective operations
the training loop needs (PyTorch's own process group; gloo on CPU, nccl on GPU). World 1 without
torchrun, when every operation is a no-op."""

from __future__ import annotations

import os

import torch


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
