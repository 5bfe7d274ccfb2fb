"""Filling the spectral cache for a recipe: every spectral layer read, keyed by content, decomposed once if missing.

:func:`cached_layers` runs :class:`CacheBuild` (a :class:`~specmerge.pipeline.run.work.Job`, so the streaming executor
reads the next layer while this one is decomposed and writes behind) over the recipe's plan and returns the stored
projections by tensor name, ready for :func:`specmerge.pipeline.run.api.run_recipe`'s ``layers``. Every input of a
spectral layer is read and hashed on every call, so an entry is used only for the very bytes it was made from
(the hashing costs about one read of those inputs: 10 s for the 1.1B Llama set); layers already stored are not
decomposed again.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specmerge.linalg.solve import FreshLayer, Kept
from specmerge.pipeline.estimate.cost import expert_kind
from specmerge.pipeline.plan.prepare import PreparedMerge, prepare_merge
from specmerge.pipeline.recipe.model import Recipe
from specmerge.pipeline.run.compute import spectral_stack
from specmerge.pipeline.run.jobs import ComputeOptions
from specmerge.pipeline.run.work import Inputs, Outcome, Progress, WorkItem, stage_inputs
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
class _Read(Inputs):
    """A layer's inputs (staged on the device when the job stages them), its entry's key and the spectra the cache
    lacks for it (looked up once, when read)."""

    key: str = ""
    missing: tuple[str, ...] = ()


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
        self.on_cpu: frozenset[str] = frozenset()  # layers the device plan decomposes on the CPU (they do not fit)
        self._stream: Any = None

    @functools.cached_property
    def progress(self) -> Progress:
        return Progress(tuple(float(max(item.entry.shape)) ** 3 for item in self.items), desc="spectral cache")

    def _device(self, item: WorkItem) -> torch.device:
        return torch.device("cpu") if item.name in self.on_cpu else self.options.device

    def read(self, item: WorkItem) -> _Read:
        base = self.prepared.base.load(item.name)
        values = [expert.read(item.name) for expert in self.prepared.experts]
        o, device = self.options, self._device(item)
        key = content_key(item.entry, base, values, compute_dtype=o.compute_dtype, device=device, code=self._code)
        missing = tuple(k for k in spectrum_kinds(item.entry, self.kept) if not self.cache.has(key, self.tau_inits, k))
        return _Read(base, values, key=key, missing=missing)

    def stage(self, item: WorkItem, inputs: _Read) -> _Read:
        """On a GPU, the layer's inputs copied there on a side stream while the previous layer is decomposed (as a
        merge stages them: :func:`~specmerge.pipeline.run.work.stage_inputs`); as they are on the CPU. Copied only
        when the layer is decomposed there and the cache lacks it."""
        device = self._device(item)
        if device.type != "cuda" or not inputs.missing:
            return inputs
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        staged = stage_inputs(inputs, device, self._stream)
        return _Read(staged.base, staged.values, staged.ready, key=inputs.key, missing=inputs.missing)

    def compute(self, item: WorkItem, inputs: _Read) -> Outcome:
        self.keys[item.name] = inputs.key
        if not inputs.missing:
            return Outcome(None, {"cached": True})
        o = dataclasses.replace(self.options, device=self._device(item))
        stack = spectral_stack(item.entry, inputs.base, inputs.values, device=o.device, compute_dtype=o.compute_dtype)
        layer, files = FreshLayer(stack), {}
        for kind in inputs.missing:
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
) -> StoredLayers:
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
            return StoredLayers()
        if options.device.type == "cuda":
            job.on_cpu = cpu_layers(prepared, options, options.device)
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
    room, where = resident_room(recipe, options.device)
    resident = stored <= room / 2
    if resident:
        log(f"spectral cache: {stored / 2**30:.2f} GiB kept in {options.device} memory for the settings")
    else:
        log(f"spectral cache: {stored / 2**30:.2f} GiB is more than half of {where} ({room / 2**30:.2f} GiB): "
            f"each setting reads it from {root}")  # fmt: skip
    layers = StoredLayers({name: cache.layer(key, options.device, resident=resident) for name, key in job.keys.items()})
    layers.resident_bytes = stored if resident else 0
    return layers


def cpu_layers(prepared: PreparedMerge, options: ComputeOptions, device: torch.device | None) -> frozenset[str]:
    """The spectral layers whose decomposition the device plan (:mod:`specmerge.pipeline.run.device_plan`, the
    budget ``gpu_memory`` or the free memory less a margin) cannot fit on ``device``: decomposed on the CPU, one
    console line each. ``device`` None: a GPU that is not here (the budget must be given)."""
    from specmerge.pipeline.run import device_plan
    from specmerge.pipeline.run.jobs import ModelJob

    planning = ModelJob(prepared.plan, prepared.base, prepared.experts, None, options)  # the plan reads shapes only
    plan, _ = device_plan.plan_for(planning, prepared.recipe, device)
    device_plan.say_cpu_layers(plan)
    return frozenset(name for name, _ in plan.cpu_layers())


class StoredLayers(dict[str, CachedLayer]):
    """The spectral cache's layers by tensor name; ``resident_bytes``: what they hold in the device's memory once
    every setting has loaded them (0 when they are read from disk for each setting)."""

    resident_bytes: int = 0

    def release(self) -> None:
        """Drop what the layers hold in memory (their files stay; a later merge reads them again)."""
        for layer in self.values():
            layer.release()
        self.resident_bytes = 0


def resident_room(recipe: Recipe, device: torch.device) -> tuple[int, str]:
    """The memory a resident spectral cache may take half of, and what it is: on a GPU the device plan's budget
    (``gpu_memory``, else the free memory less a margin), on the CPU the available memory."""
    if device.type == "cuda":
        from specmerge.pipeline.run.device_plan import budget_for

        return budget_for(recipe, device)
    return available_memory(device), "the available memory"


def available_memory(device: torch.device) -> int:
    """Bytes free on ``device``: the GPU's free memory, or the system's available memory for the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:  # Linux; elsewhere 0, so that nothing is kept resident
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
