"""A method's rows in the accuracy benchmark: fixed parameters and a grid swept on validation data."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Setting:
    """One row of the accuracy benchmark for a method: fixed ``params``, and a ``grid`` swept on validation data.

    The row's candidates are every combination of the grid's values (first key outermost), each with
    ``params``; the benchmark reports the best on validation data. ``label`` names the row in result files.
    """

    label: str
    title: str
    params: Mapping[str, Any] = field(default_factory=dict)
    grid: Mapping[str, Sequence[Any]] = field(default_factory=dict)

    def candidates(self) -> tuple[dict[str, Any], ...]:
        """The parameter sets of this row, in grid order."""
        keys = list(self.grid)
        combos = itertools.product(*self.grid.values())
        return tuple({**self.params, **dict(zip(keys, combo, strict=True))} for combo in combos)
