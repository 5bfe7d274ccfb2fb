"""What every checkpoint reader is: a :class:`TensorSource` that names its tensors and reads one at a time.

Readers per format implement it (:mod:`specmerge.io.formats.safetensors_format`,
:mod:`specmerge.io.formats.torch_format`; :func:`specmerge.io.formats.sources.open_source` picks one for a path). A
reader knows every tensor's name, shape and dtype (:class:`TensorInfo`) without reading tensor data, and reads one
tensor, or a block of its rows, per ``load``, so peak memory stays about one tensor whatever the model size. Whatever
goes wrong with a file is a :class:`SourceError`: one line naming the file or tensor and what to do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Self, runtime_checkable

import torch

from specmerge.errors import SpecmergeError, closest_name


class SourceError(SpecmergeError):
    """A checkpoint cannot be opened or read; the message names the file or tensor and what to do."""


def no_such_tensor(where: str, name: str, names: list[str]) -> SourceError:
    """The error for a tensor ``name`` that the source ``where`` does not hold, with the closest of its ``names``."""
    close = closest_name(name, names)
    hint = f"did you mean '{close}'? " if close else ""
    return SourceError(f"{where}: no tensor named '{name}'; {hint}({len(names)} tensors)")


@dataclass(frozen=True)
class TensorInfo:
    """Name, shape and dtype of one stored tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


Rows = tuple[int, int] | None  # a block of rows start:stop of a tensor (dim 0), or None for the whole tensor


def row_ranges(shape: tuple[int, ...], itemsize: int, block_bytes: int) -> list[Rows]:
    """Blocks of rows of a tensor of ``shape`` holding at most ``block_bytes`` each (at least one row), in
    order; ``[None]`` (the whole tensor at once) when one block holds it all or it has no rows."""
    if not shape or shape[0] == 0:
        return [None]
    rows = shape[0]
    row_bytes = max(1, math.prod(shape) // rows * itemsize)
    per_block = max(1, block_bytes // row_bytes)
    if per_block >= rows:
        return [None]
    return [(start, min(start + per_block, rows)) for start in range(0, rows, per_block)]


class Closing:
    """A reader used in a ``with`` block: leaving the block calls ``close()`` (the subclass defines it)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@runtime_checkable
class TensorSource(Protocol):
    """A checkpoint read one tensor at a time."""

    path: Path

    def infos(self) -> dict[str, TensorInfo]:
        """All tensors, in checkpoint order, known without reading tensor data."""
        ...

    def load(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """One tensor, on CPU, in its stored dtype; ``rows=(start, stop)`` reads only those rows (dim 0)."""
        ...

    def describe(self) -> str:
        """A short human-readable description (kind and location)."""
        ...

    def close(self) -> None:
        """Release file handles."""
        ...

    def files(self) -> list[Path]:
        """The real paths (links resolved) of every file the source reads: its index, if any, and its weights."""
        ...
