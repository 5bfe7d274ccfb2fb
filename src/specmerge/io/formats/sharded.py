"""What the checkpoint readers share: a checkpoint stored in one or more files, optionally mapped by an index.

:class:`ShardedSource` implements :class:`~specmerge.io.formats.protocol.TensorSource` for every file format; a format
(:mod:`specmerge.io.formats.safetensors_format`, :mod:`specmerge.io.formats.torch_format`) subclasses it with how to
open one file, list its tensors and read one tensor.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from specmerge.io.formats.protocol import Closing, SourceError, TensorInfo, no_such_tensor


class ShardedSource(Closing):
    """Shared logic of a checkpoint stored in one or more files, optionally mapped by an index.

    Subclasses open one file (``open_file``), list its tensors in stored order (``file_infos``) and read one
    tensor (``read``). Files are opened lazily, at most once, and kept open until ``close``.
    """

    kind = ""

    def __init__(
        self, path: Path, files: list[Path], weight_map: dict[str, Path] | None = None, *, index: Path | None = None
    ) -> None:
        self.path = path
        self._files = files
        # Files are named by the user's paths in messages and opened by their real paths, checked by the caller.
        self.real = {file: Path(os.path.realpath(file)) for file in files}
        self._index = Path(os.path.realpath(index)) if index is not None else None
        self._weight_map = weight_map  # name -> file, when an index says which file holds which tensor
        self._handles: dict[Path, Any] = {}
        self._infos: dict[str, TensorInfo] | None = None
        self._where: dict[str, Path] = {}
        self._lock = threading.RLock()
        # run once on the tensors' infos when they are first read, before any tensor is given out (they raise)
        self.checks: list[Callable[[dict[str, TensorInfo]], None]] = []

    def describe(self) -> str:
        if len(self._files) == 1 and self._files[0] == self.path:
            return f"{self.kind} file {self.path}"
        shards = f"{len(self._files)} {self.kind} shard{'s' if len(self._files) > 1 else ''}"
        return f"{self.path} ({shards})"

    def files(self) -> list[Path]:
        return ([self._index] if self._index is not None else []) + list(self.real.values())

    def infos(self) -> dict[str, TensorInfo]:
        with self._lock:
            if self._infos is None:
                infos, where = self._collect_infos()
                for check in self.checks:
                    check(infos)
                self._infos, self._where = infos, where
            return dict(self._infos)

    def info(self, name: str) -> TensorInfo:
        """The stored tensor ``name`` (after :meth:`infos` ran)."""
        return self._infos[name]

    def load(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        self.infos()
        file = self._where.get(name)
        if file is None:
            raise no_such_tensor(self.describe(), name, list(self._where))
        if rows is not None:
            shape = self._infos[name].shape
            if not shape or not 0 <= rows[0] <= rows[1] <= shape[0]:
                raise SourceError(f"{file}: rows {rows} out of range for tensor '{name}' of shape {shape}")
        return self.read(file, self._handle(file), name, rows)

    def close(self) -> None:
        with self._lock:
            self._handles.clear()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"

    def _handle(self, file: Path) -> Any:
        with self._lock:
            if file not in self._handles:
                self._handles[file] = self.open_file(file)
            return self._handles[file]

    def _collect_infos(self) -> tuple[dict[str, TensorInfo], dict[str, Path]]:
        infos: dict[str, TensorInfo] = {}
        where: dict[str, Path] = {}
        for file in self._files:
            for info in self.file_infos(file, self._handle(file)):
                if self._weight_map is not None and self._weight_map.get(info.name) != file:
                    continue  # an index decides which file a tensor is read from
                infos[info.name] = info
                where[info.name] = file
        if self._weight_map is not None:
            for name, file in self._weight_map.items():
                if name not in where:
                    raise SourceError(
                        f"{self.path}: the index maps tensor '{name}' to {file.name}, which does not contain it; "
                        "re-download the checkpoint or fix the index"
                    )
        return infos, where

    def open_file(self, file: Path) -> Any:
        """Open one file of the checkpoint (``file`` as the user named it; open ``self.real[file]``)."""
        raise NotImplementedError

    def file_infos(self, file: Path, handle: Any) -> Iterator[TensorInfo]:
        """The tensors of one opened file, in stored order."""
        raise NotImplementedError

    def read(self, file: Path, handle: Any, name: str, rows: tuple[int, int] | None) -> torch.Tensor:
        """Tensor ``name`` (its rows ``start:stop`` when given) from one opened file, on the CPU."""
        raise NotImplementedError


def truncated(file: Path, name: str, err: EOFError, opening: bool = False) -> SourceError:
    """The error for a file that ends before tensor ``name`` does (found when ``opening`` it, or while reading)."""
    if opening:
        return SourceError(f"{file}: truncated, tensor '{name}' lies past its end ({err}); re-download the checkpoint")
    return SourceError(
        f"{file}: truncated while reading tensor '{name}' ({err}); was it changed during the merge? "
        "re-download the checkpoint and run again"
    )
