"""Lazy views of a base and its experts whose vocabulary tensors have the output vocabulary's rows.

A :class:`RowMap` says, for every output row of the vocabulary tensors, which row of the base and of each expert
holds it (-1: none). :func:`aligned_views` wraps the inputs whose rows differ from the output's:

- :class:`AlignedBase` serves an output row from the base's row, or, where the base has none (a token the base
  lacks), the average of the rows of the experts that have it (float32, float64 when an input is, cast to the
  base's dtype);
- :class:`AlignedExpert` (a full checkpoint) serves its own row, or where it has none the base view's row, so
  that its task vector there is zero; its vocabulary tensors are in its own dtype, or in the common dtype of its
  and the base's when some rows are the base view's (exact: both convert to it without rounding);
- :class:`AlignedAdapter`: a LoRA adapter that does not change the vocabulary tensors, with their output shape.

Every other tensor is read from the input unchanged. A block of rows is read as the runs of consecutive source
rows it maps to (one read of rows ``start:stop`` per run; a block that is one run is that read itself, no
copy), never the whole tensor; the views own no file (their
``close`` leaves the inputs to whoever opened them). Experts are read through the
:class:`~specmerge.io.views.experts.Expert` interface, so views of renamed experts (:mod:`specmerge.io.views.aligned`)
work the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specmerge.io.formats.protocol import Rows, SourceError, TensorInfo, TensorSource
from specmerge.io.views.experts import Expert
from specmerge.io.views.task_vectors import Dense, TaskVector, Zero

if TYPE_CHECKING:
    from specmerge.io.output.tokenizers import TokenVocabulary


def runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """The maximal runs ``(start, stop, source)`` of ``index`` (a 1-D int64 tensor) where ``index[start + k] =
    source + k`` and source >= 0; entries below 0 belong to no run."""
    valid = index >= 0
    if not bool(valid.any()):
        return []
    follows = torch.zeros_like(valid)
    follows[1:] = valid[1:] & valid[:-1] & (index[1:] == index[:-1] + 1)
    first = valid & ~follows
    segment = torch.cumsum(first.to(torch.int64), 0)
    lengths = torch.bincount(segment[valid])[1:]
    starts = torch.nonzero(first).flatten()
    return [(int(s), int(s) + int(n), int(index[s])) for s, n in zip(starts, lengths, strict=True)]


def positions(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` as an index for :func:`runs`: each True entry's own position, -1 elsewhere (runs of True)."""
    return torch.where(mask, torch.arange(len(mask)), torch.full_like(mask, -1, dtype=torch.int64))


@dataclass(frozen=True)
class RowMap:
    """Which row of the base (``base``) and of each expert (``experts[i]``) holds each of the ``rows`` output rows
    of the vocabulary tensors; -1 where that input has none."""

    rows: int
    base: torch.Tensor
    experts: list[torch.Tensor]

    @classmethod
    def build(
        cls,
        out: TokenVocabulary,
        rows: int,
        base: TokenVocabulary,
        base_rows: int,
        vocabs: Sequence[TokenVocabulary],
        expert_rows: Sequence[int],
    ) -> RowMap:
        """Output row of token t: each input's row of t (by its tokenizer). A row that is no output token (padding)
        is taken by index from each input that has it as padding too (the base: any row it has)."""
        index = torch.arange(rows)
        token_rows = list(out.ids.values())
        base_map = torch.where(index < base_rows, index, -1)
        base_map[token_rows] = torch.tensor([base.ids.get(t, -1) for t in out.ids], dtype=torch.int64)
        maps = []
        for vocab, n in zip(vocabs, expert_rows, strict=True):
            padding = index < n
            padding[[i for i in vocab.ids.values() if i < rows]] = False
            found = torch.where(padding, index, -1)
            found[token_rows] = torch.tensor([vocab.ids.get(t, -1) for t in out.ids], dtype=torch.int64)
            maps.append(found)
        orphan = (base_map < 0) & ~torch.stack(maps).ge(0).any(dim=0) if maps else base_map < 0
        if bool(orphan.any()):
            row = int(torch.nonzero(orphan)[0])
            raise SourceError(f"output vocabulary row {row} is held by neither the base nor any expert")
        return cls(rows, base_map, maps)


