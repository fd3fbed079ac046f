"""Argument types for numeric flags: they live in tformer.options (library code uses them too)."""

from tformer.options import (below_one, dropout, finite_float, fraction, nonneg_float, nonneg_int, number,  # noqa: F401
                             positive_float, positive_int, probability, seed, unit_open_closed)
