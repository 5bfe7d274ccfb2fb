"""A Hugging Face hub cache laid out on disk exactly as ``huggingface_hub`` writes it, for offline tests.

``<cache>/models--ORG--NAME/`` holds ``blobs/<etag>`` (the file contents, named by their ETag: the SHA-256 of
an LFS file, the git blob SHA-1 of a small one), ``snapshots/<commit>/<path>`` (relative symbolic links into
``blobs/``), ``refs/<branch or tag>`` (the commit, no newline), optionally ``trees/<commit>.json`` (the tree
listing the client caches, format 1) and ``.no_exist/<commit>/<path>`` (files known not to exist).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

# Files the hub stores with LFS by default (.gitattributes of a new repository); the rest are git blobs.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".model", ".gguf")


def repo_folder(cache: Path, repo_id: str) -> Path:
    """``<cache>/models--ORG--NAME`` (huggingface_hub's ``repo_folder_name``)."""
    return cache / ("models--" + repo_id.replace("/", "--"))


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a file's contents: the ETag the hub gives a non-LFS file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(name: str) -> bool:
    return name.endswith(LFS_SUFFIXES)


def folder_files(folder: Path) -> dict[str, bytes]:
    """Every file of ``folder`` (recursively), by repository path."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def commit_hash(repo_id: str, files: Mapping[str, bytes]) -> str:
    """A made-up commit hash (40 hex digits) for a repository holding ``files``: the same files, the same hash."""
    listing = b"".join(n.encode() + git_blob_sha1(d).encode() for n, d in sorted(files.items()))
    return hashlib.sha1(repo_id.encode() + listing).hexdigest()


def add_commit(
    cache: Path,
    repo_id: str,
    files: Mapping[str, bytes],
    *,
    refs: Sequence[str] = ("main",),
    listed_only: Mapping[str, bytes] | None = None,
    tree: bool = False,
    no_exist: Collection[str] = (),
) -> str:
    """Add one commit of ``repo_id`` whose cached snapshot holds ``files`` (repository path -> contents) and point
    ``refs`` (branches or tags) at it; return the commit hash.

    ``listed_only`` are files the repository has at that commit but that were not downloaded (in the tree listing
    only); ``tree`` writes the tree listing (implied by ``listed_only``); ``no_exist`` marks files the client
    found missing on the hub.
    """
    repo = repo_folder(cache, repo_id)
    listed_only = dict(listed_only or {})
    every = {**files, **listed_only}
    commit = commit_hash(repo_id, every)
    for name, data in files.items():
        etag = hashlib.sha256(data).hexdigest() if is_lfs(name) else git_blob_sha1(data)
        blob = repo / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(data)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(link):
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        path = repo / "refs" / ref
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(commit)
    if tree or listed_only:
        listing = {}
        for name, data in sorted(every.items()):
            entry = {"size": len(data), "blob_id": git_blob_sha1(data)}
            if is_lfs(name):
                entry.update(lfs_sha256=hashlib.sha256(data).hexdigest(), lfs_size=len(data))
            listing[name] = entry
        trees = repo / "trees"
        trees.mkdir(parents=True, exist_ok=True)
        (trees / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": listing}, indent=1))
    for name in no_exist:
        marker = repo / ".no_exist" / commit / name
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    return commit


def snapshot(cache: Path, repo_id: str, commit: str) -> Path:
    """The snapshot folder of ``commit``."""
    return repo_folder(cache, repo_id) / "snapshots" / commit
