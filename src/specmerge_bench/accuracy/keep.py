"""What outlives the machine: the accuracy benchmark's small records, kept in a folder, and read back.

A seed of one setting takes about three hours of these 2 cores, and a later session may start on a fresh
machine with an empty cache. What can be kept is small and machine-independent: every JSON record of the cache
(task manifests with their SHA-256, stage summaries, each expert's own scores, the score caches, the results
folders) and the results' Markdown tables. The models, deltas and token files are not kept; they are rebuilt
from the Debian packages and the pinned base model.

- :func:`keep` copies those records into a folder (``bench/results/accuracy/`` in this repository), keeping the
  cache's layout; ``bench/accuracy_keep.py`` is the command.
- :func:`specmerge_bench.accuracy.scores.import_scores` puts the kept scores *by weights* back into a cache
  (``specmerge-bench accuracy --scores-from``). A score found there is used only for weights whose digest (every
  byte of the state dict) is the one scored, so a rebuilt expert or merge that differs by a bit is scored again;
  the scores by setting are never imported, since a rebuilt cache's experts key names the recipe, not the bytes.
- :func:`seed_from_scores` reads one seed's rows from a kept (or live) score file, so that a run stopped before
  its end still gives every row it finished (``bench/accuracy_settings.py``).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specmerge_bench.accuracy.scores import read_json_object

KEPT_MAX_BYTES = 4 << 20  # larger records are not kept (none of the benchmark's is near it)
SCORE_FILE = re.compile(r"seed(?P<seed>\d+)-(?P<code>[0-9a-f]{12})-(?P<tag>[A-Za-z0-9_.-]+)\.json")


class KeepError(ValueError):
    """A folder or file that cannot be kept or read back (one line, naming it)."""


def keep(cache_dir: Path, out_dir: Path) -> tuple[list[Path], list[Path]]:
    """Copy every JSON record of ``cache_dir`` and the results' Markdown tables, each up to ``KEPT_MAX_BYTES``,
    into ``out_dir``, same layout.

    Symbolic links are not followed (nothing outside the cache is read); each file is replaced atomically, so an
    interrupted copy leaves the previous one. A kept record that differs from the cache's only in its ``"cached"``
    flags, ``"seconds"`` times and the order of its keys is left as it is (:func:`_same_but_provenance`): a rerun
    that read an expert back from the cache rewrites its summary with ``"cached": true``, one on a fresh machine
    retrains it to the same scores in another time, and the kept copy (the run BENCHMARKS.md quotes, with its
    times) is the record worth keeping. Returns (kept, left out as too large).
    """
    cache_dir, out_dir = Path(cache_dir).resolve(), Path(out_dir).resolve()
    if not cache_dir.is_dir():
        raise KeepError(f"{cache_dir} is not a folder (give the --cache of specmerge-bench accuracy)")
    if out_dir == cache_dir or cache_dir in out_dir.parents:
        raise KeepError(f"{out_dir} lies inside the cache {cache_dir}; keep the records outside it")
    kept, large = [], []
    for root, dirs, files in os.walk(cache_dir):  # os.walk does not descend into linked folders
        dirs.sort()
        for name in sorted(files):
            path = Path(root) / name
            table = path.suffix == ".md" and path.relative_to(cache_dir).parts[0] == "results"  # not PEFT's cards
            if not (path.suffix == ".json" or table) or path.is_symlink() or not path.is_file():
                continue
            if path.stat().st_size > KEPT_MAX_BYTES:
                large.append(path)
                continue
            target, data = out_dir / path.relative_to(cache_dir), path.read_bytes()
            if path.suffix == ".json" and _same_but_provenance(data, target):
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=target.parent, delete=False, suffix=".tmp") as tmp:
                tmp.write(data)
            os.replace(tmp.name, target)
            kept.append(target)
    return kept, large


PROVENANCE = frozenset({"cached", "seconds", "eval_sentences_per_second"})  # what a rerun of the same work changes


def _without_provenance(value: Any) -> Any:
    """``value`` with every ``PROVENANCE`` key of its objects removed, at any depth."""
    if isinstance(value, dict):
        return {k: _without_provenance(v) for k, v in value.items() if k not in PROVENANCE}
    if isinstance(value, list):
        return [_without_provenance(v) for v in value]
    return value


def _same_but_provenance(data: bytes, target: Path) -> bool:
    """Whether ``target`` exists and holds the JSON ``data`` but for ``PROVENANCE`` keys and the order of keys (a
    rerun that read its scores back from the cache writes them in another order)."""
    if not target.is_file() or target.is_symlink():
        return False
    try:
        new, old = json.loads(data), json.loads(target.read_bytes())
    except (OSError, ValueError):
        return False  # unreadable either side: copy, as before
    return _without_provenance(new) == _without_provenance(old)


def _expert_scores(root: Path, experts_key: str, seed: int, lora: bool) -> dict[str, dict[str, float]]:
    """Task -> its expert's val / test accuracy on its own task, from each expert folder's ``scores.json``."""
    found: dict[str, dict[str, float]] = {}
    folder = "lora-experts" if lora else "experts"
    for key in experts_key.split("+"):
        for path in sorted((root / folder / key / f"seed{seed}").glob("*/scores.json")):
            task, record = path.parent.name, read_json_object(path)
            found[task] = {split: record[split][task] for split in ("val", "test")}
    return found


def seed_from_scores(score_file: Path) -> dict[str, Any]:
    """One seed's results (as in ``results.json``'s ``per_seed``) from a score file of ``scores/<experts key>/``:
    every row whose val grid and chosen test are all scored, chosen as the benchmark chooses (val only).

    The experts' own scores come from the expert folders beside ``scores/``: ``lora-experts/`` where it holds the
    seed's experts (the LoRA track), ``experts/`` otherwise. A file that cannot be read is a ValueError (one line).
    """
    from specmerge_bench.accuracy.bench import best_on_val
    from specmerge_bench.accuracy.rows import method_rows, step_rows
    from specmerge_bench.accuracy.scores import ScoreCache

    score_file = Path(score_file)
    match = SCORE_FILE.fullmatch(score_file.name)
    if not match or score_file.parent.parent.name != "scores" or not score_file.is_file():
        raise KeepError(f"{score_file} is not a score file (scores/<experts key>/seed<k>-<code key>-<precision>.json)")
    root, experts_key, seed = score_file.parents[2], score_file.parent.name, int(match["seed"])
    cache = ScoreCache(score_file)  # only read: nothing is written
    lora = bool(list((root / "lora-experts").glob(f"{experts_key.split('+')[0]}/seed{seed}")))
    experts = _expert_scores(root, experts_key, seed, lora)
    if not experts or "base|test" not in cache.scores:
        raise KeepError(f"{score_file}: no expert scores or no base score beside it (keep the whole cache record)")
    tasks = list(cache.scores["base|test"])
    result: dict[str, Any] = {"seed": seed, "track": "lora" if lora else "full", "tasks": tasks,
                              "base": {s: cache.scores[f"base|{s}"] for s in ("val", "test")},
                              "experts": {t: experts[t] for t in tasks}, "rows": {}}  # fmt: skip
    for row in method_rows() + step_rows():
        try:
            val_mean, candidate, scale = best_on_val(row, cache)
            test = cache.scores[f"{candidate.key}|{scale}|test"]
        except KeyError:
            continue  # not finished
        result["rows"][row.label] = {"title": row.title, "choice": candidate.describe(), "scale": scale,
                                     "val_mean": val_mean, "test": test}  # fmt: skip
    return result


def pool_seeds(per_seed: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The seeds restricted to the rows every one of them has (a stopped run lacks its last rows)."""
    common = [label for label in per_seed[0]["rows"] if all(label in s["rows"] for s in per_seed)]
    return [{**s, "rows": {label: s["rows"][label] for label in common}} for s in per_seed]
