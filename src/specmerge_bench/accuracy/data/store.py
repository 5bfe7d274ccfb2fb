"""The derived tasks on disk: split files, their manifest, and the cache key that decides when to rebuild."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

from specmerge_bench.accuracy.data.fetch import AccuracyDataError, fetch_sources
from specmerge_bench.accuracy.data.more_tasks import MORE_TASKS, derive_more_tasks
from specmerge_bench.accuracy.data.parse import read_sources
from specmerge_bench.accuracy.data.splits import SplitSizes, TaskSplits
from specmerge_bench.accuracy.data.tasks import TASKS, derive_tasks

SPLITS = ("train", "val", "test")


def code_hash() -> str:
    """SHA-256 over the source of the modules that build the tasks: every module of this package (fetching,
    parsing, splitting, derivations, writing) except its command line ``__main__.py``, by file name and bytes.

    A module added to the package is hashed without being listed anywhere."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        if path.name != "__main__.py":
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def write_split(path: Path, rows: Sequence[tuple[str, int]]) -> str:
    """Write ``rows`` as JSON lines ``{"text": ..., "label": ...}`` (UTF-8); return the file's SHA-256."""
    data = "".join(json.dumps({"text": text, "label": label}, ensure_ascii=False) + "\n" for text, label in rows)
    path.write_text(data, encoding="utf-8")
    return hashlib.sha256(data.encode("utf-8")).hexdigest()


def read_split(path: str | Path) -> list[tuple[str, int]]:
    """The (text, label id) rows of a split file written by ``write_split``."""
    with open(path, encoding="utf-8") as f:
        return [(row["text"], row["label"]) for row in map(json.loads, f)]


def write_tasks(tasks: Mapping[str, TaskSplits], out_dir: Path) -> dict[str, dict]:
    """Write every task's splits and ``labels.json`` under ``out_dir/<task>/``; return their manifest entries."""
    entries = {}
    for name, task in tasks.items():
        folder = out_dir / name
        folder.mkdir(parents=True)
        (folder / "labels.json").write_text(json.dumps(list(task.labels), ensure_ascii=False) + "\n", encoding="utf-8")
        splits = {}
        for split in SPLITS:
            rows = getattr(task, split)
            splits[split] = {"size": len(rows), "sha256": write_split(folder / f"{split}.jsonl", rows)}
        entries[name] = {"labels": list(task.labels), "splits": splits}
    return entries


def tasks_key(record: Mapping, seed: int, sizes: SplitSizes, names: Sequence[str] = TASKS) -> str:
    """Cache key of the derived tasks: source hashes, data seed, split sizes, the task names and the code that
    builds them (:func:`code_hash`)."""
    inputs = {
        "tasks": list(names),
        "packages": {name: p["sha256"] for name, p in record["packages"].items()},
        "indexes": record["indexes"],
        "files": record["files"],
        "seed": seed,
        "sizes": asdict(sizes),
        "code": code_hash(),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def build_tasks(
    cache_dir: str | Path, seed: int = 0, sizes: SplitSizes | None = None, names: Sequence[str] = TASKS
) -> dict:
    """Fetch the sources, derive the tasks of ``names`` (default the eight of ``TASKS``; any of ``TASKS`` and
    ``MORE_TASKS``) and write them; return the manifest (cached by its inputs).

    The manifest (``<cache_dir>/<tasks_dir>/manifest.json``) records ``tasks_dir`` (relative to
    ``cache_dir``), the key, seed and sizes, the source record of ``fetch_sources``, and per task its labels
    and per split its size and SHA-256.
    """
    cache_dir = Path(cache_dir).resolve()
    sizes = sizes or SplitSizes()
    record = fetch_sources(cache_dir)
    unknown = [name for name in names if name not in TASKS + MORE_TASKS]
    if unknown or not names:
        raise AccuracyDataError(f"unknown tasks {unknown}; choose from {', '.join(TASKS + MORE_TASKS)}")
    key = tasks_key(record, seed, sizes, names)
    tasks_dir = Path("tasks") / key[:16]
    manifest_path = cache_dir / tasks_dir / "manifest.json"
    if manifest_path.is_file():
        return json.loads(manifest_path.read_text(encoding="utf-8"))

    sources = read_sources(cache_dir, record)
    derived = {
        **derive_tasks(sources, seed, sizes, [name for name in names if name in TASKS]),
        **derive_more_tasks(sources, seed, sizes, [name for name in names if name in MORE_TASKS]),
    }
    tasks = {name: derived[name] for name in names}
    staging = cache_dir / "tasks" / f".{key[:16]}.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    manifest = {
        "tasks_dir": str(tasks_dir),
        "key": key,
        "seed": seed,
        "sizes": asdict(sizes),
        "sources": record,
        "tasks": write_tasks(tasks, staging),
    }
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    try:
        os.replace(staging, cache_dir / tasks_dir)
    except OSError:  # another process finished the same build first
        shutil.rmtree(staging)
    return json.loads(manifest_path.read_text(encoding="utf-8"))
