"""Argument types for numeric flags. They live in tformer.training.options, below the CLI, as library code
(the tasks' option fields) uses them too; the subcommands import them from here."""

from tformer.training.options import (
    below_one,
    dropout,
    finite_float,
    fraction,
    nonneg_float,
    nonneg_int,
    number,
    positive_float,
    positive_int,
    probability,
    seed,
    unit_open_closed,
)

__all__ = ["below_one", "dropout", "finite_float", "fraction", "nonneg_float", "nonneg_int", "number",
           "positive_float", "positive_int", "probability", "seed", "unit_open_closed"]
