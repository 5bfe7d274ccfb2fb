"""The shard writer: a merged model's safetensors files, streamed one tensor (or row block) at a time.

:class:`ShardWriter` computes every shard's header from the planned names, shapes and dtypes, so each
tensor can be written at its final offset as soon as it is ready, in any order, and peak memory stays
about one tensor. The folder it writes into is made all-or-nothing by
:func:`specmerge.io.output.folder.atomic_directory`; the model's other files come from
:mod:`specmerge.io.output.model_files`.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from specmerge.io.formats.names import SAFETENSORS_INDEX, safetensors_dtype, shard_name
from specmerge.io.formats.protocol import TensorInfo

SYNC_BYTES = 64 * 2**20  # an open shard is synced in the background every time this much more is written


@dataclass(frozen=True)
class _Slot:
    info: TensorInfo
    shard: int
    offset: int  # absolute byte offset of the tensor's data in its file


class ShardWriter:
    """Streams tensors into sharded safetensors files whose headers are computed up front.

    Tensors go to shards in the given order; a new shard starts when the next tensor would push the
    current one past ``max_shard_bytes`` (a larger tensor gets a shard of its own). One shard is written
    as ``model.safetensors``; several as ``model-00001-of-0000K.safetensors`` plus
    ``model.safetensors.index.json``. Within a shard, tensors are laid out by decreasing element size
    (stable), as safetensors itself does, so that every tensor's data is aligned to its element size.
    Each file is created (size reserved, all zeros) at its first ``write``, gets its header only once
    all its tensors are in, and is closed then: a shard left unfinished by a crash or a kill has a
    header length of 0 and loads nowhere, instead of loading with most tensors zero. With ``fsync``
    (default) its bytes are flushed to disk in the background as they are written (every
    ``SYNC_BYTES``) and once more when full, and ``close`` returns only when all are on disk.
    ``write`` is safe to call from several threads.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        tensors: Sequence[TensorInfo],
        max_shard_bytes: int = 5 * 2**30,
        metadata: dict[str, str] | None = None,
        fsync: bool = True,
    ) -> None:
        self.directory = Path(directory)
        self._fsync = fsync
        if not self.directory.is_dir():
            raise ValueError(f"output folder {self.directory} does not exist; create it first")
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        metadata = dict(metadata or {})
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ValueError(f"safetensors metadata must map strings to strings, got {key!r}: {value!r}")
        self._metadata = {"format": "pt", **metadata}

        shards = _plan_shards(tensors, max_shard_bytes)
        count = len(shards)
        self.files = [self.directory / shard_name(i, count) for i in range(count)]
        self._index = self.directory / SAFETENSORS_INDEX if count > 1 else None
        for path in [*self.files, *([self._index] if self._index else [])]:
            if path.exists():
                raise ValueError(f"{path} already exists; write into an empty folder")

        self._slots: dict[str, _Slot] = {}
        self._headers: list[bytes] = []
        self._sizes: list[int] = []
        for shard, infos in enumerate(shards):
            header, offsets = self._header(infos)
            self._headers.append(header)
            self._sizes.append(len(header) + sum(info.nbytes for info in infos))
            for info in infos:
                self._slots[info.name] = _Slot(info, shard, offsets[info.name])
        self._plan = [info.name for infos in shards for info in infos]
        self._remaining = [len(infos) for infos in shards]
        self._fds: dict[int, int] = {}
        self._flushes: list[Future] = []  # fdatasync / fsync + close of shards, on a background thread
        self._flusher: ThreadPoolExecutor | None = None
        self._unsynced: dict[int, int] = {}  # bytes written to an open shard since its last sync was started
        self._syncing: dict[int, Future] = {}
        self._written: set[str] = set()
        self._partial: dict[str, int] = {}  # bytes written so far of tensors written in row blocks
        self._lock = threading.Lock()
        self._closed = False

    @property
    def total_size(self) -> int:
        """Bytes of tensor data in all shards (the index's ``total_size``)."""
        return sum(slot.info.nbytes for slot in self._slots.values())

    def write(self, name: str, tensor: torch.Tensor, *, row_start: int | None = None) -> None:
        """Write one planned tensor at its offset; shape and dtype must match the plan exactly.

        With ``row_start`` the tensor is a block of rows (dim 0) of the planned tensor, written at
        its place; the tensor counts as written once all its bytes are in. Blocks must not overlap.
        """
        slot, offset, complete, fd = self._accept(name, tuple(tensor.shape), tensor.dtype, row_start)
        try:
            if tensor.numel():
                _pwrite_all(fd, _tensor_bytes(tensor), offset, self._lock)
        except BaseException:
            with self._lock:
                self._written.discard(name)  # close() then reports it as never written
            raise
        self._record(slot, complete, tensor.numel() * tensor.dtype.itemsize)

    def placements(self) -> dict[str, Placement]:
        """Where every planned tensor goes, for other processes to write it with :func:`write_at`; every shard
        file is created (its size reserved) first. Each tensor so written is then declared with :meth:`written`."""
        with self._lock:
            if self._closed:
                raise ValueError("cannot hand out placements: the writer is closed")
            for shard in range(len(self.files)):
                if shard not in self._fds and self._remaining[shard]:
                    self._fds[shard] = self._create(shard)
            return {
                name: Placement(str(self.files[slot.shard]), slot.offset, slot.info.shape, slot.info.dtype)
                for name, slot in self._slots.items()
            }

    def written(self, name: str, shape: Sequence[int], dtype: torch.dtype, *, row_start: int | None = None) -> None:
        """Declare a tensor (or block of rows) of this shape and dtype written at its placement by another process;
        checked and counted as :meth:`write` does (the shard's header follows once all its tensors are in)."""
        slot, _, complete, _ = self._accept(name, tuple(shape), dtype, row_start)
        self._record(slot, complete, math.prod(shape) * dtype.itemsize)

    def _accept(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, row_start: int | None
    ) -> tuple[_Slot, int, bool, int]:
        """Check a tensor (or block) against the plan and reserve it: its slot, byte offset, whether it completes
        the tensor, and its shard's open file."""
        with self._lock:
            if self._closed:
                raise ValueError(f"cannot write tensor '{name}': the writer is closed")
            slot = self._slots.get(name)
            if slot is None:
                raise ValueError(f"tensor '{name}' is not in the write plan ({len(self._slots)} planned tensors)")
            if name in self._written:
                raise ValueError(f"tensor '{name}' was already written")
            offset = _offset(slot.info, slot.offset, shape, dtype, row_start)
            complete = True
            if row_start is not None:
                self._partial[name] = self._partial.get(name, 0) + math.prod(shape) * dtype.itemsize
                complete = self._partial[name] >= slot.info.nbytes
            fd = self._fds.get(slot.shard)
            if fd is None:
                fd = self._fds[slot.shard] = self._create(slot.shard)
            if complete:
                self._written.add(name)  # reserved; the bytes are written outside the lock
        return slot, offset, complete, fd

    def _record(self, slot: _Slot, complete: bool, nbytes: int) -> None:
        """After a tensor's bytes are in: finish its shard when it was the last, else sync in the background."""
        with self._lock:
            if complete:
                self._remaining[slot.shard] -= 1
                if self._remaining[slot.shard] == 0:
                    self._finish(slot.shard)
                    return
            if self._fsync:
                self._unsynced[slot.shard] = self._unsynced.get(slot.shard, 0) + nbytes
                if self._unsynced[slot.shard] >= SYNC_BYTES:
                    self._start_sync(slot.shard)

    def close(self) -> list[Path]:
        """Check every planned tensor was written, write the index when sharded; return the files written."""
        with self._lock:
            if self._closed:
                return list(self.files)
            missing = [name for name in self._plan if name not in self._written]
            if missing:
                self._abort()
                shown = ", ".join(f"'{n}'" for n in missing[:5]) + (", ..." if len(missing) > 5 else "")
                raise ValueError(f"{len(missing)} planned tensor(s) were never written: {shown}")
            if any(self._remaining):
                raise ValueError("cannot close the writer while tensors are still being written")
            for shard, remaining in enumerate(self._remaining):
                if remaining == 0 and shard not in self._fds and not self.files[shard].exists():
                    self._fds[shard] = self._create(shard)  # a shard without tensors (empty plan)
                    self._finish(shard)
            self._wait_for_flushes()  # every shard is on disk before the index names it
            if self._index is not None:
                weight_map = {name: self.files[self._slots[name].shard].name for name in self._plan}
                index = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
                self._index.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
            self._closed = True
            return [*self.files, *([self._index] if self._index else [])]

    def abort(self) -> None:
        """Close open files without checking; what was written stays (``atomic_directory`` removes it)."""
        with self._lock:
            self._abort()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _header(self, infos: list[TensorInfo]) -> tuple[bytes, dict[str, int]]:
        header: dict[str, object] = {"__metadata__": self._metadata}
        start = 0
        relative: dict[str, int] = {}
        for info in sorted(infos, key=lambda i: -i.dtype.itemsize):  # stable: plan order within a dtype size
            header[info.name] = {
                "dtype": safetensors_dtype(info.dtype),
                "shape": list(info.shape),
                "data_offsets": [start, start + info.nbytes],
            }
            relative[info.name] = start
            start += info.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        prefix = struct.pack("<Q", len(raw)) + raw
        return prefix, {name: len(prefix) + offset for name, offset in relative.items()}

    def _create(self, shard: int) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
        fd = os.open(self.files[shard], flags, 0o644)
        try:
            os.ftruncate(fd, self._sizes[shard])  # the header comes last, in _finish
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _finish(self, shard: int) -> None:
        """Write a full shard's header, then hand it to the flusher thread: fsync then close, while the next
        shards are written."""
        fd = self._fds.pop(shard)
        try:
            _pwrite_all(fd, memoryview(self._headers[shard]), 0, None)
        except BaseException:
            os.close(fd)
            raise
        if self._fsync:
            self._flushes.append(self._flush_pool().submit(_fsync_and_close, fd))
        else:
            os.close(fd)

    def _start_sync(self, shard: int) -> None:
        """Start writing an open shard's new bytes to disk in the background (unless a sync is running), so
        the fsync at its end has little left to do: the disk works while we compute (BENCHMARKS.md, issue 6)."""
        running = self._syncing.get(shard)
        if running is not None and not running.done():
            return
        self._unsynced[shard] = 0
        self._syncing[shard] = self._flush_pool().submit(getattr(os, "fdatasync", os.fsync), self._fds[shard])
        self._flushes.append(self._syncing[shard])

    def _flush_pool(self) -> ThreadPoolExecutor:
        if self._flusher is None:
            self._flusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specmerge-fsync")
        return self._flusher

    def _wait_for_flushes(self, raise_errors: bool = True) -> None:
        flushes, self._flushes = self._flushes, []
        if self._flusher is not None:
            self._flusher.shutdown(wait=True)
            self._flusher = None
        if raise_errors:
            for flush in flushes:
                flush.result()

    def _abort(self) -> None:
        self._wait_for_flushes(raise_errors=False)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._closed = True


