"""Lazy tensor sources: a checkpoint's tensor names, shapes and dtypes without reading tensor data.

``open_source(path)`` accepts a single ``.safetensors`` file, a Hugging Face model folder (sharded
safetensors with ``model.safetensors.index.json``, ``model.safetensors``, ``pytorch_model.bin.index.json``
or ``pytorch_model.bin``), an index file, or a single ``.bin``/``.pt`` state dict. Every source reads one
tensor per ``load(name)``, so peak memory stays about one tensor whatever the model size.

Nothing outside a model folder is read through it: every file taken from a folder (weights, shards named
by an index, and, through :func:`folder_file`, the adapter and model files of other modules) must be a
regular file that resolves inside the folder, or, for a Hugging Face cache snapshot
(``.../models--ORG--NAME/snapshots/<rev>/``), inside that repository's ``blobs/``. ``source.files()``
lists the real files a source reads. PyTorch pickles are loaded with ``weights_only=True``: a pickle that
refers to code or to objects other than tensors is refused and nothing in it runs.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import json
import math
import mmap
import os
import pickle
import re
import stat
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

    def files(self) -> list[Path]:
        """The real paths (links resolved) of every file the source reads: its index, if any, and its weights."""
        ...


class _ShardedSource:
    """Shared logic of a checkpoint stored in one or more files, optionally mapped by an index.

    Subclasses open one file (``_open``), list its tensors in stored order (``_file_infos``) and read one
    tensor (``_read``). Files are opened lazily, at most once, and kept open until ``close``.
    """

    kind = ""

    def __init__(
        self, path: Path, files: list[Path], weight_map: dict[str, Path] | None = None, *, index: Path | None = None
    ) -> None:
        self.path = path
        self._files = files
        # Files are named by the user's paths in messages and opened by their real paths, checked by the caller.
        self._real = {file: Path(os.path.realpath(file)) for file in files}
        self._index = Path(os.path.realpath(index)) if index is not None else None
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

    def files(self) -> list[Path]:
        return ([self._index] if self._index is not None else []) + list(self._real.values())

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
        real = self._real.get(file, file)
        try:
            opened = _SafetensorsFile(safe_open(str(real), framework="pt"), os.open(real, os.O_RDONLY), 0, {})
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
            raise _unusable(file, str(file), err) from None
        except (ValueError, TypeError, KeyError, struct.error) as err:  # changed since safe_open validated it
            raise SourceError(
                f"{file}: changed while being opened ({err}); open it again when it is complete"
            ) from None
        # safe_open checked every tensor's data range against the file; it may have been truncated since.
        for name, (_, stop) in opened.offsets.items():
            if opened.data_start + stop > size:
                raise _truncated(file, name, EOFError(f"the file has {size} bytes"), opening=True)
        return opened

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
        except EOFError as err:
            raise _truncated(file, name, err) from None
        except OSError:  # a file system without memory maps: plain reads into a fresh buffer
            pass
        buffer = torch.empty(stop - start, dtype=torch.uint8)
        view, done = memoryview(buffer.numpy()), 0
        while done < len(view):
            got = os.preadv(handle.fd, [view[done:]], start + done)
            if got <= 0:
                size = os.fstat(handle.fd).st_size
                raise _truncated(file, name, EOFError(f"the file has {size} bytes, the tensor ends at byte {stop}"))
            done += got
        return buffer.view(info.dtype).reshape(shape)


def _truncated(file: Path, name: str, err: EOFError, opening: bool = False) -> SourceError:
    if opening:
        return SourceError(f"{file}: truncated, tensor '{name}' lies past its end ({err}); re-download the checkpoint")
    return SourceError(
        f"{file}: truncated while reading tensor '{name}' ({err}); was it changed during the merge? "
        "re-download the checkpoint and run again"
    )


MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14; older kernels: MADV_WILLNEED


def _check_size(fd: int, stop: int) -> None:
    size = os.fstat(fd).st_size
    if size < stop:
        raise EOFError(f"the file has {size} bytes, the tensor ends at byte {stop}")


def _mapped(fd: int, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
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


@dataclass
class _TorchFile:
    """An open PyTorch checkpoint: its tensors (memory-mapped when the format allows) and the file's size."""

    tensors: dict[str, torch.Tensor]
    size: int


