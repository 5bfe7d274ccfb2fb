"""Merged deltas on disk: a rerun under the same merge code loads each candidate's merge instead of computing it.

The merge stage of one seed takes about half an hour on 2 cores (the WUDI sweep to 5,000 steps alone about
15 minutes), and a long benchmark run is often stopped before its scoring ends (a session ends, the machine is
needed). :func:`stored_merge` wraps a merger so that every candidate it computes is written to
``merges/<experts key>/seed<k>-<code key>-<CPU capability>/<candidate>.safetensors`` as soon as its merge call
returns (the candidates first, then the WUDI sweep, so a stop during the sweep keeps the others), and is read back
next time.
The code key (:func:`specmerge_bench.accuracy.scores.code_key`) is in the folder name: a change to the merge code
merges again. Files are written to a temporary name and renamed into place, so a stop leaves no half-written one;
a stored file that cannot be read all the same (a damaged disk, an edit by hand) is a cache miss: it is merged again,
and its path is said on stderr.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from specmerge_bench.accuracy.merging import Candidate, MergedDeltas
from specmerge_bench.accuracy.scores import code_key

PARTS = ("method", "averaged")


class MergeStore:
    """One seed's merged deltas under one code key: a safetensors file per candidate."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.safetensors"

    def has(self, key: str) -> bool:
        """Whether ``key`` is stored and readable (its header and metadata parse and its file covers every tensor:
        safetensors checks the sizes on open). An unreadable file is reported on stderr and counts as absent, so
        the caller merges it again and :meth:`save` replaces it."""
        path = self.path(key)
        if not path.is_file():
            return False
        try:
            with safe_open(path, "pt") as f:
                meta = json.loads((f.metadata() or {})["specmerge_bench"])
        except (SafetensorError, OSError, KeyError, ValueError) as error:
            problem = f"{type(error).__name__}: {error}"
        else:
            if isinstance(meta, dict) and {"seconds", "routes"} <= meta.keys():
                return True
            problem = "its metadata lacks the benchmark's record"
        print(f"specmerge-bench: stored merge {path} is unreadable ({problem}); merging it again", file=sys.stderr)
        return False

    def save(self, key: str, deltas: MergedDeltas, seconds_key: str) -> None:
        tensors = {f"{part}/{name}": t.contiguous() for part in PARTS for name, t in getattr(deltas, part)[key].items()}
        meta = {"seconds": deltas.seconds.get(seconds_key, 0.0), "routes": deltas.routes.get(key)}
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.path(key).with_suffix(".tmp")
        save_file(tensors, partial, metadata={"specmerge_bench": json.dumps(meta)})
        os.replace(partial, self.path(key))

    def load(self, key: str, into: MergedDeltas, seconds_key: str) -> None:
        into.method[key], into.averaged[key] = {}, {}
        with safe_open(self.path(key), "pt") as f:
            meta = json.loads(f.metadata()["specmerge_bench"])
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                part, tensor = name.split("/", 1)
                getattr(into, part)[key][tensor] = f.get_tensor(name)
        into.seconds[seconds_key] = meta["seconds"]
        if meta["routes"] is not None:
            into.routes[key] = meta["routes"]


def seed_store(cache_dir: Path, experts_key: str, seed: int, track: str = "full") -> MergeStore:
    """One seed's store under the merge code in use: ``merges/<experts key>/seed<k>-<code key>-<CPU capability>``."""
    capability = torch.backends.cpu.get_cpu_capability()
    return MergeStore(cache_dir / "merges" / experts_key / f"seed{seed}-{code_key(track)}-{capability}")


def sweep_split(candidates: Iterable[Candidate]) -> tuple[list[Candidate], list[int]]:
    """A :data:`Merger`'s (candidates, WUDI steps) for ``candidates``: every WUDI candidate comes from the one run
    with snapshots, so it is named by its step count."""
    candidates = list(candidates)
    steps = sorted({c.params["steps"] for c in candidates if c.method == "wudi"})
    return [c for c in candidates if c.method != "wudi"], steps


Merger = Callable[[Sequence[Candidate], Sequence[int], bool], MergedDeltas]  # (candidates, WUDI steps, progress)


def stored_merge(merge: Merger, store: MergeStore) -> Merger:
    """``merge`` (a :data:`Merger`) whose results are kept in ``store``."""

    def run(candidates: Sequence[Candidate], steps: Sequence[int], progress: bool) -> MergedDeltas:
        sweep = {s: Candidate("wudi_steps", "wudi", {"steps": s}).key for s in steps}
        result = MergedDeltas({}, {}, {})
        todo = [c for c in candidates if not store.has(c.key)]
        if todo:
            fresh = merge(todo, [], progress)
            for c in todo:
                store.save(c.key, fresh, c.key)
        missing = [s for s, key in sweep.items() if not store.has(key)]
        if missing:
            fresh = merge([], missing, progress)
            for s in missing:
                store.save(sweep[s], fresh, "wudi_steps")
        for c in candidates:
            store.load(c.key, result, c.key)
        for key in sweep.values():
            store.load(key, result, "wudi_steps")
        return result

    return run
