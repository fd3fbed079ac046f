"""Train / validation / test: a data set cut into three splits that never share an item.

    test        `test_fraction` of the units, drawn by TEST_SEED alone: every run on a data set is tested
                on the same items whatever its --seed (a fixed test set, as a benchmark has); what
                `tformer eval` reports, never looked at while training
    validation  `val_fraction` of the units, drawn by the run's --seed from the rest: what training looks
                at (validation loss, --keep-best, the recipe's choices)
    train       the rest

A unit is what is held out whole: a row, a tweet, a Bible chapter. A text the data repeats is kept apart
by content too (`apart`): a text in test leaves validation and training, one in validation leaves
training (tformer-instruct's rule, tformer.data.instruct). A text (a language model's) is cut in three
consecutive parts instead (`split_text3`): no sentence is on two sides.

`test_fraction` 0 is the split of a run without a test split (a user's file by default, a run recorded
before test splits existed): data.files' seeded two-way split, unchanged, its held-out part validates.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from ..errors import DataError
from .files import split_rows, split_text

SPLITS = ("train", "validation", "test")
TEST_SEED = 0   # the test split's own seed: fixed, so a data set's test split is one set of items
T = TypeVar("T")


def check_fractions(val_fraction: float, test_fraction: float) -> None:
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"validation fraction {val_fraction} must be between 0 and 1")
    if not 0.0 <= test_fraction < 1.0 or val_fraction + test_fraction >= 1.0:
        raise DataError(f"test fraction {test_fraction} must be in [0, 1) and leave data to train on "
                        f"(with validation fraction {val_fraction})")


def three_way(units: Sequence[T], val_fraction: float, test_fraction: float, seed: int,
              test_seed: int = TEST_SEED) -> dict[str, list[T]]:
    """{"train", "validation", "test"}: disjoint lists of `units` (each in the order of `units`), the
    same for the same arguments on every machine. test_fraction 0: data.files.split_rows(units,
    val_fraction, seed) as train and validation, no test."""
    check_fractions(val_fraction, test_fraction)
    if test_fraction == 0.0:
        train, val = split_rows(list(units), val_fraction, seed)
        return {"train": train, "validation": val, "test": []}
    n = len(units)
    n_test, n_val = max(1, round(test_fraction * n)), max(1, round(val_fraction * n))
    if n - n_test - n_val < 1:
        raise DataError(f"{n} item(s) are too few for a training, a validation and a test split (give more "
                        "data, or --test-fraction 0 for no test split)")
    test = set(random.Random(f"test-{test_seed}").sample(range(n), n_test))
    rest = [i for i in range(n) if i not in test]
    val = set(random.Random(f"validation-{seed}").sample(rest, n_val))
    picked = {"train": [i for i in rest if i not in val], "validation": sorted(val), "test": sorted(test)}
    return {name: [units[i] for i in rows] for name, rows in picked.items()}


def apart(splits: dict[str, list[int]], key: Callable[[int], Hashable]) -> dict[str, list[int]]:
    """`splits` (rows by split) without a row whose content (`key(row)`) is in an earlier split of
    test, validation, train: a text the data repeats is scored only where it was never trained on."""
    seen: set = set()
    out = {}
    for name in ("test", "validation", "train"):
        out[name] = [i for i in splits[name] if key(i) not in seen]
        seen |= {key(i) for i in out[name]}
    return out


def split_text3(text: str, val_fraction: float, test_fraction: float) -> dict[str, str]:
    """A text in three consecutive parts: train (the start), validation, test (the last test_fraction).
    test_fraction 0: data.files.split_text's two parts, no test."""
    check_fractions(val_fraction, test_fraction)
    if test_fraction == 0.0:
        train, val = split_text(text, val_fraction)
        return {"train": train, "validation": val, "test": ""}
    first, last = int(len(text) * (1.0 - val_fraction - test_fraction)), int(len(text) * (1.0 - test_fraction))
    return {"train": text[:first], "validation": text[first:last], "test": text[last:]}