class TorchSource(_ShardedSource):
    """PyTorch pickle state dicts (``pytorch_model.bin``), loaded memory-mapped with ``weights_only=True``.

    A file in the legacy (pre-zip) format cannot be memory-mapped and is loaded whole instead. A pickle that
    refers to any code or object other than tensors and plain containers is refused unloaded: nothing in it
    runs, and the message names what it refers to.
    """

    kind = "PyTorch"

    def _open(self, file: Path) -> _TorchFile:
        real = self._real.get(file, file)
        try:
            size = os.stat(real).st_size
            try:
                state = torch.load(real, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as err:
                if "mmap" not in str(err):
                    raise
                state = torch.load(real, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise _pickle_error(file, err) from None
        except OSError as err:
            raise _unusable(file, str(file), err) from None
        except Exception as err:  # whatever a damaged or hostile file makes torch raise
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise SourceError(
                f"{file}: not a readable PyTorch checkpoint ({reason}); it may be truncated or corrupt, re-download it"
            ) from None
        if not isinstance(state, dict):
            raise SourceError(f"{file}: holds a {type(state).__name__}, expected a state dict of tensors")
        tensors = {k: v for k, v in state.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
        if not tensors:
            raise SourceError(
                f"{file}: holds no tensors at the top level; if it is a training checkpoint, save model.state_dict()"
            )
        return _TorchFile(tensors, size)

    def _file_infos(self, file: Path, handle: _TorchFile) -> Iterator[TensorInfo]:
        for name, tensor in handle.tensors.items():
            yield TensorInfo(name, tuple(tensor.shape), tensor.dtype)

    def _read(self, file: Path, handle: _TorchFile, name: str, rows: tuple[int, int] | None) -> torch.Tensor:
        # The tensors are mapped from the file: reading past a new end would kill the process (SIGBUS).
        with contextlib.suppress(OSError):
            size = os.stat(self._real.get(file, file)).st_size
            if size < handle.size:
                raise _truncated(file, name, EOFError(f"the file had {handle.size} bytes, now {size}"))
        # A private copy: the stored tensor is memory-mapped and may share storage with others (tied weights).
        tensor = handle.tensors[name] if rows is None else handle.tensors[name][rows[0] : rows[1]]
        return tensor.clone(memory_format=torch.contiguous_format)


_GLOBAL = re.compile(r"GLOBAL\s+([\w.]+)")


def _pickle_error(file: Path, err: Exception) -> SourceError:
    """What torch's weights_only unpickler refused, without its advice to load the file unsafely."""
    text = str(err)
    found = _GLOBAL.search(text)
    if found:
        return SourceError(
            f"{file}: holds code or objects that are not tensors (its pickle calls or builds {found.group(1)}); "
            "it was not loaded and nothing in it ran. If you trust where the file comes from, convert it to "
            "safetensors; otherwise do not use it"
        )
    return SourceError(
        f"{file}: not a readable PyTorch checkpoint ({_unpickling_reason(text)}); it was not loaded. "
        "Re-download it, or convert a file you trust to safetensors"
    )


def _unpickling_reason(text: str) -> str:
    """The informative part of torch's long weights_only error message (never its advice to load unsafely)."""
    match = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\.\s|\n|$)", text)
    if match:
        return match.group(1).strip()
    for line in text.strip().splitlines():
        line = line.strip()
        if line and not line.startswith("Weights only load failed") and "weights_only" not in line:
            return line
    return "the pickle is not a plain state dict"


def open_source(path: str | os.PathLike) -> TensorSource:
    """Open a checkpoint lazily: a safetensors file, a Hugging Face model folder, an index file or a .bin file."""
    path = Path(path).expanduser()
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        hint = "does not exist; pass a .safetensors file or a Hugging Face model folder"
        raise _unusable(path, str(path), err, hint) from None
    if stat.S_ISDIR(mode):
        return _open_folder(path)
    regular_file(path)
    if path.name.endswith(".safetensors.index.json"):
        return _from_index(path, SafetensorsSource, in_folder=False)
    if path.name.endswith(".bin.index.json"):
        return _from_index(path, TorchSource, in_folder=False)
    if path.suffix == ".safetensors":
        return SafetensorsSource(path, [path])
    if path.suffix in TORCH_SUFFIXES:
        return TorchSource(path, [path])
    raise SourceError(
        f"{path}: unsupported checkpoint file; expected .safetensors, a .safetensors.index.json, .bin or .pt"
    )


def _open_folder(folder: Path) -> TensorSource:
    try:
        names = set(os.listdir(folder))
    except OSError as err:
        raise _unusable(folder, str(folder), err) from None
    if SAFETENSORS_INDEX in names:
        return _from_index(folder / SAFETENSORS_INDEX, SafetensorsSource, in_folder=True)
    if SAFETENSORS_FILE in names:
        return SafetensorsSource(folder, [_in_folder(folder, SAFETENSORS_FILE)])
    if TORCH_INDEX in names:
        return _from_index(folder / TORCH_INDEX, TorchSource, in_folder=True)
    if TORCH_FILE in names:
        return TorchSource(folder, [_in_folder(folder, TORCH_FILE)])
    indexes = sorted(name for name in names if name.endswith(".safetensors.index.json"))
    files = sorted(name for name in names if name.endswith(".safetensors"))
    if len(indexes) == 1:
        return _from_index(folder / indexes[0], SafetensorsSource, in_folder=True)
    if len(indexes) > 1:
        raise SourceError(f"{folder} holds several safetensors indexes ({', '.join(indexes)}); pass one of them")
    if "adapter_config.json" in names:
        raise SourceError(f"{folder} is a PEFT adapter folder (adapter_config.json), not a full model checkpoint")
    adapter_weights = [f for f in ("adapter_model.safetensors", "adapter_model.bin") if f in names]
    if adapter_weights:
        raise SourceError(
            f"{folder} holds {adapter_weights[0]} but no adapter_config.json: a PEFT adapter needs its config "
            "(rank, alpha, target modules); copy it from where the adapter was saved"
        )
    if len(files) == 1:
        return SafetensorsSource(folder, [_in_folder(folder, files[0])])
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


def _in_folder(folder: Path, name: str) -> Path:
    """``folder / name``, checked by :func:`folder_file`."""
    folder_file(folder / name, folder)
    return folder / name


def _from_index(index: Path, kind: type[_ShardedSource], *, in_folder: bool) -> TensorSource:
    folder = index.parent
    real = folder_file(index, folder) if in_folder else regular_file(index)
    try:
        data = json.loads(real.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or "weight_map" not in data:
            raise KeyError("weight_map")
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not a mapping of tensor names to file names")
    except OSError as err:
        raise _unusable(index, str(index), err) from None
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        detail = "no 'weight_map'" if isinstance(err, KeyError) else str(err)
        raise SourceError(f"{index}: not a valid checkpoint index ({detail}); re-download it") from None
    files: dict[str, Path] = {}  # file name -> path, in order of first appearance
    for name, file_name in weight_map.items():
        if file_name in files:
            continue
        if file_name in ("", ".", "..") or any(c in file_name for c in ("/", "\\", "\0")):
            raise SourceError(
                f"{index}: shard '{file_name}' (holding '{name}') is not a plain file name; shards are read only "
                f"from the index's folder {folder}, so fix the index"
            )
        folder_file(
            folder / file_name,
            folder,
            label=f"{index}: shard {file_name} (holding '{name}')",
            missing=f"is missing from {folder}; download it or fix the index",
        )
        files[file_name] = folder / file_name
    source_path = folder if index.name in (SAFETENSORS_INDEX, TORCH_INDEX) else index
    return kind(source_path, list(files.values()), {name: files[f] for name, f in weight_map.items()}, index=index)


# Hugging Face cache repositories: <cache>/models--ORG--NAME/{snapshots/<rev>/<file> -> ../../blobs/<sha>, blobs/}.
HF_CACHE_REPO_PREFIXES = ("models--", "datasets--", "spaces--")


def folder_file(
    path: str | os.PathLike,
    folder: str | os.PathLike | None = None,
    *,
    label: str | None = None,
    missing: str = "does not exist",
) -> Path:
    """The real path of ``path``, a file of ``folder`` (default: its parent) that specmerge may read or copy.

    It must be a readable regular file whose real path (links resolved) lies inside the real ``folder`` or,
    when ``folder`` is (inside) a Hugging Face cache snapshot ``.../models--ORG--NAME/snapshots/<rev>/``, inside
    that repository's ``blobs/``. Anything else raises SourceError, one line starting with ``label`` (default:
    the path): a link elsewhere (naming the link's target), a dangling link, a link loop, a folder, a device or
    pipe, a file that cannot be read; ``missing`` ends the message for a path that does not exist.
    """
    path = Path(path)
    folder = Path(folder) if folder is not None else path.parent
    label = label or str(path)
    mode = _stat(path, label, missing)
    real = Path(os.path.realpath(path))
    roots = _allowed_roots(Path(os.path.realpath(folder)))
    if not any(real.is_relative_to(root) for root in roots):
        target = _link_target(path)
        what = f"is a symbolic link to {target}" + (f" ({real})" if Path(target) != real else "") if target else ""
        raise SourceError(
            f"{label} {what or f'resolves to {real}'}, outside {folder}; specmerge reads only files inside the model "
            "folder (or its Hugging Face cache blobs/): copy the file into the folder if you trust it"
        )
    return _check_regular(path, real, mode, label)


def regular_file(path: str | os.PathLike, *, label: str | None = None, missing: str = "does not exist") -> Path:
    """The real path of ``path``, which must be (or link to) a readable regular file; SourceError otherwise."""
    path = Path(path)
    label = label or str(path)
    mode = _stat(path, label, missing)
    return _check_regular(path, Path(os.path.realpath(path)), mode, label)


def _stat(path: Path, label: str, missing: str) -> int:
    try:
        return os.stat(path).st_mode
    except OSError as err:
        raise _unusable(path, label, err, missing) from None
    except ValueError:  # an embedded NUL byte
        raise SourceError(f"{label}: not a valid path") from None


def _check_regular(path: Path, real: Path, mode: int, label: str) -> Path:
    if stat.S_ISDIR(mode):
        raise SourceError(f"{label} is a folder, not a file")
    if not stat.S_ISREG(mode):
        raise SourceError(f"{label} is not a regular file (a device, pipe or socket); specmerge reads only files")
    try:
        os.close(os.open(real, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)))
    except OSError as err:
        raise _unusable(path, label, err) from None
    return real


def _allowed_roots(folder: Path) -> list[Path]:
    """The real ``folder`` and, for a folder in a Hugging Face cache snapshot, the real ``blobs/`` of its repo."""
    roots = [folder]
    for snapshot in (folder, *folder.parents):
        repo = snapshot.parent.parent
        if snapshot.parent.name == "snapshots" and repo.name.startswith(HF_CACHE_REPO_PREFIXES):
            blobs = repo / "blobs"
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(os.lstat(blobs).st_mode):  # a real folder, not a link to one
                    roots.append(blobs)
            break
    return roots


def _link_target(path: Path) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _unusable(path: Path, label: str, err: OSError, missing: str = "does not exist") -> SourceError:
    """A one-line SourceError for a path that cannot be used, saying what it is (never "missing" for a loop or
    a permission problem)."""
    code = err.errno
    if code == errno.ELOOP:
        return SourceError(
            f"{label}: symbolic link loop (a link that leads back to itself); replace the link with what it should "
            "point to"
        )
    if code in (errno.EACCES, errno.EPERM):
        where = f" on {err.filename}" if err.filename and os.fspath(err.filename) != os.fspath(path) else ""
        return SourceError(
            f"{label}: permission denied{where}; make it readable for your user (chmod, chown) or copy it"
        )
    if code in (errno.ENOENT, errno.ENOTDIR):
        target = _link_target(path)
        if target is not None:
            return SourceError(
                f"{label} is a symbolic link to {target}, which does not exist; an interrupted download leaves "
                "such links: download the checkpoint again"
            )
        return SourceError(f"{label} {missing}")
    if code == errno.EISDIR:
        return SourceError(f"{label} is a folder, not a file")
    return SourceError(f"{label}: cannot be read ({err.strerror or err})")
