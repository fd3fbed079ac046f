"""Argument types for numeric flags, shared by every subcommand.

argparse calls a flag's `type` on the text; raising `argparse.ArgumentTypeError` turns into the
one-line `error: argument --flag: ...` (exit 2) of `tformer.cli.ArgumentParser`, before any model
is loaded. NaN and infinity are refused everywhere: no flag of tformer means anything with them.

    p.add_argument("--max-new-tokens", type=nonneg_int)
    p.add_argument("--top-p", type=unit_open_closed)     # (0, 1]
"""

from __future__ import annotations

import argparse
import math
from typing import Callable


def number(kind: type, low: float | None = None, high: float | None = None, low_open: bool = False,
           high_open: bool = False, what: str | None = None) -> Callable[[str], float | int]:
    """A `type=` function: `kind` (int or float) within [low, high]; `low_open` / `high_open` exclude
    the ends. The error names the allowed range."""
    what = what or ("an integer" if kind is int else "a number")
    left, right = "(" if low_open else "[", ")" if high_open else "]"
    interval = f"{left}{'-inf' if low is None else f'{low:g}'}, {'inf' if high is None else f'{high:g}'}{right}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} must be a finite number")
        below = low is not None and (value < low or (low_open and value == low))
        above = high is not None and (value > high or (high_open and value == high))
        if below or above:
            raise argparse.ArgumentTypeError(f"{text!r} must be in {interval}")
        return value

    parse.__name__ = f"{kind.__name__} in {interval}"  # argparse shows the name in some messages
    return parse


positive_int = number(int, 1, what="a positive integer")
nonneg_int = number(int, 0, what="a non-negative integer")
positive_float = number(float, 0.0, low_open=True)
nonneg_float = number(float, 0.0)
finite_float = number(float)
probability = number(float, 0.0, 1.0)                            # [0, 1]
unit_open_closed = number(float, 0.0, 1.0, low_open=True)         # (0, 1]: top-p
fraction = number(float, 0.0, 1.0, low_open=True, high_open=True)  # (0, 1): a share of the data
below_one = number(float, 0.0, 1.0, high_open=True)               # [0, 1): dropout, label smoothing
dropout = below_one
seed = number(int, 0, 2**63 - 1, what="a non-negative integer")  # torch.manual_seed's range
