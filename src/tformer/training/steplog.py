"""What the training loop logs every --log-every steps: the means, over the steps since the last record,
of the train loss and of the task's own per-step metrics, and the tokens per second.

A task reports metrics of its own by defining `loss_and_metrics(model, batch) -> (loss, {name: float})`
instead of (or next to) `loss`: DPO's trl-named rewards/chosen, rewards/rejected, rewards/margins and
rewards/accuracies. They are weighted like the loss: the mean over a step's micro-batches, then over the
logged steps the guard did not skip, then over the processes under torchrun (each holds an equal share of
the rows). They go into metrics.jsonl next to train_loss and onto the progress bar.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

from torch import Tensor, nn

from .distributed import Dist

Metrics = dict[str, float]
STANDARD = ("step", "train_loss", "lr", "tokens_per_s", "elapsed")   # every record's; the rest are the task's


def no_metrics(loss: Callable[[nn.Module, dict[str, Tensor]], Tensor], model: nn.Module,
               batch: dict[str, Tensor]) -> tuple[Tensor, Metrics]:
    return loss(model, batch), {}


def loss_and_metrics(task, model: nn.Module) -> Callable[[dict[str, Tensor]], tuple[Tensor, Metrics]]:
    """batch -> (loss, metrics) of `task` on `model`: its loss_and_metrics, else its loss and no metrics."""
    both = getattr(task, "loss_and_metrics", None)
    return partial(both, model) if both is not None else partial(no_metrics, task.loss, model)


class StepLog:
    """The steps since the last record: their time, tokens, losses and task metrics."""

    def __init__(self, dist: Dist, device):
        self.dist, self.device = dist, device
        self.reset()

    def reset(self) -> None:
        self.seconds, self.tokens = 0.0, 0
        self.losses: list[float] = []
        self.metrics: dict[str, list[float]] = {}

    def add(self, result: tuple[float, Metrics] | None, tokens: int, seconds: float) -> None:
        """One optimizer step: its (loss, metrics), None when the guard skipped it (then not averaged)."""
        self.seconds += seconds
        self.tokens += tokens
        if result is None:
            return
        loss, metrics = result
        self.losses.append(loss)
        for name, value in metrics.items():
            self.metrics.setdefault(name, []).append(value)

    def record(self, step: int, lr: float, elapsed: float) -> dict[str, Any]:
        """The record of these steps (averaged over the processes, which all call this), then start anew.
        train_loss is NaN when the guard skipped every step."""
        def mean(values: list[float]) -> float:
            return self.dist.mean(sum(values) / len(values) if values else math.nan, self.device)

        record = {"step": step, "train_loss": mean(self.losses),
                  **{name: mean(values) for name, values in self.metrics.items()},
                  "lr": lr, "tokens_per_s": self.tokens / max(self.seconds, 1e-9), "elapsed": round(elapsed, 3)}
        self.reset()
        return record


def postfix(record: dict[str, Any]) -> dict[str, str]:
    """The progress bar's summary of a step record: the loss, tokens/s, then each task metric by its short name
    (rewards/margins: margins); validation's (val_*) are printed at each validation instead."""
    shown = {"loss": f"{record['train_loss']:.3f}", "tok_s": f"{record['tokens_per_s']:.0f}"}
    return shown | {k.rpartition("/")[2]: f"{v:.3g}" for k, v in record.items()
                    if k not in STANDARD and not k.startswith("val_")}
