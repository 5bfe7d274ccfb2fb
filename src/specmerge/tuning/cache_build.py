"""Filling the spectral cache for a recipe: every spectral layer read, keyed by content, decomposed once if missing.

:func:`cached_layers` runs :class:`CacheBuild` (a :class:`~specmerge.pipeline.run.work.Job`, so the streaming executor
reads the next layer while this one is decomposed and writes behind) over the recipe's plan and returns the stored
projections by tensor name, ready for :func:`specmerge.pipeline.run.api.run_recipe`'s ``layers``. Every input of a
spectral layer is read and hashed on every call, so an entry is used only for the very bytes it was made from
(the hashing costs about one read of those inputs: 10 s for the 1.1B Llama set); layers already stored are not
decomposed again.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specmerge.io.views.task_vectors import TaskVector
from specmerge.linalg.solve import FreshLayer, Kept
from specmerge.pipeline.estimate.cost import expert_kind
from specmerge.pipeline.plan.prepare import PreparedMerge, prepare_merge
from specmerge.pipeline.recipe.model import Recipe
from specmerge.pipeline.run.compute import spectral_stack
from specmerge.pipeline.run.jobs import ComputeOptions
from specmerge.pipeline.run.work import Outcome, Progress, WorkItem
from specmerge.tuning.spectral_cache import (
    CachedLayer,
    SpectralCache,
    cacheable,
    code_key,
    content_key,
    entry_files,
    estimate_bytes,
    spectrum_kinds,
)


@dataclass
class _Read:
    base: Any
    values: list[TaskVector]
    key: str


class CacheBuild:
    """The cacheable entries of a prepared merge as a job: read and key (reader thread), decompose what the cache
    lacks (here), write it (writer thread). ``keys`` maps each tensor name to its entry's key once run."""

    def __init__(
        self,
        prepared: PreparedMerge,
        cache: SpectralCache,
        options: ComputeOptions,
        tau_inits: Sequence[str],
        kept: Sequence[Kept] = (None,),
    ) -> None:
        self.prepared, self.cache, self.options, self.tau_inits = prepared, cache, options, list(tau_inits)
        self.kept = list(kept)
        experts = prepared.experts
        self.items = [
            WorkItem(e) for e in prepared.plan if cacheable(e, [expert_kind(x, e.name) for x in experts])
        ]  # fmt: skip
        self.keys: dict[str, str] = {}
        self.built = 0
        self.bytes_written = 0
        self._code = code_key()

    @functools.cached_property
    def progress(self) -> Progress:
        return Progress(tuple(float(max(item.entry.shape)) ** 3 for item in self.items), desc="spectral cache")

    def read(self, item: WorkItem) -> _Read:
        base = self.prepared.base.load(item.name)
        values = [expert.read(item.name) for expert in self.prepared.experts]
        o = self.options
        key = content_key(item.entry, base, values, compute_dtype=o.compute_dtype, device=o.device, code=self._code)
        return _Read(base, values, key)

    def compute(self, item: WorkItem, inputs: _Read) -> Outcome:
        self.keys[item.name] = inputs.key
        kinds = spectrum_kinds(item.entry, self.kept)
        missing = [kind for kind in kinds if not self.cache.has(inputs.key, self.tau_inits, kind)]
        if not missing:
            return Outcome(None, {"cached": True})
        o = self.options
        stack = spectral_stack(item.entry, inputs.base, inputs.values, device=o.device, compute_dtype=o.compute_dtype)
        layer, files = FreshLayer(stack), {}
        for kind in missing:
            kind_files, meta = entry_files(layer, self.tau_inits, partial=kind == "partial", kept=self.kept)
            files |= kind_files
        return Outcome((inputs.key, files, meta), {"cached": False})

    def deliver(self, item: WorkItem, output: Any) -> None:
        if output is not None:
            self.bytes_written += self.cache.write(*output)
            self.built += 1


def cached_layers(
    recipe: Recipe,
    root: Path,
    tau_inits: Sequence[str],
    *,
    kept: Sequence[Kept] = (None,),
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, CachedLayer]:
    """Fill the cache at ``root`` for ``recipe``'s spectral layers (the starts ``tau_inits``) and open its entries.

    ``kept``: what the settings' filters keep (:func:`specmerge.methods.spectral.kept_directions`), so that each layer
    stores the spectra they ask for (full, partial or both).

    Before anything is decomposed, the size of what is missing is printed; a disk without room for it is refused.
    Returns {} when the recipe merges no tensor with a spectral method (or only LoRA experts, merged on factors).
    """
    cache = SpectralCache(root)
    options = ComputeOptions.for_recipe(recipe)
    with ExitStack() as stack:
        prepared = prepare_merge(stack, recipe, None)
        job = CacheBuild(prepared, cache, options, tau_inits, kept)
        if not job.items:
            return {}
        size = estimate_bytes([i.entry for i in job.items], len(prepared.experts), tau_inits, kept=kept)
        root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(root).free
        log(f"spectral cache: {len(job.items)} layers, at most {size / 2**30:.2f} GiB in {root} "
            f"({free / 2**30:.1f} GiB free); layers stored already are reused")  # fmt: skip
        if size > free:
            existing = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
            if size - existing > free:
                raise OSError(
                    f"the spectral cache needs up to {size / 2**30:.2f} GiB in {root} and the disk has "
                    f"{free / 2**30:.1f} GiB free: give --cache a folder on a larger disk"
                )
        from specmerge.pipeline.run.executor import StreamingExecutor

        StreamingExecutor().run(job, progress=progress)
        if job.built:
            log(f"spectral cache: {job.built} layers decomposed and stored ({job.bytes_written / 2**30:.2f} GiB)")
    stored = sum(f.stat().st_size for key in set(job.keys.values()) for f in cache.folder(key).iterdir())
    resident = stored < available_memory(options.device) / 2
    if resident:
        log(f"spectral cache: {stored / 2**30:.2f} GiB kept in {options.device.type} memory for the settings")
    return {name: cache.layer(key, options.device, resident=resident) for name, key in job.keys.items()}


def available_memory(device: torch.device) -> int:
    """Bytes free on ``device``: the GPU's free memory, or the system's available memory for the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
