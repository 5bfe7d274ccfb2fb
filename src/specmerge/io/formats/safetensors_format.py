"""The safetensors reader: shapes and dtypes from the headers, each tensor memory-mapped on its own.

A tensor is read as a private (copy-on-write) memory map of just its byte range, faulted in on the reading
thread and unmapped when the tensor is freed, so a checkpoint's pages never pile up in the process. A file
truncated since it was opened is found (by its size, and when faulting the range in fails) and named.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from specmerge.io.formats.files import unusable
from specmerge.io.formats.names import SAFETENSORS_DTYPES
from specmerge.io.formats.protocol import SourceError, TensorInfo
from specmerge.io.formats.sharded import ShardedSource, truncated


@dataclass
class SafetensorsFile:
    """An open safetensors file: safe_open for the validated header, a plain descriptor for reading data."""

    handle: Any
    fd: int
    data_start: int
    offsets: dict[str, tuple[int, int]]

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


class SafetensorsSource(ShardedSource):
    """One or more safetensors files; shapes and dtypes come from the headers, tensors are read one at a time."""

    kind = "safetensors"

    def open_file(self, file: Path) -> SafetensorsFile:
        real = self.real.get(file, file)
        try:
            opened = SafetensorsFile(safe_open(str(real), framework="pt"), os.open(real, os.O_RDONLY), 0, {})
            (length,) = struct.unpack("<Q", os.pread(opened.fd, 8, 0))
            header = json.loads(os.pread(opened.fd, length, 8))
            opened.data_start = 8 + length
            opened.offsets = {k: tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__"}
            size = os.fstat(opened.fd).st_size
        except SafetensorError as err:  # raised by safe_open, which validates the header
            raise SourceError(
                f"{file}: not a valid safetensors file ({err}); the file may be truncated or corrupt, re-download it"
            ) from None
        except OSError as err:
            raise unusable(file, str(file), err) from None
        except (ValueError, TypeError, KeyError, struct.error) as err:  # changed since safe_open validated it
            raise SourceError(
                f"{file}: changed while being opened ({err}); open it again when it is complete"
            ) from None
        # safe_open checked every tensor's data range against the file; it may have been truncated since.
        for name, (_, stop) in opened.offsets.items():
            if opened.data_start + stop > size:
                raise truncated(file, name, EOFError(f"the file has {size} bytes"), opening=True)
        return opened

    def file_infos(self, file: Path, handle: SafetensorsFile) -> Iterator[TensorInfo]:
        for name in handle.handle.offset_keys():  # stored order, not alphabetical
            piece = handle.handle.get_slice(name)
            code = piece.get_dtype()
            dtype = SAFETENSORS_DTYPES.get(code)
            if dtype is None:
                raise SourceError(
                    f"{file}: tensor '{name}' has dtype {code}, which torch {torch.__version__} cannot hold; "
                    "upgrade torch or convert the checkpoint"
                )
            yield TensorInfo(name, tuple(piece.get_shape()), dtype)

    def read(self, file: Path, handle: SafetensorsFile, name: str, rows: tuple[int, int] | None) -> torch.Tensor:
        info = self.info(name)
        start, stop = handle.offsets[name]
        shape = list(info.shape)
        if rows is not None:
            row_bytes = info.nbytes // shape[0] if shape[0] else 0
            start, stop = start + rows[0] * row_bytes, start + rows[1] * row_bytes
            shape[0] = rows[1] - rows[0]
        if stop == start:
            return torch.empty(shape, dtype=info.dtype)
        start, stop = handle.data_start + start, handle.data_start + stop
        try:
            return mapped(handle.fd, start, stop, info.dtype).reshape(shape)
        except EOFError as err:
            raise truncated(file, name, err) from None
        except OSError:  # a file system without memory maps: plain reads into a fresh buffer
            pass
        buffer = torch.empty(stop - start, dtype=torch.uint8)
        view, done = memoryview(buffer.numpy()), 0
        while done < len(view):
            got = os.preadv(handle.fd, [view[done:]], start + done)
            if got <= 0:
                size = os.fstat(handle.fd).st_size
                raise truncated(file, name, EOFError(f"the file has {size} bytes, the tensor ends at byte {stop}"))
            done += got
        return buffer.view(info.dtype).reshape(shape)


MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14; older kernels: MADV_WILLNEED


def _check_size(fd: int, stop: int) -> None:
    size = os.fstat(fd).st_size
    if size < stop:
        raise EOFError(f"the file has {size} bytes, the tensor ends at byte {stop}")


def mapped(fd: int, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes ``[start, stop)`` of a file as a 1-D tensor backed by a private memory map of just that range.

    Zero copy: the tensor's pages are the page cache's until someone writes to them (copy on write, so
    in-place arithmetic on a loaded tensor is safe and never reaches the file). The range is faulted in
    here, on the reading thread, so the computing thread does not stall on page faults; it is unmapped
    when the tensor is freed, so a checkpoint's pages never pile up in the process.

    Raises EOFError (saying the file's size) when the file ends before ``stop``: checked before mapping
    and again when faulting the range in fails (pages past the end fail with EFAULT rather than SIGBUS).
    A file truncated after its range was read, while the tensor is still in use, is undefined behaviour
    (SIGBUS), as with any memory-mapped reader.
    """
    _check_size(fd, stop)
    aligned = start - start % mmap.ALLOCATIONGRANULARITY
    try:
        region = mmap.mmap(fd, stop - aligned, access=mmap.ACCESS_COPY, offset=aligned)
    except ValueError:  # Python's mmap checks the size too: truncated since the check above
        _check_size(fd, stop)
        raise OSError("the range cannot be memory-mapped") from None  # the caller reads it instead
    if hasattr(region, "madvise"):  # not on Windows
        try:
            region.madvise(MADV_POPULATE_READ)
        except (OSError, ValueError):
            try:
                _check_size(fd, stop)  # EFAULT: truncated since the map was made
            except EOFError:
                region.close()
                raise
            region.madvise(mmap.MADV_WILLNEED)  # a kernel without MADV_POPULATE_READ (before Linux 5.14)
    count = (stop - start) // dtype.itemsize
    return torch.frombuffer(region, dtype=dtype, count=count, offset=start - aligned)
