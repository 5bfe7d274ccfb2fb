"""The rows of the accuracy benchmark's tables: which candidate merges each row chooses among.

The main table has one row per :class:`specmerge.methods.Setting` of every registered method, in the
registry's order: a method declares its benchmark rows (fixed parameters, and a grid swept on the
validation splits) where it is registered, so a new method is benchmarked without a change here. The
WUDI step sweep (and D C⁺, its infinite-step limit) and the AdaMerging rows (a chosen merge adapted on the
unlabeled test inputs, :mod:`specmerge_bench.accuracy.adamerging`) are this benchmark's own experiments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from specmerge.methods import candidate_settings
from specmerge_bench.accuracy.merging import Candidate

# (row, against): the paper's orderings, the closed-form filters first (sections 5-6: D C+ -> SWUDI-A, the
# iterative methods, TSV-M and Iso-C)
CLAIMS = (
    ("swudi_a_psqrt", "closed_form"),
    ("swudi", "closed_form"),
    ("swudi_a_psqrt", "wudi"),
    ("swudi", "wudi"),
    ("swudi_a_psqrt", "optmerge"),
    ("swudi", "optmerge"),
    ("swudi_a_psqrt", "tsv_m"),
    ("swudi", "tsv_m"),
    ("swudi_a_psqrt", "iso_c"),
    ("swudi_a_psqrt", "swudi"),
)
WUDI_STEPS = (100, 200, 300, 500, 700, 1000, 1500, 2000, 3000, 5000)  # one WUDI run per seed, with snapshots


@dataclass(frozen=True)
class Row:
    """One line of the results table: the candidates whose best (on val) setting it reports."""

    label: str
    title: str
    candidates: tuple[Candidate, ...]


def method_rows(grids: Mapping[str, Mapping[str, Sequence[Any]]] | None = None) -> list[Row]:
    """The rows of the main table, in display order: every setting of every registered method.

    ``grids`` (row label -> parameter -> values) replaces the grid values of the rows it names, e.g. a
    smaller grid in a test; the candidates' parameters and keys are otherwise those the methods declare.
    """
    rows = []
    for method, setting in candidate_settings():
        if grids and setting.label in grids:
            setting = replace(setting, grid={**setting.grid, **grids[setting.label]})
        candidates = tuple(Candidate(setting.label, method.name, params) for params in setting.candidates())
        rows.append(Row(setting.label, setting.title, candidates))
    return rows


def step_rows() -> list[Row]:
    """The WUDI step sweep (and D C⁺, its limit)."""
    rows = [Row(f"wudi_{s}", f"WUDI {s} steps", (Candidate(f"wudi_{s}", "wudi", {"steps": s}),)) for s in WUDI_STEPS]
    return [*rows, Row("closed_form", "D C⁺ (closed form)", (Candidate("closed_form", "closed_form", {}),))]


@dataclass(frozen=True)
class AdaMergingRow:
    """A row that adapts the merge its ``anchor`` row chose on val with AdaMerging; shown next to that row."""

    label: str
    title: str
    anchor: str


ADAMERGING_ROWS = (
    AdaMergingRow("swudi_adamerging", "SWUDI → AdaMerging", "swudi"),
    AdaMergingRow("swudi_a_psqrt_adamerging", "SWUDI-A → AdaMerging", "swudi_a_psqrt"),
)


@dataclass(frozen=True)
class AdaMergingSettings:
    """The AdaMerging rows' Adam steps and learning rate, inputs per step (split evenly over the tasks) and the seed
    of their order; the defaults' cost is estimated in :mod:`specmerge_bench.accuracy.adamerging`."""

    steps: int = 200
    lr: float = 1e-3
    batch_size: int = 256
    seed: int = 0

    def describe(self) -> str:
        return f"steps={self.steps}, lr={self.lr}, batch_size={self.batch_size}, seed={self.seed}"


ADAMERGING = AdaMergingSettings()  # the AdaMerging rows' default settings
