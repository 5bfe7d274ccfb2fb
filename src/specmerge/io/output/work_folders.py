"""Work folders: where an output is written before it appears, and how abandoned ones are found and removed.

An output ``<parent>/<name>`` is written in a hidden work folder beside it, ``.<name>.specmerge-tmp-<hex>/``,
holding ``owner.json`` (the writing process: host, pid, start time, boot id, pid namespace) and ``output/``
(renamed onto the target once complete); an overwritten target waits in ``replaced/`` until the new output
is in place. A work folder whose process has certainly exited (killed, crashed, machine rebooted) is removed
by the next write into the same parent (:func:`remove_stale_work_folders`); one of a live process never is.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
from pathlib import Path

from specmerge.io.formats.files import read_json

WORK_INFIX = ".specmerge-tmp-"
OWNER_FILE = "owner.json"
WORK_OUTPUT = "output"
WORK_REPLACED = "replaced"  # an overwritten target, moved here just before the new output takes its place
NAME_MAX = 255  # bytes in a file name on common file systems


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
            owner = read_json(work / OWNER_FILE)
            name = owner.get("target") if isinstance(owner, dict) else None
            if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
                continue
            if _owner_gone(owner):
                abandon(work, work.parent / name)
                removed.append(work)
    return removed


def abandon(work: Path, target: Path) -> None:
    """Delete a work folder, after putting back the target it replaced (kept there if that place is taken)."""
    replaced = work / WORK_REPLACED
    if os.path.lexists(replaced):
        try:
            os.rename(replaced, target)
        except OSError:
            remove(work / WORK_OUTPUT)
            remove(work / OWNER_FILE)  # no longer a work folder: nothing will remove what it keeps
            return
    remove(work)


def work_name(name: str) -> str:
    """``.<name>.specmerge-tmp-<hex>``, ``name`` cut to fit the file-name limit."""
    suffix = f"{WORK_INFIX}{secrets.token_hex(4)}"
    room = NAME_MAX - 1 - len(suffix)
    stem = name.encode("utf-8", "surrogateescape")[:room].decode("utf-8", "ignore")
    return f".{stem}{suffix}"


def this_process() -> dict[str, object]:
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
    me = this_process()
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


def remove(path: Path) -> None:
    """Best-effort removal of a folder or file (never masks the error being handled)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
