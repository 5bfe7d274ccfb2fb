"""Output side: sharded safetensors streamed one tensor at a time, model files copied, all-or-nothing folders.

``ShardWriter`` computes every shard's header from the planned names, shapes and dtypes, so each
tensor can be written at its final offset as soon as it is ready, in any order, and peak memory stays
about one tensor. ``atomic_directory`` makes a whole output folder appear only when it is complete.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import math
import os
import secrets
import shutil
import socket
import struct
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG

import torch

from specmerge.errors import SpecmergeError
from specmerge.io.sources import (
    SAFETENSORS_DTYPES,
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    SourceError,
    TensorInfo,
    folder_file,
)
from specmerge.version import __version__

_DTYPE_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}

# Files of a Hugging Face folder that are not weights and that a merged model needs (top level only).
MODEL_FILE_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "*.tiktoken",
    "preprocessor_config.json",
    "processor_config.json",
    "image_processor*.json",
    "video_preprocessor*.json",
    "chat_template.json",
    "chat_template.jinja",
    "*.py",
)
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.index.json")


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors dtype string (``"BF16"``, ``"F32"``, ...) for a torch dtype."""
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored in safetensors; cast the tensor first") from None


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
        self.files = [
            self.directory / (SAFETENSORS_FILE if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors")
            for i in range(count)
        ]
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
        with self._lock:
            if self._closed:
                raise ValueError(f"cannot write tensor '{name}': the writer is closed")
            slot = self._slots.get(name)
            if slot is None:
                raise ValueError(f"tensor '{name}' is not in the write plan ({len(self._slots)} planned tensors)")
            if name in self._written:
                raise ValueError(f"tensor '{name}' was already written")
            expected = slot.info
            offset, complete = slot.offset, True
            if row_start is None:
                if tuple(tensor.shape) != expected.shape or tensor.dtype != expected.dtype:
                    raise ValueError(
                        f"tensor '{name}': expected shape {list(expected.shape)} {expected.dtype}, "
                        f"got shape {list(tensor.shape)} {tensor.dtype}"
                    )
            else:
                rows = tensor.shape[0] if tensor.dim() else -1
                if (
                    tensor.dtype != expected.dtype
                    or tuple(tensor.shape[1:]) != expected.shape[1:]
                    or not 0 <= row_start <= row_start + rows <= (expected.shape[0] if expected.shape else -1)
                ):
                    raise ValueError(
                        f"tensor '{name}': rows from {row_start} of shape {list(tensor.shape)} {tensor.dtype} do not "
                        f"fit the planned shape {list(expected.shape)} {expected.dtype}"
                    )
                offset += row_start * (expected.nbytes // expected.shape[0])
                self._partial[name] = self._partial.get(name, 0) + tensor.numel() * tensor.dtype.itemsize
                complete = self._partial[name] >= expected.nbytes
            fd = self._fds.get(slot.shard)
            if fd is None:
                fd = self._fds[slot.shard] = self._create(slot.shard)
            if complete:
                self._written.add(name)  # reserved; the bytes are written outside the lock
        try:
            if tensor.numel():
                _pwrite_all(fd, _tensor_bytes(tensor), offset, self._lock)
        except BaseException:
            with self._lock:
                self._written.discard(name)  # close() then reports it as never written
            raise
        with self._lock:
            if complete:
                self._remaining[slot.shard] -= 1
                if self._remaining[slot.shard] == 0:
                    self._finish(slot.shard)
                    return
            if self._fsync:
                self._unsynced[slot.shard] = self._unsynced.get(slot.shard, 0) + tensor.numel() * tensor.dtype.itemsize
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


class OutputError(SpecmergeError):
    """The output location cannot be used."""


class OutputExistsError(OutputError, FileExistsError):
    """The output folder exists and overwriting was not asked for."""


# Every finished output folder holds this marker (who wrote it, which files), so that ``--overwrite`` tells
# specmerge's own output, which it may replace, from anyone else's folder, which it never replaces.
OUTPUT_MARKER = ".specmerge"
# An output is written in a hidden work folder beside it, ``.<name>.specmerge-tmp-<hex>/``: ``owner.json``
# (the process writing it) and ``output/`` (renamed onto the target once complete).
WORK_INFIX = ".specmerge-tmp-"
_OWNER_FILE = "owner.json"
_WORK_OUTPUT = "output"
_WORK_REPLACED = "replaced"  # an overwritten target, moved here just before the new output takes its place
_NAME_MAX = 255  # bytes in a file name on common file systems
# What `specmerge inspect` wrote before OUTPUT_MARKER existed (merges of those versions list theirs in report.json).
_LEGACY_INSPECT_FILES = frozenset(
    {
        "layers.csv",
        "layers.json",
        "summary.json",
        "optimizer_filter.csv",
        "filters.csv",
        "report.md",
        "spectra.png",
        "kept_ranks.png",
        "filter_shapes.png",
        "delta_norms.png",
        "optimizer_filter.png",
    }
)


def check_output(target: str | os.PathLike, overwrite: bool = False) -> Path:
    """Return ``target`` as an absolute path if a new output may be written there; raise :class:`OutputError` if not.

    Its parent folder must exist. The current folder, the home folder and folders holding either are refused.
    An existing ``target`` is refused unless ``overwrite``, and even then unless it is an empty folder or
    specmerge's own output holding nothing else (see :func:`foreign_entries`). Call it before any work;
    :func:`atomic_directory` checks again.
    """
    path = Path(os.path.abspath(Path(target).expanduser()))
    parent = path.parent
    if path == parent:
        raise OutputError(f"cannot write the output to {path}: choose a new folder")
    if not parent.is_dir():
        raise OutputError(f"cannot write {path}: its parent folder {parent} does not exist; create it first")
    if not os.path.lexists(path):
        return path
    real = Path(os.path.realpath(path))  # realpath, not resolve(): a symlink loop must not raise RuntimeError
    for folder, what in ((_cwd(), "the current folder"), (_home(), "your home folder")):
        if folder is not None and (real == folder or real in folder.parents):
            raise OutputError(f"refusing to write the output to {path}: it is {what} or holds it; choose a new folder")
    refusal = _replace_refusal(path)
    if not overwrite:
        hint = (
            "pass --overwrite to replace it or choose another path"
            if refusal is None
            else "choose another path (--overwrite replaces only an empty folder or specmerge's own output)"
        )
        raise OutputExistsError(f"{path} already exists; {hint}")
    if refusal is not None:
        raise OutputError(refusal)
    return path


def foreign_entries(folder: str | os.PathLike) -> list[str] | None:
    """The entries of ``folder`` that specmerge did not write (sub-folders end in ``/``), or None if specmerge
    did not write the folder at all.

    specmerge's own output is recognised by :data:`OUTPUT_MARKER`, and the outputs of earlier versions by their
    ``report.json`` beside ``recipe.yaml`` (merges, adapters) or ``summary.json`` beside ``report.md``
    (``specmerge inspect``). An empty folder has no foreign entries.
    """
    folder = Path(folder)
    entries = sorted(os.scandir(folder), key=lambda e: e.name)
    if not entries:
        return []
    written = _written_files(folder)
    if written is None:
        return None
    return [_entry_name(e) for e in entries if e.name not in written or e.is_dir(follow_symlinks=False)]


def _written_files(folder: Path) -> set[str] | None:
    marker = _read_json(folder / OUTPUT_MARKER)
    if isinstance(marker, dict) and marker.get("written_by") == "specmerge" and _names(marker.get("files")):
        return {*marker["files"], OUTPUT_MARKER}
    report = _read_json(folder / "report.json")
    files = report.get("files") if isinstance(report, dict) and "specmerge" in report else None
    if _names(files) and _is_file(folder / "recipe.yaml"):
        return set(files)
    summary = _read_json(folder / "summary.json")
    if isinstance(summary, dict) and "specmerge" in summary and _is_file(folder / "report.md"):
        return set(_LEGACY_INSPECT_FILES)
    return None


def _replace_refusal(path: Path) -> str | None:
    """Why ``--overwrite`` may not replace ``path``, or None if it may (an empty folder, or specmerge's output only)."""
    if path.is_symlink() or not path.is_dir():
        kind = "a symbolic link" if path.is_symlink() else "a file"
        return (
            f"{path} is {kind}, and --overwrite replaces only an empty folder or specmerge's own output: "
            "remove it yourself or choose another path"
        )
    try:
        foreign = foreign_entries(path)
        listing = _listing([_entry_name(e) for e in sorted(os.scandir(path), key=lambda e: e.name)])
    except OSError as err:
        return f"cannot list {path} to check that specmerge wrote it ({err.strerror or err}); choose another path"
    if foreign is None:
        return (
            f"{path} is not a folder specmerge wrote (it holds {listing}), and --overwrite replaces only an empty "
            "folder or specmerge's own output: move its contents elsewhere or choose another path"
        )
    if foreign:
        return (
            f"{path} is specmerge's output but also holds {_listing(foreign)} that specmerge did not write: "
            "move them elsewhere or choose another path"
        )
    return None


def _listing(names: list[str]) -> str:
    """``3 entries: a, b/, c`` with at most five names."""
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    return f"{len(names)} {'entry' if len(names) == 1 else 'entries'}: {shown}"


def _entry_name(entry: os.DirEntry) -> str:
    return entry.name + ("/" if entry.is_dir(follow_symlinks=False) else "")


def _names(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _is_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _read_json(path: Path) -> object:
    """The JSON in a regular file, or None (missing, a link, unreadable, not JSON)."""
    if not _is_file(path):
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write_json(path: Path, value: object, indent: int = 1) -> None:
    path.write_text(json.dumps(value, indent=indent) + "\n", encoding="utf-8")


def _cwd() -> Path | None:
    with contextlib.suppress(OSError):
        return Path.cwd().resolve()
    return None


def _home() -> Path | None:
    with contextlib.suppress(OSError, RuntimeError, KeyError):
        return Path.home().resolve()
    return None


@contextlib.contextmanager
def atomic_directory(
    target: str | os.PathLike, overwrite: bool = False, *, expected_bytes: int | None = None
) -> Iterator[Path]:
    """Yield an empty folder that becomes ``target`` only if the block succeeds.

    ``target`` is checked first (:func:`check_output`). The folder yielded is ``output/`` inside a hidden work
    folder ``.<name>.specmerge-tmp-<hex>`` beside ``target`` that records the writing process; work folders
    there whose process is gone (killed, crashed, machine rebooted) are removed first, those of live
    processes never (:func:`remove_stale_work_folders`). On success :data:`OUTPUT_MARKER` is added (the files
    written) and the folder is renamed onto ``target``; a replaced target is deleted only once the new folder is
    in place. On any exception (a signal included) the work folder is deleted and a replaced target put back.
    An OS error about the written files names ``target``, never the work folder; a full disk says how much
    space ``expected_bytes`` (the planned output size, when known) needs and how much is free.
    """
    target = check_output(target, overwrite)
    remove_stale_work_folders(target.parent)
    work = target.parent / _work_name(target.name)
    try:
        work.mkdir()
    except OSError as err:
        raise OutputError(
            f"cannot write {target}: creating a folder in {target.parent} failed ({err.strerror or err}); "
            "choose a folder you can write to"
        ) from err
    try:
        _write_json(work / _OWNER_FILE, {**_this_process(), "target": target.name})
        output = work / _WORK_OUTPUT
        output.mkdir()
        yield output
        files = sorted(p.name for p in output.iterdir())
        _write_json(output / OUTPUT_MARKER, {"written_by": "specmerge", "version": __version__, "files": files})
        if os.path.lexists(target):
            if not overwrite:
                raise OutputExistsError(f"{target} appeared while writing; choose another path or pass --overwrite")
            refusal = _replace_refusal(target)  # again: it may have changed while we worked
            if refusal is not None:
                raise OutputError(refusal)
            os.rename(target, work / _WORK_REPLACED)
        os.rename(output, target)
    except BaseException as err:
        _abandon(work, target)
        translated = _output_os_error(err, work, target, expected_bytes)
        if translated is not None:
            raise translated from err
        raise
    _remove(work)  # with the replaced folder, if any


def remove_stale_work_folders(parent: str | os.PathLike) -> list[Path]:
    """Remove the work folders in ``parent`` whose writing process has certainly exited; return them.

    A process counts as exited when its pid is gone, is a zombie, or was reused by a process started later (Linux
    start times), or when the machine was rebooted since. Folders written on another host or in another pid
    namespace, without an owner file, or of a live process are left alone. A replaced target found in a stale
    folder is put back where it was, if that place is free.
    """
    removed = []
    with contextlib.suppress(OSError), os.scandir(parent) as listing:
        for entry in list(listing):
            if not (entry.name.startswith(".") and WORK_INFIX in entry.name and entry.is_dir(follow_symlinks=False)):
                continue
            work = Path(entry.path)
            owner = _read_json(work / _OWNER_FILE)
            name = owner.get("target") if isinstance(owner, dict) else None
            if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
                continue
            if _owner_gone(owner):
                _abandon(work, work.parent / name)
                removed.append(work)
    return removed


def _abandon(work: Path, target: Path) -> None:
    """Delete a work folder, after putting back the target it replaced (kept there if that place is taken)."""
    replaced = work / _WORK_REPLACED
    if os.path.lexists(replaced):
        try:
            os.rename(replaced, target)
        except OSError:
            _remove(work / _WORK_OUTPUT)
            _remove(work / _OWNER_FILE)  # no longer a work folder: nothing will remove what it keeps
            return
    _remove(work)


def _work_name(name: str) -> str:
    """``.<name>.specmerge-tmp-<hex>``, ``name`` cut to fit the file-name limit."""
    suffix = f"{WORK_INFIX}{secrets.token_hex(4)}"
    room = _NAME_MAX - 1 - len(suffix)
    stem = name.encode("utf-8", "surrogateescape")[:room].decode("utf-8", "ignore")
    return f".{stem}{suffix}"


def _output_os_error(err: BaseException, work: Path, target: Path, expected_bytes: int | None) -> OutputError | None:
    """An OS error raised while writing an output, restated for ``target`` (None: not about the output)."""
    if not isinstance(err, OSError) or isinstance(err, SpecmergeError):
        return None
    if err.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        what = "no space left on the device" if err.errno == errno.ENOSPC else "disk quota exceeded"
        needs = f"the output needs about {_size_text(expected_bytes)}" if expected_bytes else "the output did not fit"
        free = ""
        with contextlib.suppress(OSError):
            free = f" and {_size_text(shutil.disk_usage(target.parent).free)} is free"
        return OutputError(
            f"{what} while writing {target}: {needs}{free} in {target.parent}; free some space or choose another "
            "output folder"
        )
    for name in (err.filename, err.filename2):
        if isinstance(name, str | bytes | os.PathLike):
            path = Path(os.path.abspath(os.fsdecode(name)))
            if path == work or work in path.parents:
                inside = path.relative_to(work)
                shown = target.joinpath(*inside.parts[1:]) if inside.parts[:1] == (_WORK_OUTPUT,) else target
                return OutputError(f"cannot write {shown}: {err.strerror or err}")
    return None


def _size_text(nbytes: int) -> str:
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def _this_process() -> dict[str, object]:
    """What tells this process from any other, now and after a pid is reused or the machine rebooted."""
    stat = _proc_stat(os.getpid())
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": stat[1] if stat else None,
        "boot": _read_text("/proc/sys/kernel/random/boot_id"),
        "pid_namespace": _pid_namespace(),
    }


def _owner_gone(owner: dict) -> bool:
    """Whether the process recorded in a work folder's owner file has certainly exited (False when unsure)."""
    if os.name != "posix":
        return False  # no signal-0 probe; never guess
    me = _this_process()
    if owner.get("host") != me["host"] or owner.get("pid_namespace") != me["pid_namespace"]:
        return False  # another machine or container: its processes cannot be seen from here
    if owner.get("boot") and me["boot"] and owner["boot"] != me["boot"]:
        return True  # written before this machine last booted
    pid = owner.get("pid")
    if type(pid) is not int or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass  # it exists, owned by another user
    stat = _proc_stat(pid)
    if stat is None:
        return False  # no /proc: a reused pid cannot be told from the owner
    state, started = stat
    return state in ("Z", "X") or (owner.get("started") is not None and started != owner["started"])


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """A process's state letter and start time (clock ticks after boot) from ``/proc/<pid>/stat`` (Linux)."""
    text = _read_text(f"/proc/{pid}/stat")
    fields = text.rsplit(")", 1)[-1].split() if text else []
    return (fields[0], fields[19]) if len(fields) > 19 else None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _remove(path: Path) -> None:
    """Best-effort removal of a folder or file (never masks the error being handled)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def write_output_config(out_dir: str | os.PathLike, weights: Iterable[TensorInfo]) -> str | None:
    """Make ``out_dir/config.json`` state the dtype the weights were written in; return it (None: nothing to do).

    The dtype is that of most of the floating-point weights, by element count (of all of them when the output
    was cast to one dtype). It goes in ``torch_dtype`` (read by every transformers version) and in ``dtype``
    where the config has that newer key, so that ``from_pretrained(out, dtype="auto")`` loads the weights as
    written. When all floating weights share the dtype, nested sub-model configs that state a dtype say it
    too. The file is rewritten only if this changes it; a missing config, or one that is not a JSON object, is
    left as it is.
    """
    counts: dict[torch.dtype, int] = {}
    for info in weights:
        if info.dtype.is_floating_point:
            counts[info.dtype] = counts.get(info.dtype, 0) + math.prod(info.shape)
    path = Path(out_dir) / "config.json"
    config = _read_json(path)
    if not counts or not isinstance(config, dict):
        return None
    name = str(max(counts, key=counts.__getitem__)).removeprefix("torch.")
    stated = _state_dtype(config, name, nested=len(counts) == 1)
    stated["torch_dtype"] = name
    if stated != config:
        _write_json(path, stated, indent=2)
    return name


def _state_dtype(config: dict, name: str, nested: bool) -> dict:
    """A copy of ``config`` whose ``torch_dtype`` / ``dtype`` keys (and, if ``nested``, those of sub-configs) say
    ``name``."""
    stated = {}
    for key, value in config.items():
        if key in ("torch_dtype", "dtype") and (value is None or isinstance(value, str)):
            value = name
        elif nested and isinstance(value, dict):
            value = _state_dtype(value, name, nested)
        stated[key] = value
    return stated


def model_files(base_dir: str | os.PathLike) -> dict[str, Path]:
    """The non-weight files of a Hugging Face folder that a merged model needs: name -> real path, by name.

    Top-level files whose names match ``MODEL_FILE_PATTERNS`` (config, tokenizer, processor, remote code);
    weights, indexes, README.md and subfolders are left out. Each is checked by
    :func:`specmerge.io.sources.folder_file`: a link that leads outside the folder (other than into its Hugging Face
    cache ``blobs/``), a dangling link or anything but a regular file raises SourceError naming the link and its
    target. A single-file base has none.
    """
    base_dir = Path(base_dir)
    if not base_dir.is_dir():
        return {}
    try:
        names = sorted(os.listdir(base_dir))
    except OSError as err:
        raise SourceError(f"{base_dir}: cannot list the folder ({err.strerror or err})") from None
    files = {}
    for name in names:
        path = base_dir / name
        if any(fnmatch.fnmatch(name, p) for p in WEIGHT_PATTERNS):
            continue
        if not any(fnmatch.fnmatch(name, p) for p in MODEL_FILE_PATTERNS) or (path.is_dir() and not path.is_symlink()):
            continue
        files[name] = folder_file(path, base_dir)
    return files


def copy_model_files(base_dir: str | os.PathLike, out_dir: str | os.PathLike) -> list[str]:
    """Copy :func:`model_files` of ``base_dir`` into ``out_dir`` as new files; return their names.

    The copies are created with mode 0644 (less under the umask), whatever the source's mode: no execute,
    setuid or group/other write bit is carried over. A file that has become anything but a regular file since
    it was checked is refused.
    """
    out_dir = Path(out_dir)
    files = model_files(base_dir)
    for name, real in files.items():
        _copy_regular_file(Path(base_dir) / name, real, out_dir / name)
    return list(files)


def _copy_regular_file(shown: Path, real: Path, target: Path) -> None:
    try:
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        raise SourceError(f"{shown}: cannot be read ({err.strerror or err})") from None
    with open(fd, "rb") as source:
        if not S_ISREG(os.fstat(fd).st_mode):
            raise SourceError(f"{shown} is not a regular file; specmerge copies only files")
        out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with open(out, "wb") as copy:
            shutil.copyfileobj(source, copy, 2**20)
