"""The output folder: where a merge may write, and how a whole folder appears only when it is complete.

:func:`check_output` refuses, before any work, an output that would replace something that is not specmerge's
(a non-empty folder it did not write, a file, a link, the current or home folder); :func:`atomic_directory`
writes into a work folder (:mod:`specmerge.io.output.work_folders`) and renames it onto the target at the end, so a
failed or killed merge leaves nothing half-written and never loses what it was to replace.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from specmerge.errors import SpecmergeError
from specmerge.io.formats.files import is_plain_file, read_json, write_json
from specmerge.io.output.work_folders import (
    OWNER_FILE,
    WORK_OUTPUT,
    WORK_REPLACED,
    abandon,
    remove,
    remove_stale_work_folders,
    this_process,
    work_name,
)
from specmerge.version import __version__

OUTPUT_LOG = "specmerge.output"  # the folders created for an output are logged here


class OutputError(SpecmergeError):
    """The output location cannot be used."""


class OutputExistsError(OutputError, FileExistsError):
    """The output folder exists and overwriting was not asked for."""


# Every finished output folder holds this marker (who wrote it, which files), so that ``--overwrite`` tells
# specmerge's own output, which it may replace, from anyone else's folder, which it never replaces.
OUTPUT_MARKER = ".specmerge"
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

    Missing parent folders are allowed (:func:`atomic_directory` creates them); an existing one must be a folder.
    The current folder, the home folder and folders holding either are refused.
    An existing ``target`` is refused unless ``overwrite``, and even then unless it is an empty folder or
    specmerge's own output holding nothing else (see :func:`foreign_entries`). Call it before any work;
    :func:`atomic_directory` checks again.
    """
    path = Path(os.path.abspath(Path(target).expanduser()))
    parent = path.parent
    if path == parent:
        raise OutputError(f"cannot write the output to {path}: choose a new folder")
    if not parent.is_dir():
        ancestor = next(folder for folder in parent.parents if os.path.lexists(folder))
        if os.path.lexists(parent) or not ancestor.is_dir():
            blocker = parent if os.path.lexists(parent) else ancestor
            raise OutputError(f"cannot write {path}: {blocker} is not a folder; choose another output path")
        return path  # the missing parent folders are created when the output is written (atomic_directory)
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
    marker = read_json(folder / OUTPUT_MARKER)
    if isinstance(marker, dict) and marker.get("written_by") == "specmerge" and _names(marker.get("files")):
        return {*marker["files"], OUTPUT_MARKER}
    report = read_json(folder / "report.json")
    files = report.get("files") if isinstance(report, dict) and "specmerge" in report else None
    if _names(files) and is_plain_file(folder / "recipe.yaml"):
        return set(files)
    summary = read_json(folder / "summary.json")
    if isinstance(summary, dict) and "specmerge" in summary and is_plain_file(folder / "report.md"):
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

    ``target`` is checked first (:func:`check_output`); missing parent folders are created (each logged on the
    ``specmerge.output`` logger) and removed again, if still empty, when the block fails. The folder yielded is
    ``output/`` inside a hidden work folder ``.<name>.specmerge-tmp-<hex>`` beside ``target`` that records the
    writing process; work folders
    there whose process is gone (killed, crashed, machine rebooted) are removed first, those of live
    processes never (:func:`remove_stale_work_folders`). On success :data:`OUTPUT_MARKER` is added (the files
    written) and the folder is renamed onto ``target``; a replaced target is deleted only once the new folder is
    in place. On any exception (a signal included) the work folder is deleted and a replaced target put back.
    An OS error about the written files names ``target``, never the work folder; a full disk says how much
    space ``expected_bytes`` (the planned output size, when known) needs and how much is free.
    """
    target = check_output(target, overwrite)
    created = make_parents(target.parent)
    try:
        yield from _written_atomically(target, overwrite, expected_bytes)
    except BaseException:
        remove_empty_folders(created)
        raise


def _written_atomically(target: Path, overwrite: bool, expected_bytes: int | None) -> Iterator[Path]:
    """The body of :func:`atomic_directory` once ``target`` is checked and its parent exists."""
    remove_stale_work_folders(target.parent)
    work = target.parent / work_name(target.name)
    try:
        work.mkdir()
    except OSError as err:
        raise OutputError(
            f"cannot write {target}: creating a folder in {target.parent} failed ({err.strerror or err}); "
            "choose a folder you can write to"
        ) from err
    try:
        write_json(work / OWNER_FILE, {**this_process(), "target": target.name})
        output = work / WORK_OUTPUT
        output.mkdir()
        yield output
        files = sorted(p.name for p in output.iterdir())
        write_json(output / OUTPUT_MARKER, {"written_by": "specmerge", "version": __version__, "files": files})
        if os.path.lexists(target):
            if not overwrite:
                raise OutputExistsError(f"{target} appeared while writing; choose another path or pass --overwrite")
            refusal = _replace_refusal(target)  # again: it may have changed while we worked
            if refusal is not None:
                raise OutputError(refusal)
            os.rename(target, work / WORK_REPLACED)
        os.rename(output, target)
    except BaseException as err:
        abandon(work, target)
        translated = _output_os_error(err, work, target, expected_bytes)
        if translated is not None:
            raise translated from err
        raise
    remove(work)  # with the replaced folder, if any


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
                shown = target.joinpath(*inside.parts[1:]) if inside.parts[:1] == (WORK_OUTPUT,) else target
                return OutputError(f"cannot write {shown}: {err.strerror or err}")
    return None


def _size_text(nbytes: int) -> str:
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def make_parents(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; return those created, outermost first (each logged)."""
    missing = []
    while not os.path.lexists(folder):
        missing.append(folder)
        folder = folder.parent
    created = []
    for path in reversed(missing):
        try:
            path.mkdir()
        except FileExistsError:
            continue  # made meanwhile by another process: not ours to remove
        except OSError as err:
            remove_empty_folders(created)
            raise OutputError(
                f"cannot create the output's folder {path} ({err.strerror or err}); create it or choose another path"
            ) from err
        created.append(path)
        logging.getLogger(OUTPUT_LOG).info(f"created the folder {path} for the output")
    return created


def remove_empty_folders(folders: list[Path]) -> None:
    """Remove the ``folders`` (outermost first, as :func:`make_parents` gives them) that are still empty."""
    for path in reversed(folders):
        with contextlib.suppress(OSError):
            path.rmdir()
