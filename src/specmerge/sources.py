"""Lazy tensor sources: a checkpoint's tensor names, shapes and dtypes without reading tensor data.

``open_source(path)`` accepts a single ``.safetensors`` file, a Hugging Face model folder (sharded
safetensors with ``model.safetensors.index.json``, ``model.safetensors``, ``pytorch_model.bin.index.json``
or ``pytorch_model.bin``), an index file, or a single ``.bin``/``.pt`` state dict. Every source reads one
tensor per ``load(name)``, so peak memory stays about one tensor whatever the model size.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import math
import mmap
import os
import pickle
import re
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from safetensors import SafetensorError, safe_open

from specmerge.errors import SpecmergeError

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
TORCH_INDEX = "pytorch_model.bin.index.json"
TORCH_FILE = "pytorch_model.bin"
TORCH_SUFFIXES = (".bin", ".pt", ".pth")

# safetensors dtype strings -> torch dtypes; the optional ones only where this torch build has them.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _code, _attr in (
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
):
    if hasattr(torch, _attr):
        SAFETENSORS_DTYPES[_code] = getattr(torch, _attr)


class SourceError(SpecmergeError):
    """A checkpoint cannot be opened or read; the message names the file or tensor and what to do."""


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


class _ShardedSource:
    """Shared logic of a checkpoint stored in one or more files, optionally mapped by an index.

    Subclasses open one file (``_open``), list its tensors in stored order (``_file_infos``) and read one
    tensor (``_read``). Files are opened lazily, at most once, and kept open until ``close``.
    """

    kind = ""

    def __init__(self, path: Path, files: list[Path], weight_map: dict[str, Path] | None = None) -> None:
        self.path = path
        self._files = files
        self._weight_map = weight_map  # name -> file, when an index says which file holds which tensor
        self._handles: dict[Path, Any] = {}
        self._infos: dict[str, TensorInfo] | None = None
        self._where: dict[str, Path] = {}
        self._lock = threading.RLock()

    def describe(self) -> str:
        if len(self._files) == 1 and self._files[0] == self.path:
            return f"{self.kind} file {self.path}"
        shards = f"{len(self._files)} {self.kind} shard{'s' if len(self._files) > 1 else ''}"
        return f"{self.path} ({shards})"

    def infos(self) -> dict[str, TensorInfo]:
        with self._lock:
            if self._infos is None:
                self._infos, self._where = self._collect_infos()
            return dict(self._infos)

    def load(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        self.infos()
        file = self._where.get(name)
        if file is None:
            close = difflib.get_close_matches(name, list(self._where), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise SourceError(f"{self.describe()}: no tensor named '{name}'; {hint}({len(self._where)} tensors)")
        if rows is not None:
            shape = self._infos[name].shape
            if not shape or not 0 <= rows[0] <= rows[1] <= shape[0]:
                raise SourceError(f"{file}: rows {rows} out of range for tensor '{name}' of shape {shape}")
        return self._read(file, self._handle(file), name, rows)

    def close(self) -> None:
        with self._lock:
            self._handles.clear()

    def __enter__(self) -> _ShardedSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"

    def _handle(self, file: Path) -> Any:
        with self._lock:
            if file not in self._handles:
                self._handles[file] = self._open(file)
            return self._handles[file]

    def _collect_infos(self) -> tuple[dict[str, TensorInfo], dict[str, Path]]:
        infos: dict[str, TensorInfo] = {}
        where: dict[str, Path] = {}
        for file in self._files:
            for info in self._file_infos(file, self._handle(file)):
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

    def _open(self, file: Path) -> Any:
        raise NotImplementedError

    def _file_infos(self, file: Path, handle: Any) -> Iterator[TensorInfo]:
        raise NotImplementedError

    def _read(self, file: Path, handle: Any, name: str, rows: tuple[int, int] | None) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class _SafetensorsFile:
    """An open safetensors file: safe_open for the validated header, a plain descriptor for reading data."""

    handle: Any
    fd: int
    data_start: int
    offsets: dict[str, tuple[int, int]]

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


class SafetensorsSource(_ShardedSource):
    """One or more safetensors files; shapes and dtypes come from the headers, tensors are read one at a time."""

    kind = "safetensors"

    def _open(self, file: Path) -> _SafetensorsFile:
        try:
            handle = safe_open(str(file), framework="pt")  # validates the header
            fd = os.open(file, os.O_RDONLY)
            (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            header = json.loads(os.pread(fd, length, 8))
            offsets = {k: tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__"}
            return _SafetensorsFile(handle, fd, 8 + length, offsets)
        except SafetensorError as err:
            raise SourceError(
                f"{file}: not a valid safetensors file ({err}); the file may be truncated or corrupt, re-download it"
            ) from None
        except OSError as err:
            raise SourceError(f"{file}: cannot be opened ({err.strerror or err})") from None

    def _file_infos(self, file: Path, handle: _SafetensorsFile) -> Iterator[TensorInfo]:
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

    def _read(self, file: Path, handle: _SafetensorsFile, name: str, rows: tuple[int, int] | None) -> torch.Tensor:
        info = self._infos[name]
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
            return _mapped(handle.fd, start, stop, info.dtype).reshape(shape)
        except OSError:  # a file system without memory maps: plain reads into a fresh buffer
            pass
        buffer = torch.empty(stop - start, dtype=torch.uint8)
        view, done = memoryview(buffer.numpy()), 0
        while done < len(view):
            got = os.preadv(handle.fd, [view[done:]], start + done)
            if got <= 0:
                raise SourceError(f"{file}: truncated while reading tensor '{name}'; re-download the checkpoint")
            done += got
        return buffer.view(info.dtype).reshape(shape)


MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14; older kernels: MADV_WILLNEED


def _mapped(fd: int, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes ``[start, stop)`` of a file as a 1-D tensor backed by a private memory map of just that range.

    Zero copy: the tensor's pages are the page cache's until someone writes to them (copy on write, so
    in-place arithmetic on a loaded tensor is safe and never reaches the file). The range is faulted in
    here, on the reading thread, so the computing thread does not stall on page faults; it is unmapped
    when the tensor is freed, so a checkpoint's pages never pile up in the process. A file truncated
    while being merged is undefined behaviour (SIGBUS), as with any memory-mapped reader.
    """
    aligned = start - start % mmap.ALLOCATIONGRANULARITY
    region = mmap.mmap(fd, stop - aligned, access=mmap.ACCESS_COPY, offset=aligned)
    if hasattr(region, "madvise"):  # not on Windows
        try:
            region.madvise(MADV_POPULATE_READ)
        except (OSError, ValueError):
            region.madvise(mmap.MADV_WILLNEED)
    count = (stop - start) // dtype.itemsize
    return torch.frombuffer(region, dtype=dtype, count=count, offset=start - aligned)


