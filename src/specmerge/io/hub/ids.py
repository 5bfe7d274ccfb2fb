"""Inputs given as Hugging Face hub ids: which specs are ids, and which local files each input reads.

A base or expert is given as a local path or as a hub id, ``org/name`` or ``name``, with an optional
``@revision`` (a branch, tag or commit, full or a unique short prefix of a cached one). A path that exists
locally always wins; when it also has the shape of an id, a line says so if the hub cache holds a repository of
that id (which may have been meant), else only with ``--verbose``. An id is resolved by
:func:`resolve_input` to its snapshot folder in the Hugging Face cache, downloading only the files a merge
reads (:mod:`specmerge.io.hub.snapshot`). The environment is read when the call is made, as the client reads it
at import: ``HF_HUB_CACHE`` (or ``HF_HOME``/hub, ``XDG_CACHE_HOME``/huggingface/hub, ~/.cache/huggingface/hub),
``HF_HUB_OFFLINE`` (only the cache), ``HF_ENDPOINT``; the token is the client's (``HF_TOKEN`` or the token
file). The snapshot is then read like any model folder: every file must resolve inside it or inside that
repository's own ``blobs/`` (:func:`specmerge.io.formats.files.folder_file`).

Each resolution is logged to the ``specmerge.inputs`` logger (INFO; a local path of an id's shape that no cached
repository shares: DEBUG); :func:`announce_inputs` prints those lines on stderr while a command runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TextIO

from specmerge.io.formats.files import link_target
from specmerge.io.hub.snapshot import HubError, fetch_snapshot, repo_cache_folder
from specmerge.io.output.folder import OUTPUT_LOG

__all__ = [
    "HUB_SPEC",
    "HubError",
    "InputResolution",
    "absolute_spec",
    "announce_inputs",
    "hub_cache",
    "hub_offline",
    "is_hub_spec",
    "parse_hub_id",
    "resolve_input",
]

LOG = logging.getLogger("specmerge.inputs")
_PART = r"\w(?:[\w.-]{0,94}\w)?"  # a repository or organisation name, as the hub accepts them
HUB_ID = re.compile(rf"(?:{_PART}/)?{_PART}")
NOT_IDS = (".safetensors", ".bin", ".pt", ".pth", ".json", ".yaml", ".yml")  # file names, never ids
HUB_SPEC = "hub id org/name[@revision] (a local path of that name wins)"  # for help texts
TRUE_VALUES = {"1", "ON", "YES", "TRUE"}  # as huggingface_hub reads its boolean variables
_QUIET = contextvars.ContextVar("specmerge_hub_quiet", default=False)


def console_quiet() -> bool:
    """Whether the command runs with ``--quiet`` (:func:`announce_inputs` with ``enabled`` False): errors only."""
    return _QUIET.get()


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``spec`` has the shape of a hub id (``org/name`` or ``name``, optionally
    ``@revision``; revision None when not given), else None. Paths such as ``./x``, ``/x``, ``~/x``, ``a/b/c`` or
    ``x.safetensors`` are never ids."""
    repo, at, revision = spec.partition("@")
    if at and (not revision or re.search(r"[\s\\]", revision) or ".." in revision or revision.startswith("/")):
        return None
    if not HUB_ID.fullmatch(repo) or "--" in repo or ".." in repo or repo.lower().endswith(NOT_IDS):
        return None
    return repo, revision or None


def is_hub_spec(spec: str, folder: str | os.PathLike | None = None) -> bool:
    """Whether ``spec`` is taken as a hub id: it has an id's shape and nothing exists at that path (relative to
    ``folder``, default the current folder)."""
    return parse_hub_id(spec) is not None and not os.path.lexists(Path(folder or ".") / spec)


def absolute_spec(spec: str, folder: str | os.PathLike | None = None) -> str:
    """``spec`` as recipes hold it: a hub id unchanged (:func:`is_hub_spec`), a path joined to ``folder`` (default:
    the current folder, which makes it absolute) and normalised. A local path that also has an id's shape is
    logged: it wins."""
    if is_hub_spec(spec, folder):
        return spec
    path = os.path.normpath(os.path.join(folder or os.getcwd(), spec))
    hub = parse_hub_id(spec)
    if hub is not None:
        _log_local_wins(spec, path, hub[0])
    return path


