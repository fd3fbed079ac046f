"""Forward hooks that record what every submodule of a model received and returned, in order."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass
class Call:
    start: int      # sequence numbers of entering and leaving the module
    end: int
    args: tuple
    kwargs: dict
    output: object


class Recorder:
    """Forward hooks on every submodule: `calls[module]` = each call's inputs and output, in order."""

    def __init__(self, model: nn.Module):
        self.calls: dict[nn.Module, list[Call]] = {}
        self._clock, self._open, self._handles = 0, {}, []
        for m in model.modules():
            self._handles.append(m.register_forward_pre_hook(self._enter, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._leave, with_kwargs=True))

    def _enter(self, module, args, kwargs):
        self._clock += 1
        self._open.setdefault(module, []).append(self._clock)

    def _leave(self, module, args, kwargs, output):
        self._clock += 1
        start = self._open[module].pop()
        self.calls.setdefault(module, []).append(Call(start, self._clock, args, kwargs, output))

    def within(self, module: nn.Module | None, parent: Call) -> list[Call]:
        """Calls of `module` made while `parent` was running."""
        return [c for c in self.calls.get(module, []) if parent.start < c.start and c.end < parent.end]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