class TorchSource(_ShardedSource):
    """PyTorch pickle state dicts (``pytorch_model.bin``), loaded memory-mapped with ``weights_only=True``.

    A file in the legacy (pre-zip) format cannot be memory-mapped and is loaded whole instead.
    """

    kind = "PyTorch"

    def _open(self, file: Path) -> dict[str, torch.Tensor]:
        try:
            try:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as err:
                if "mmap" not in str(err):
                    raise
                state = torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            reason = _unpickling_reason(err)
            if reason.startswith("Unsupported global"):
                raise SourceError(
                    f"{file}: holds objects other than tensors and cannot be loaded safely ({reason}); "
                    "save model.state_dict() or convert it to safetensors"
                ) from None
            raise SourceError(f"{file}: not a readable PyTorch checkpoint ({reason}); it may be corrupt") from None
        except (RuntimeError, OSError, EOFError) as err:
            raise SourceError(
                f"{file}: not a readable PyTorch checkpoint ({err}); it may be truncated or corrupt"
            ) from None
        if not isinstance(state, dict):
            raise SourceError(f"{file}: holds a {type(state).__name__}, expected a state dict of tensors")
        tensors = {k: v for k, v in state.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
        if not tensors:
            raise SourceError(
                f"{file}: holds no tensors at the top level; if it is a training checkpoint, save model.state_dict()"
            )
        return tensors

    def _file_infos(self, file: Path, handle: dict[str, torch.Tensor]) -> Iterator[TensorInfo]:
        for name, tensor in handle.items():
            yield TensorInfo(name, tuple(tensor.shape), tensor.dtype)

    def _read(
        self, file: Path, handle: dict[str, torch.Tensor], name: str, rows: tuple[int, int] | None
    ) -> torch.Tensor:
        # A private copy: the stored tensor is memory-mapped and may share storage with others (tied weights).
        tensor = handle[name] if rows is None else handle[name][rows[0] : rows[1]]
        return tensor.clone(memory_format=torch.contiguous_format)


def _unpickling_reason(err: Exception) -> str:
    """The informative part of torch's long weights_only error message."""
    text = str(err)
    match = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\.\s|\n|$)", text)
    return match.group(1).strip() if match else (text.strip().splitlines() or [type(err).__name__])[0]