@dataclass(frozen=True)
class Placement:
    """Where one planned tensor's bytes go: its shard file (created by :meth:`ShardWriter.placements`), the byte
    offset of its data there, its shape and dtype. Picklable: another process writes with :func:`write_at`."""

    path: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def write_at(placement: Placement, name: str, tensor: torch.Tensor, *, row_start: int | None = None) -> None:
    """Write ``tensor`` (or a block of rows from ``row_start``) at its placement, from any process: the file is
    opened for writing only (never created or truncated), written with positional writes, and closed."""
    info = TensorInfo(name, placement.shape, placement.dtype)
    offset = _offset(info, placement.offset, tuple(tensor.shape), tensor.dtype, row_start)
    if not tensor.numel():
        return
    fd = os.open(placement.path, os.O_WRONLY | getattr(os, "O_BINARY", 0))
    try:
        _pwrite_all(fd, _tensor_bytes(tensor), offset, None)
    finally:
        os.close(fd)


def _offset(expected: TensorInfo, start: int, shape: tuple[int, ...], dtype: torch.dtype, row_start: int | None) -> int:
    """The byte offset in its file of a tensor (or a block of rows from ``row_start``) of this shape and dtype, the
    planned tensor ``expected`` starting at ``start``; a shape or dtype that does not fit it is refused, naming it."""
    name = expected.name
    if row_start is None:
        if shape != expected.shape or dtype != expected.dtype:
            raise ValueError(
                f"tensor '{name}': expected shape {list(expected.shape)} {expected.dtype}, "
                f"got shape {list(shape)} {dtype}"
            )
        return start
    rows = shape[0] if shape else -1
    if (
        dtype != expected.dtype
        or shape[1:] != expected.shape[1:]
        or not 0 <= row_start <= row_start + rows <= (expected.shape[0] if expected.shape else -1)
    ):
        raise ValueError(
            f"tensor '{name}': rows from {row_start} of shape {list(shape)} {dtype} do not "
            f"fit the planned shape {list(expected.shape)} {expected.dtype}"
        )
    return start + row_start * (expected.nbytes // expected.shape[0])


def _fsync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _plan_shards(tensors: Sequence[TensorInfo], max_shard_bytes: int) -> list[list[TensorInfo]]:
    shards: list[list[TensorInfo]] = [[]]
    size = 0
    seen: set[str] = set()
    for info in tensors:
        if info.name in seen:
            raise ValueError(f"tensor '{info.name}' appears twice in the write plan")
        seen.add(info.name)
        safetensors_dtype(info.dtype)
        if shards[-1] and size + info.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(info)
        size += info.nbytes
    return shards


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy when it is already contiguous on CPU (works for bf16 and fp8)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _pwrite_all(fd: int, data: memoryview, offset: int, lock: threading.Lock | None) -> None:
    while data:
        if hasattr(os, "pwrite"):
            n = os.pwrite(fd, data, offset)
        else:  # no positional write (Windows): seek and write under the writer's lock
            with lock or threading.Lock():
                os.lseek(fd, offset, os.SEEK_SET)
                n = os.write(fd, data)
        data = data[n:]
        offset += n
