"""The accuracy benchmark's settings: the eight tasks, or sixteen (those and eight more), each set built once."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from specmerge_bench.accuracy.data import MORE_TASKS, TASKS, build_tasks
from specmerge_bench.accuracy.experts import build_experts

SETTINGS = {8: (TASKS,), 16: (TASKS, MORE_TASKS)}  # the task sets of each setting, each built as its own stages


def build_setting(
    cache_dir: str | Path,
    seeds: Sequence[int] = (0,),
    n_tasks: int = 8,
    *,
    manifest: Mapping | None = None,
    log: Callable[[str], None] | None = None,
    **options: Any,
) -> dict:
    """``build_experts`` for each task set of the ``n_tasks`` setting (``SETTINGS``), combined into one summary.

    The 16-task setting is the eight tasks and ``MORE_TASKS``, each set with its own tokens, probes and experts
    stages, so it reuses everything the 8-task setting built (a probe head and an expert depend on their own
    task only). The summary is ``build_experts``'s with ``paths["tokens"]`` and ``paths["heads"]`` lists (one
    file per set), the per-task entries of every set, the stage seconds summed, and ``experts_key``: the sets'
    experts keys joined by ``+`` (for the 8-task setting, its one key). ``manifest`` (one task set) replaces the
    Debian-derived tasks; ``options`` go to ``build_experts``.
    """
    if manifest is not None:
        manifests = [manifest]
    elif n_tasks in SETTINGS:
        manifests = [build_tasks(cache_dir, names=names) for names in SETTINGS[n_tasks]]
    else:
        raise ValueError(f"no {n_tasks}-task setting; choose one of {', '.join(map(str, SETTINGS))}")
    parts = [build_experts(cache_dir, seeds, manifest=m, log=log, **options) for m in manifests]
    first = parts[0]
    return {
        **first,
        "tasks": [task for part in parts for task in part["tasks"]],
        "paths": {
            "tokens": [part["paths"]["tokens"] for part in parts],
            "heads": [part["paths"]["heads"] for part in parts],
            "experts": {seed: {k: v for p in parts for k, v in p["paths"]["experts"][seed].items()} for seed in seeds},
        },
        "probes": {task: entry for part in parts for task, entry in part["probes"].items()},
        "experts": {seed: {k: v for p in parts for k, v in p["experts"][seed].items()} for seed in seeds},
        "seconds": {stage: sum(part["seconds"][stage] for part in parts) for stage in first["seconds"]},
        "cached": {stage: all(part["cached"][stage] for part in parts) for stage in first["cached"]},
        "experts_key": "+".join(
            Path(next(iter(p["paths"]["experts"][seeds[0]].values()))).parents[1].name for p in parts
        ),
    }


def _experts_key(built: Mapping[str, Any], seed: int) -> str:
    """The experts stage's key of one ``build_experts`` summary (the folder above its seed folders)."""
    return Path(next(iter(built["paths"]["experts"][seed].values()))).parents[1].name