def open_source(path: str | os.PathLike) -> TensorSource:
    """Open a checkpoint lazily: a safetensors file, a Hugging Face model folder, an index file or a .bin file."""
    path = Path(path).expanduser()
    if not path.exists():
        raise SourceError(f"{path} does not exist; pass a .safetensors file or a Hugging Face model folder")
    if path.is_dir():
        return _open_folder(path)
    if path.name.endswith(".safetensors.index.json"):
        return _from_index(path, SafetensorsSource)
    if path.name.endswith(".bin.index.json"):
        return _from_index(path, TorchSource)
    if path.suffix == ".safetensors":
        return SafetensorsSource(path, [path])
    if path.suffix in TORCH_SUFFIXES:
        return TorchSource(path, [path])
    raise SourceError(
        f"{path}: unsupported checkpoint file; expected .safetensors, a .safetensors.index.json, .bin or .pt"
    )


def _open_folder(folder: Path) -> TensorSource:
    if (folder / SAFETENSORS_INDEX).is_file():
        return _from_index(folder / SAFETENSORS_INDEX, SafetensorsSource)
    if (folder / SAFETENSORS_FILE).is_file():
        return SafetensorsSource(folder, [folder / SAFETENSORS_FILE])
    if (folder / TORCH_INDEX).is_file():
        return _from_index(folder / TORCH_INDEX, TorchSource)
    if (folder / TORCH_FILE).is_file():
        return TorchSource(folder, [folder / TORCH_FILE])
    indexes = sorted(p.name for p in folder.glob("*.safetensors.index.json"))
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    if len(indexes) == 1:
        return _from_index(folder / indexes[0], SafetensorsSource)
    if len(indexes) > 1:
        raise SourceError(f"{folder} holds several safetensors indexes ({', '.join(indexes)}); pass one of them")
    if (folder / "adapter_config.json").is_file():
        raise SourceError(f"{folder} is a PEFT adapter folder (adapter_config.json), not a full model checkpoint")
    adapter_weights = [f for f in ("adapter_model.safetensors", "adapter_model.bin") if (folder / f).is_file()]
    if adapter_weights:
        raise SourceError(
            f"{folder} holds {adapter_weights[0]} but no adapter_config.json: a PEFT adapter needs its config "
            "(rank, alpha, target modules); copy it from where the adapter was saved"
        )
    if len(files) == 1:
        return SafetensorsSource(folder, [folder / files[0]])
    if files:
        shown = ", ".join(files[:5]) + (", ..." if len(files) > 5 else "")
        raise SourceError(
            f"{folder} holds {len(files)} .safetensors files ({shown}) but no {SAFETENSORS_INDEX} saying which "
            "tensor lives where; add the index or pass a single file"
        )
    raise SourceError(
        f"{folder} holds no checkpoint: looked for {SAFETENSORS_INDEX}, {SAFETENSORS_FILE}, {TORCH_INDEX}, "
        f"{TORCH_FILE} and *.safetensors"
    )


def _from_index(index: Path, kind: type[_ShardedSource]) -> TensorSource:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not a mapping of tensor names to file names")
    except (OSError, ValueError, KeyError, TypeError) as err:
        detail = "no 'weight_map'" if isinstance(err, KeyError) else str(err)
        raise SourceError(f"{index}: not a valid checkpoint index ({detail}); re-download it") from None
    folder = index.parent
    files: dict[str, Path] = {}  # file name -> path, in order of first appearance
    for name, file_name in weight_map.items():
        if file_name not in files:
            file = folder / file_name
            if not file.is_file():
                raise SourceError(
                    f"{index}: shard {file_name} (holding '{name}') is missing from {folder}; "
                    "download it or fix the index"
                )
            files[file_name] = file
    source_path = folder if index.name in (SAFETENSORS_INDEX, TORCH_INDEX) else index
    return kind(source_path, list(files.values()), {name: files[f] for name, f in weight_map.items()})
