"""Options defined once: argument types for numeric flags, and dataclass fields that are flags.

`option(default, help, ...)` declares a field of an options dataclass together with its flag (help,
argparse type, choices) and whether it may change on `tformer train --resume`; `add_flags` derives
the argparse flags from the fields (as litgpt derives its CLI from its dataclasses).

argparse calls a flag's `type` on the text; raising `argparse.ArgumentTypeError` turns into the
one-line `error: argument --flag: ...` (exit 2) of `tformer.cli.ArgumentParser`, before any model
is loaded. NaN and infinity are refused everywhere: no flag of tformer means anything with them.

    p.add_argument("--max-new-tokens", type=nonneg_int)
    p.add_argument("--top-p", type=unit_open_closed)     # (0, 1]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import MISSING, Field, field, fields
from typing import Any, Callable

FIXED, CHANGE, ONCE = "fixed", "change", "once"  # on --resume: from the saved run / may change / this run only


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


def tokenizer_choice(text: str) -> str:
    """char, bpe, wordpiece, a shipped one by name (tformer.data.tokenizers.SHIPPED), or a tokenizer.json file
    (or a directory holding one)."""
    from pathlib import Path

    from ..data.tokenizers import SHIPPED

    if text in ("char", "bpe", "wordpiece", *SHIPPED):
        return text
    path = Path(text)
    if path.is_file() or (path / "tokenizer.json").is_file():
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither char, bpe, wordpiece nor {', '.join(SHIPPED)}, nor a "
                                     "tokenizer.json file (or a directory with one)")


def lora_target_list(text: str) -> str:
    """A comma-separated list of tformer.model.lora.TARGETS, e.g. q,v."""
    from ..model.lora import TARGETS

    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: choose among {', '.join(TARGETS)} (comma-separated)")
    return ",".join(dict.fromkeys(names))


def option(default: Any = MISSING, help: str | None = None, *, resume: str = FIXED, flag: str | None = None,
           flag_default: Any = MISSING, **argparse_kwargs: Any) -> Any:
    """A dataclass field that is also a `tformer train` flag. `resume`: FIXED (taken from the saved
    run on --resume), CHANGE (may be given again on --resume) or ONCE (this invocation only, never
    saved for a resume). `flag` overrides the flag name (default --field-name); `flag_default`
    the flag's default when it differs from the field's (None: "the task decides")."""
    kwargs = {k: v for k, v in argparse_kwargs.items() if v is not None}
    if help is not None:
        kwargs["help"] = help
    meta = {"flag": flag, "kwargs": kwargs, "resume": resume,
            "flag_default": default if flag_default is MISSING else flag_default}
    return field(metadata=meta) if default is MISSING else field(default=default, metadata=meta)


def flag_fields(cls: type, skip: type | None = None) -> list[Field]:
    """The fields of `cls` that are flags (those of `skip`, e.g. a base class, left out)."""
    own = {f.name for f in fields(skip)} if skip is not None else set()
    return [f for f in fields(cls) if "kwargs" in f.metadata and f.name not in own]


def add_flags(parser, cls: type, skip: type | None = None) -> None:
    """One argparse flag per option field of the dataclass `cls` (not those of `skip`)."""
    for f in flag_fields(cls, skip):
        name = f.metadata["flag"] or "--" + f.name.replace("_", "-")
        parser.add_argument(name, dest=f.name, default=f.metadata["flag_default"], **f.metadata["kwargs"])


def resume_rule(cls: type, rule: str) -> set[str]:
    """The names of the option fields of `cls` with this --resume rule (FIXED, CHANGE or ONCE)."""
    return {f.name for f in flag_fields(cls) if f.metadata["resume"] == rule}


def pick(cls: type, values: dict[str, Any]) -> Any:
    """An instance of the dataclass `cls` from those of `values` that are its fields (others ignored)."""
    return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})