@dataclass(frozen=True)
class InputResolution:
    """Where one input spec was found: a local path as given, or a hub id's cache snapshot."""

    spec: str  # as given (in the recipe or on the command line)
    path: Path  # the local file or folder that is read (for a hub id: <cache>/models--ORG--NAME/snapshots/<commit>)
    origin: Literal["local", "hub"]
    repo_id: str | None = None
    revision: str | None = None  # as asked (None: the default branch)
    commit: str | None = None  # the commit of the snapshot read
    offline_reason: str | None = None  # why only the cache was used (None: the hub was asked, or a local path)

    @property
    def pinned(self) -> str:
        """A spec that names exactly what was read: ``org/name@<commit>`` for a hub id, the path otherwise."""
        return f"{self.repo_id}@{self.commit}" if self.origin == "hub" else str(self.path)

    def line(self) -> str:
        """The line printed for this resolution."""
        if self.origin == "local":
            return _local_wins(self.spec, str(self.path))
        cache = f", from the cache only ({self.offline_reason})" if self.offline_reason else ""
        return f"{self.spec}: Hugging Face hub commit {str(self.commit)[:12]}{cache} -> {self.path}"

    def as_dict(self) -> dict[str, Any]:
        """What report.json says about it (no local path: the report is published with the merged folder)."""
        if self.origin == "local":
            return {"origin": "local", "hub_id_shape": parse_hub_id(self.spec) is not None}
        return {
            "origin": "hub",
            "repo_id": self.repo_id,
            "revision": self.revision,
            "commit": self.commit,
            "cache_only": self.offline_reason,
        }


def resolve_input(spec: str) -> InputResolution:
    """Where the files of the input ``spec`` are: the local path when anything exists there (relative paths
    from the current folder), else, for a spec shaped like a hub id, its cache snapshot (downloaded unless
    offline); else the path as given (opening it then says it does not exist). Raises HubError (one line)."""
    hub = parse_hub_id(spec)
    path = Path(spec).expanduser()
    if hub is None or os.path.lexists(path):
        if hub is not None:
            _log_local_wins(spec, str(path), hub[0])
        return InputResolution(spec, path, "local")
    repo_id, revision = hub
    cache = hub_cache()
    endpoint = os.environ.get("HF_ENDPOINT", "").rstrip("/") or None
    snapshot = fetch_snapshot(
        repo_id, revision, cache=cache, offline=hub_offline(), endpoint=endpoint, quiet=_QUIET.get()
    )
    folder = snapshot.folder
    if os.path.islink(folder) or not folder.is_dir() or folder.parent.name != "snapshots":
        target = link_target(folder)
        raise HubError(
            f"Hugging Face hub id {spec}: the cache snapshot {folder} is "
            + (f"a symbolic link to {target}" if target else "not a folder")
            + f", not a folder of the cache; remove {folder.parent.parent} and download it again"
        )
    resolution = InputResolution(spec, folder, "hub", repo_id, revision, snapshot.commit, snapshot.offline_reason)
    LOG.info(resolution.line())
    return resolution


def hub_cache() -> Path:
    """The Hugging Face hub cache folder, from the environment as it is now (as ``huggingface_hub`` reads it)."""
    env = os.environ
    xdg = env.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    default_home = os.path.join(xdg, "huggingface")
    home = os.path.expandvars(os.path.expanduser(env.get("HF_HOME", default_home)))
    cache = env.get("HF_HUB_CACHE", env.get("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub")))
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set to a true value now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return value is not None and value.upper() in TRUE_VALUES


@contextlib.contextmanager
def announce_inputs(enabled: bool, stream: TextIO | None = None, *, verbose: bool = False) -> Iterator[None]:
    """While the block runs, print each input resolution (and each folder created for the output, logger
    ``specmerge.output``) as ``specmerge: <line>`` on ``stream`` (default: stderr) and let downloads show their
    progress bars; with ``verbose`` (``--verbose``) the DEBUG lines too (a local path of an id's shape, not in
    the cache); with ``enabled`` False (``--quiet``) only the warnings: whatever makes the output other than what
    was asked (a module the output's config will not load, a semantic config difference, an unrelated expert, a
    lossy output) is said even then."""
    quiet = _QUIET.set(not enabled)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setLevel(logging.NOTSET if enabled else logging.WARNING)
    handler.setFormatter(logging.Formatter("specmerge: %(message)s"))
    shown: set[str] = set()  # a spec seen twice (made absolute, then resolved) is said once
    handler.addFilter(lambda record: not (record.getMessage() in shown or shown.add(record.getMessage())))
    loggers = (LOG, logging.getLogger(OUTPUT_LOG))
    saved = [(log.level, log.propagate) for log in loggers]
    for log in loggers:
        log.addHandler(handler)
        log.setLevel(logging.DEBUG if verbose and enabled else logging.INFO)
        log.propagate = False
    try:
        yield
    finally:
        for log, (level, propagate) in zip(loggers, saved, strict=True):
            log.removeHandler(handler)
            log.setLevel(level)
            log.propagate = propagate
        _QUIET.reset(quiet)


def _log_local_wins(spec: str, path: str, repo_id: str) -> None:
    """Log that the local ``path`` is read for ``spec``, which has the shape of hub id ``repo_id``: at INFO (printed)
    when the hub cache holds that repository, which may have been meant; at DEBUG (``--verbose``) otherwise."""
    cached = repo_cache_folder(hub_cache(), repo_id).is_dir()
    LOG.log(logging.INFO if cached else logging.DEBUG, _local_wins(spec, path))


def _local_wins(spec: str, path: str) -> str:
    path = os.path.abspath(path)
    return (
        f"{spec}: the local {'folder' if os.path.isdir(path) else 'path'} {path}, not the Hugging Face hub id of "
        "that name (a local path wins; run from another folder to use the hub's)"
    )
