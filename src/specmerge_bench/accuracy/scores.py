"""The accuracy benchmark's score cache: by setting under one merge code, and by the weights that were scored.

Two JSON files per seed, both under ``scores/<experts key>/``:

- ``seed<k>-<code key>-<precision tag>.json``: ``<candidate>|<scale>|<split>`` -> task -> accuracy, as the merge
  code of that code key (:func:`code_key`) computed it, and next to each, ``...|weights``: the digest of the
  state dict that was scored (:func:`weights_digest`). A rerun under the same code merges nothing it has.
- ``seed<k>-<precision tag>-by-weights.json``: ``<digest>|<what>`` -> the same values, whatever code produced
  the weights. After a change to the merge code the candidates are merged again, and only those whose weights
  changed by a bit are scored again: a change that moves one method's outputs re-scores that method only.

A score depends on the scored weights, the tasks, the probe heads and the precision: the first is the digest,
the others are in the folder and file names. Two equal digests are two equal state dicts (names, dtypes, shapes
and every byte), so a value found by digest is the value a new scoring would give on this machine.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

StateDict = Mapping[str, torch.Tensor]


@functools.cache
def code_key(track: str = "full") -> str:
    """A hash of the code that computes merges: cached scores are reused by setting only while it is unchanged
    (the LoRA track's merges also run the adapter reader, the merge's compute routes and :mod:`.lora`).

    Read from the files once per process: the key names the code this process runs, so an edit of a source file
    while a run goes on (a session working in the same checkout) neither splits the run's records over two keys
    nor files the old code's scores under the new code's key.
    """
    import specmerge

    core = Path(specmerge.__file__).resolve().parent
    here = Path(__file__).resolve()
    files = [
        *sorted(core.glob("methods/**/*.py")),  # every method, whatever file it is in
        *sorted(core.glob("linalg/**/*.py")),
        core / "pipeline" / "plan" / "rules.py",
        core / "pipeline" / "recipe" / "model.py",
        here.with_name("merging.py"),
    ]
    if track == "lora":
        files += [
            core / "io" / "formats" / "peft.py",
            core / "pipeline" / "run" / "compute.py",
            here.with_name("lora.py"),
        ]
    return files_digest(files)


def files_digest(files: Iterable[Path]) -> str:
    """The first 12 hex digits of the SHA-256 of ``files``' names and bytes, in the order given."""
    hashed = hashlib.sha256()
    for file in files:
        hashed.update(file.name.encode())
        hashed.update(file.read_bytes())
    return hashed.hexdigest()[:12]


def score_paths(cache_dir: Path, experts_key: str, seed: int, track: str = "full") -> tuple[Path, Path]:
    """One seed's score files in the precision in use: by setting (``scores/<experts key>/seed<k>-<code key>-<tag>
    .json``) and by weights (``seed<k>-<tag>-by-weights.json``, shared by every code key)."""
    from specmerge_bench.accuracy import precision

    folder, tag = cache_dir / "scores" / experts_key, precision.tag()
    return folder / f"seed{seed}-{code_key(track)}-{tag}.json", folder / f"seed{seed}-{tag}-by-weights.json"


def weights_digest(state: StateDict) -> str:
    """A hash of a state dict: every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object read from ``path``; a ValueError (one line, naming the file) for text that is not one (an
    unreadable file stays an OSError, which names it)."""
    try:
        value = json.loads(Path(path).read_bytes())
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError included
        raise ValueError(f"{path} cannot be read as JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} is not a JSON object")
    return value


class JsonStore:
    """A dict on disk in one JSON file, rewritten atomically after each new entry."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.scores: dict[str, dict[str, Any]] = read_json_object(path) if path.is_file() else {}

    def put(self, key: str, value: dict[str, Any]) -> None:
        self.update({key: value})

    def update(self, entries: Mapping[str, dict[str, Any]]) -> None:
        """Add or replace ``entries``, with one atomic rewrite of the file."""
        self.scores.update(entries)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as f:
            json.dump(self.scores, f, indent=0, sort_keys=True)
        os.replace(f.name, self.path)


class ScoreCache(JsonStore):
    """Scores by setting (this file, one per experts, seed, code and precision) and, with ``by_weights``, by the
    digest of the weights scored (one file shared by every code key)."""

    def __init__(self, path: Path, by_weights: Path | None = None) -> None:
        super().__init__(path)
        self.by_weights = JsonStore(by_weights) if by_weights is not None else None

    def has(self, key: str) -> bool:
        """Whether ``key`` is cached, with the digest of its weights where weights are recorded."""
        return key in self.scores and (self.by_weights is None or f"{key}|weights" in self.scores)

    def scored(
        self,
        key: str,
        state: Callable[[], StateDict],
        compute: Callable[[StateDict], dict[str, Any]],
        what: str,
    ) -> dict[str, Any]:
        """The value of ``key``; else the value recorded for the weights ``state()`` returns, computed by
        ``compute(weights)`` only where no cached value has those weights. ``what`` names the computation
        (``val``, ``test``, an AdaMerging stage's key) in the digest's key.

        A value cached by setting before weights were recorded is kept, and its weights' digest recorded (under
        the same code key, the same code made them), so that the next code key finds it by digest.
        """
        if self.has(key):
            return self.scores[key]
        weights = state()
        if self.by_weights is None:
            self.put(key, compute(weights))
            return self.scores[key]
        digest = weights_digest(weights)
        content = f"{digest}|{what}"
        if key in self.scores:
            value = self.scores[key]
        elif content in self.by_weights.scores:
            value = self.by_weights.scores[content]
        else:
            value = compute(weights)
        if content not in self.by_weights.scores:
            self.by_weights.put(content, value)
        self.scores[f"{key}|weights"] = {"digest": digest}
        self.put(key, value)
        return value


def import_scores(kept_dir: Path, cache_dir: Path) -> int:
    """Add the scores by weights kept in ``kept_dir`` (``bench/accuracy_keep.py``) to ``cache_dir``'s; entries
    already there win. Returns how many were added; a ValueError (one line, naming the file) for a bad folder."""
    kept_dir = Path(kept_dir)
    if not (kept_dir / "scores").is_dir():
        raise ValueError(f"{kept_dir} holds no scores/ folder (give a folder written by bench/accuracy_keep.py)")
    added = 0
    for source in sorted((kept_dir / "scores").glob("*/seed*-by-weights.json")):
        store = JsonStore(Path(cache_dir) / source.relative_to(kept_dir))
        new = {k: v for k, v in read_json_object(source).items() if k not in store.scores}
        if new:
            store.update(new)
            added += len(new)
    return added
