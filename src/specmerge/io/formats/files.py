"""Which files specmerge reads: the safety rules for every path taken from a model or adapter folder.

Nothing outside a model folder is read through one: every file taken from a folder (weights, shards named by
an index, configs, adapter and tokenizer files) must be a readable regular file that resolves inside the
folder, or, for a Hugging Face cache snapshot (``.../models--ORG--NAME/snapshots/<rev>/``), inside that
repository's ``blobs/`` (:func:`folder_file`). A path given directly must be a readable regular file
(:func:`regular_file`). Every refusal is one :class:`~specmerge.io.formats.protocol.SourceError` line saying what
the path is (a link elsewhere, a dangling link, a loop, a folder, a device) and what to do.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from pathlib import Path

from specmerge.io.formats.names import HF_CACHE_REPO_PREFIXES
from specmerge.io.formats.protocol import SourceError


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
        target = link_target(path)
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
        raise unusable(path, label, err, missing) from None
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
        raise unusable(path, label, err) from None
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


def link_target(path: Path) -> str | None:
    """Where the symbolic link ``path`` points (as written in the link), or None when it is not a link."""
    try:
        return os.readlink(path)
    except OSError:
        return None


def unusable(path: Path, label: str, err: OSError, missing: str = "does not exist") -> SourceError:
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
        target = link_target(path)
        if target is not None:
            return SourceError(
                f"{label} is a symbolic link to {target}, which does not exist; an interrupted download leaves "
                "such links: download the checkpoint again"
            )
        return SourceError(f"{label} {missing}")
    if code == errno.EISDIR:
        return SourceError(f"{label} is a folder, not a file")
    return SourceError(f"{label}: cannot be read ({err.strerror or err})")


def is_plain_file(path: Path) -> bool:
    """Whether ``path`` is a regular file and not a symbolic link."""
    return path.is_file() and not path.is_symlink()


def read_json(path: Path) -> object:
    """The JSON in a regular file, or None (missing, a link, unreadable, not JSON)."""
    if not is_plain_file(path):
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def write_json(path: Path, value: object, indent: int = 1) -> None:
    """Write ``value`` as JSON (UTF-8, a final newline)."""
    path.write_text(json.dumps(value, indent=indent) + "\n", encoding="utf-8")