def aligned_views(
    base: TensorSource, experts: Sequence[Expert], names: Sequence[str], row_map: RowMap
) -> tuple[TensorSource, list[Expert]]:
    """The base and experts as views with the output rows in the vocabulary tensors ``names``; an input whose
    rows are already the output's is returned as it is. LoRA adapters must not change those tensors."""
    identity = torch.arange(row_map.rows)
    view = base
    if not _same(row_map.base, identity, base.infos()[names[0]].shape[0]):
        view = AlignedBase(base, experts, names, row_map)
    aligned: list[Expert] = []
    for i, expert in enumerate(experts):
        rows = expert.infos()[names[0]].shape[0] if names[0] in expert.infos() else row_map.rows
        if expert.low_rank:
            aligned.append(expert if rows == row_map.rows else AlignedAdapter(expert, names, row_map.rows))
        else:
            same = _same(row_map.experts[i], identity, rows)
            aligned.append(expert if same else AlignedExpert(expert, view, names, row_map, i))
    return view, aligned


def _same(mapping: torch.Tensor, identity: torch.Tensor, rows: int) -> bool:
    return rows == len(identity) and bool(torch.equal(mapping, identity))


def _resized(infos: Mapping[str, TensorInfo], names: frozenset[str], rows: int, dtype: Any) -> dict[str, TensorInfo]:
    """``infos`` with the tensors ``names`` given ``rows`` rows and the dtype ``dtype(info)``."""
    return {
        name: TensorInfo(name, (rows, *info.shape[1:]), dtype(info)) if name in names else info
        for name, info in infos.items()
    }


def _whole(found: list[tuple[int, int, int]], rows: int) -> bool:
    """Whether the runs ``found`` of a block of ``rows`` rows are one run that covers it."""
    return len(found) == 1 and found[0][:2] == (0, rows)


def _weight(value: TaskVector, name: str, what: str) -> torch.Tensor:
    if not isinstance(value, Dense):
        raise SourceError(f"{what} holds no weights of its own for '{name}', so its rows cannot be matched by token")
    return value.weight


def _block(info: TensorInfo, rows: Rows) -> tuple[int, int, torch.Tensor]:
    start, stop = (0, info.shape[0]) if rows is None else rows
    return start, stop, torch.empty((stop - start, *info.shape[1:]), dtype=info.dtype)


class AlignedBase:
    """The base with its vocabulary tensors in the output's rows; rows it lacks are its holders' average."""

    def __init__(self, source: TensorSource, experts: Sequence[Expert], names: Sequence[str], row_map: RowMap) -> None:
        self.source, self.experts, self.names, self.row_map = source, list(experts), frozenset(names), row_map
        self.path: Path = source.path
        self._infos = _resized(source.infos(), self.names, row_map.rows, lambda info: info.dtype)

    def infos(self) -> dict[str, TensorInfo]:
        return self._infos

    def load(self, name: str, rows: Rows = None) -> torch.Tensor:
        if name not in self.names:
            return self.source.load(name, rows)
        start, stop, out = _block(self._infos[name], rows)
        index = self.row_map.base[start:stop]
        found = runs(index)
        if _whole(found, stop - start):  # one run of the base's rows: read as they are, no copy
            return self.source.load(name, (found[0][2], found[0][2] + stop - start))
        for a, b, src in found:
            out[a:b] = self.source.load(name, (src, src + b - a))
        lacking = torch.nonzero(index < 0).flatten()
        if len(lacking):
            out[lacking] = self._average(name, lacking + start).to(out.dtype)
        return out

    def _average(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """The mean of the holders' rows for output ``rows`` (each has at least one holder), in float32 (float64
        when the base or an expert is float64)."""
        dtypes = [self.source.infos()[name].dtype] + [e.infos()[name].dtype for e in self.experts if name in e.infos()]
        dtype = torch.float64 if torch.float64 in dtypes else torch.float32
        total = torch.zeros((len(rows), *self._infos[name].shape[1:]), dtype=dtype)
        count = torch.zeros(len(rows), dtype=dtype)
        for i, expert in enumerate(self.experts):
            held = self.row_map.experts[i][rows]
            if expert.low_rank or not bool((held >= 0).any()):
                continue
            for a, b, src in runs(held):
                total[a:b] += _weight(expert.read(name, (src, src + b - a)), name, str(expert.path)).to(dtype)
            count += (held >= 0).to(dtype)
        return total / count.reshape(-1, *([1] * (total.dim() - 1)))

    def describe(self) -> str:
        return f"{self.source.describe()}, vocabulary rows matched by token"

    def files(self) -> list[Path]:
        return self.source.files()

    def close(self) -> None:
        """Nothing: the base is closed by whoever opened it."""


class AlignedExpert:
    """Expert ``i`` (a full checkpoint) with its vocabulary tensors in the output's rows; a row it lacks is the
    base view's (a zero task vector)."""

    low_rank = False

    def __init__(self, expert: Expert, base: TensorSource, names: Sequence[str], row_map: RowMap, i: int) -> None:
        self.expert, self.base, self.names, self.index = expert, base, frozenset(names), row_map.experts[i]
        self.path: Path = expert.path
        lacks = bool((self.index < 0).any())
        base_infos = base.infos()

        def dtype(info: TensorInfo) -> torch.dtype:
            return torch.promote_types(info.dtype, base_infos[info.name].dtype) if lacks else info.dtype

        self._infos = _resized(expert.infos(), self.names, row_map.rows, dtype)

    def infos(self) -> dict[str, TensorInfo]:
        return self._infos

    def changes(self, name: str) -> bool:
        return name in self.names or self.expert.changes(name)

    def read(self, name: str, rows: Rows = None) -> TaskVector:
        if name not in self.names:
            return self.expert.read(name, rows)
        start, stop, out = _block(self._infos[name], rows)
        index = self.index[start:stop]
        found = runs(index)
        if _whole(found, stop - start) and self.expert.infos()[name].dtype == out.dtype:  # no copy
            return self.expert.read(name, (found[0][2], found[0][2] + stop - start))
        for a, b, src in found:
            out[a:b] = _weight(self.expert.read(name, (src, src + b - a)), name, str(self.path))
        for a, b, _ in runs(positions(index < 0)):
            out[a:b] = self.base.load(name, (start + a, start + b))
        return Dense(out)

    def stored_in_out_weights(self) -> frozenset[str]:
        return self.expert.stored_in_out_weights()

    def nonfinite(self, name: str, label: str) -> str | None:
        return self.expert.nonfinite(name, label)

    def describe(self) -> str:
        return f"{getattr(self.expert, 'describe', lambda: str(self.path))()}, vocabulary rows matched by token"

    def files(self) -> list[Path]:
        return self.expert.files()

    def close(self) -> None:
        """Nothing: the expert is closed by whoever opened it."""


class AlignedAdapter:
    """A LoRA adapter expert that does not change the vocabulary tensors, with their output shape (zero deltas)."""

    low_rank = True

    def __init__(self, adapter: Expert, names: Sequence[str], rows: int) -> None:
        self.adapter, self.names = adapter, frozenset(names)
        self.path: Path = adapter.path
        self._infos = _resized(adapter.infos(), self.names, rows, lambda info: info.dtype)

    def infos(self) -> dict[str, TensorInfo]:
        return self._infos

    def changes(self, name: str) -> bool:
        return name not in self.names and self.adapter.changes(name)

    def read(self, name: str, rows: Rows = None) -> TaskVector:
        if name not in self.names:
            return self.adapter.read(name, rows)
        shape = self._infos[name].shape
        return Zero(shape if rows is None else (rows[1] - rows[0], *shape[1:]))

    def stored_in_out_weights(self) -> frozenset[str]:
        return self.adapter.stored_in_out_weights()

    def nonfinite(self, name: str, label: str) -> str | None:
        return None if name in self.names else self.adapter.nonfinite(name, label)

    def describe(self) -> str:
        return f"{getattr(self.adapter, 'describe', lambda: str(self.path))()}, vocabulary rows of the base"

    def files(self) -> list[Path]:
        return self.adapter.files()

    def close(self) -> None:
        """Nothing: the adapter is closed by whoever opened it."""

    @property
    def fan_in_fan_out(self) -> bool:
        """As the adapter says (PEFT's flag for Conv1D modules)."""
        return bool(getattr(self.adapter, "fan_in_fan_out", False))
