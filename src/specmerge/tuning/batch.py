"""Several settings of one recipe merged in one pass over the inputs, each written to its own model folder (or, for
a tune whose evaluation takes the model in memory, kept as a state dict: :func:`merge_in_memory`).

A tune's settings differ only in method parameters, so their plans name the same tensors with the same actions:
:func:`run_settings` reads each tensor once (the base's, and the experts' where a tensor is not served by the
spectral cache), computes it once per distinct setting of that tensor (an averaged embedding is the same for every
setting: computed once, written to each), and writes the outputs on parallel writer threads. Every output is the
model ``run_recipe`` writes for that setting (the same shards, config, tokenizer, ``recipe.yaml``, ``report.json``
and card, the same bits: ``tests/test_tune.py``), in a folder renamed into place only when complete.
:func:`merge_in_memory` runs the same job with the tensors collected instead of written: each state dict holds the
tensors, bit for bit, that ``run_recipe`` writes in that setting's shards.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from specmerge.errors import RecipeError
from specmerge.io.output.folder import atomic_directory, check_output
from specmerge.linalg.projection import Projection
from specmerge.linalg.solve import Kept, LayerProjections, ProjectionMissing
from specmerge.pipeline.inputs.open import refuse_output_inside_inputs
from specmerge.pipeline.plan.prepare import PreparedMerge, prepare_merge
from specmerge.pipeline.plan.rules import TensorPlan
from specmerge.pipeline.plan.summary import say_not_merged_once
from specmerge.pipeline.recipe.model import Recipe
from specmerge.pipeline.run.api import model_files, record_output, shard_writer
from specmerge.pipeline.run.executor import StreamingExecutor
from specmerge.pipeline.run.jobs import ComputeOptions, ModelJob
from specmerge.pipeline.run.memory import CollectedTensors
from specmerge.pipeline.run.quantized_output import output_quantizer
from specmerge.pipeline.run.threads import merge_threads
from specmerge.pipeline.run.work import Inputs, Outcome, ReportAccumulator, WorkItem

WRITERS = 4  # outputs written at once (page-cache copies scale with threads; the disk then flushes in the back)


class NotBatchable(ValueError):
    """The settings' plans differ in more than parameters (another method, action or shape for some tensor)."""


class SharedProducts:
    """A layer's stored projections for the settings of one work item, each solve allowed to build on an earlier
    one's product (:func:`~specmerge.linalg.projection.shared_update`); dropped when the item is done."""

    def __init__(self, layer: LayerProjections) -> None:
        self.layer, self.n_experts, self.n_total = layer, layer.n_experts, layer.n_total
        self._projections: dict[tuple[str, bool, bool], Projection] = {}

    def zeros(self) -> torch.Tensor:
        return self.layer.zeros()

    def wants_partial(self, kept: Kept) -> bool:
        return self.layer.wants_partial(kept)

    def projection(
        self, tau_init: str, *, accurate: bool = False, partial: bool = False, leading: int | None = None
    ) -> Projection:
        key = (tau_init, accurate, partial, leading if accurate else None)
        if key not in self._projections:
            p = self.layer.projection(tau_init, accurate=accurate, partial=partial, leading=leading)
            if p.held is None and not p.spectrum.partial:
                raise ProjectionMissing("only stored projections are shared between settings")
            self._projections[key] = p.sharing()  # its own list of products
        return self._projections[key]


class SettingsJob(ModelJob):
    """A :class:`~specmerge.pipeline.run.jobs.ModelJob` for several plans of the same tensors: each item read once,
    merged once per distinct plan entry, delivered to every setting's writer (in parallel)."""

    def __init__(
        self,
        plans: Sequence[Sequence[TensorPlan]],
        prepared: Any,
        writes: Sequence[Any],
        options: ComputeOptions,
        layers: Mapping[str, LayerProjections] | None,
        reuse: bool = False,
    ) -> None:
        super().__init__(plans[0], prepared.base, prepared.experts, writes[0], options, fsync=False, layers=layers)
        self.reuse = reuse
        self._item_layers: dict[str, SharedProducts] = {}
        self.plans = [{entry.name: entry for entry in plan} for plan in plans]
        self.writes = list(writes)
        self.accumulators = [ReportAccumulator(self.items) for _ in plans]
        self._pool = ThreadPoolExecutor(min(WRITERS, len(writes)), thread_name_prefix="specmerge-outputs")

    def batch_key(self, item: WorkItem) -> None:
        """Settings jobs compute one item at a time (each item merged once per plan)."""
        return None

    def _layer(self, item: WorkItem) -> LayerProjections | None:
        layer = super()._layer(item)
        if layer is None or not self.reuse:
            return layer
        return self._item_layers.setdefault(item.name, SharedProducts(layer))

    def compute(self, item: WorkItem, inputs: Inputs) -> Outcome:
        try:
            return self._compute(item, inputs)
        finally:
            self._item_layers.clear()  # the shared products of this item's settings

    def _compute(self, item: WorkItem, inputs: Inputs) -> Outcome:
        entries = [plan[item.name] for plan in self.plans]
        keys = [(e.action, e.method, json.dumps(e.params, sort_keys=True, default=str)) for e in entries]
        distinct = list(dict.fromkeys(keys))
        done: dict[tuple, tuple[Outcome, float]] = {}
        for n, key in enumerate(distinct):
            entry = entries[keys.index(key)]
            # a merge may write into the base tensor it was given (W_0 + delta in place): all but the last get a copy
            last = n == len(distinct) - 1 or inputs.base is None
            given = inputs if last else Inputs(inputs.base.clone(), inputs.values)
            start = time.perf_counter()
            done[key] = (super().compute(WorkItem(entry, item.rows), given), time.perf_counter() - start)
        for accumulator, key in zip(self.accumulators, keys, strict=True):
            outcome, seconds = done[key]
            accumulator.add(item, seconds, outcome.diagnostics)
        return Outcome([done[key][0].output for key in keys], done[keys[0]][0].diagnostics)

    def deliver(self, item: WorkItem, output: list[Any]) -> None:
        writing = [
            self._pool.submit(write, item.name, tensor, row_start=item.row_start)
            for write, tensor in zip(self.writes, output, strict=True)
        ]
        for future in writing:
            future.result()

    def close(self) -> None:
        self._pool.shutdown()


def _shape(plan: Sequence[TensorPlan]) -> list[tuple]:
    return [(e.name, e.action, e.method, e.shape, e.out_dtype, e.transposed) for e in plan]


def run_settings(
    recipes: Sequence[Recipe],
    outputs: Sequence[str | os.PathLike],
    *,
    layers: Mapping[str, LayerProjections] | None = None,
    threads: int | None = None,
    progress: bool = False,
    overwrite: bool = True,
    reuse: bool = False,
    homes: Sequence[str | os.PathLike] | None = None,
) -> list[dict]:
    """Merge ``recipes`` (one recipe at several settings of its parameters) into ``outputs`` in one pass; return each
    output's report. Raises :class:`NotBatchable` (before anything is written) when the plans differ beyond
    parameters. The outputs are not flushed to disk (a tune scores and removes them). ``reuse``: settings of a
    spectral layer that keep nested sets of directions at the same gains (SWUDI at several r) build each product on
    the previous one, which changes the order of a sum: equal to the separate merges to float32 rounding instead of
    bit for bit, and on a CPU several times faster for a grid over r. ``homes``: where each output will be used from
    once moved (``run_recipe``'s ``home``; default the outputs themselves)."""
    outputs = [Path(o) for o in outputs]
    for recipe, output in zip(recipes, outputs, strict=True):
        refuse_output_inside_inputs(output, [recipe.base, *recipe.experts])
        check_output(output, overwrite)
    options = ComputeOptions.for_recipe(recipes[0])
    started = time.perf_counter()
    with ExitStack() as stack:
        used = stack.enter_context(merge_threads(threads))
        prepared = [prepare_merge(stack, r, o) for r, o in zip(recipes, outputs, strict=True)]
        refuse_unbatchable(prepared)
        say_not_merged_once([(p.plan, p.recipe.method) for p in prepared])
        folders = [
            stack.enter_context(atomic_directory(o, overwrite=overwrite, expected_bytes=p.summary["bytes"]))
            for o, p in zip(outputs, prepared, strict=True)
        ]
        with ExitStack() as writing:
            writers = [writing.enter_context(shard_writer(p, f, False)) for p, f in zip(prepared, folders, strict=True)]
            job = _run_settings_job(prepared, [w.write for w in writers], options, layers, reuse, progress)
        extra = {"threads": used.threads, "threads_from": used.source, "merged_with_settings": len(recipes)}
        reports = []
        named_from = outputs if homes is None else [Path(h) for h in homes]
        for k, (p, folder, home) in enumerate(zip(prepared, folders, named_from, strict=True)):
            model_files(p, folder)
            reports.append(record_output(p, folder, home, options, job.accumulators[k].reports(), extra, started))
        return reports


def refuse_unbatchable(prepared: Sequence[PreparedMerge]) -> None:
    """:class:`NotBatchable` unless the prepared merges write models whose plans differ only in parameters."""
    if any(p.recipe.output_format != "model" for p in prepared) or len({str(_shape(p.plan)) for p in prepared}) > 1:
        raise NotBatchable("the settings' plans differ beyond method parameters: merge them one at a time")


def _run_settings_job(
    prepared: Sequence[PreparedMerge],
    writes: Sequence[Any],
    options: ComputeOptions,
    layers: Mapping[str, LayerProjections] | None,
    reuse: bool,
    progress: bool,
) -> SettingsJob:
    job = SettingsJob([p.plan for p in prepared], prepared[0], writes, options, layers, reuse)
    try:
        StreamingExecutor().run(job, progress=progress)
    finally:
        job.close()
    return job


def merge_in_memory(
    recipes: Sequence[Recipe],
    *,
    layers: Mapping[str, LayerProjections] | None = None,
    threads: int | None = None,
    reuse: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """Merge ``recipes`` (one recipe at several settings of its parameters) in one pass and return each setting's
    merged tensors (name -> CPU tensor, in the plan's order): the tensors ``run_recipe`` writes in its shards, bit
    for bit. Nothing is written. One recipe runs as ``run_recipe`` runs it (on a GPU with the device plan's
    batches); several as :func:`run_settings`. Raises :class:`NotBatchable` when the plans differ beyond
    parameters, and a :class:`~specmerge.errors.RecipeError` for a recipe whose model is written quantized or as a
    LoRA adapter (evaluate those from the folder)."""
    options = ComputeOptions.for_recipe(recipes[0])
    with ExitStack() as stack:
        stack.enter_context(merge_threads(threads))
        prepared = [prepare_merge(stack, recipe, None) for recipe in recipes]
        for p in prepared:
            if p.recipe.output_format != "model" or output_quantizer(p) is not None:
                what = "a LoRA adapter" if p.recipe.output_format != "model" else f"quantized ({p.recipe.quantize})"
                raise RecipeError(
                    f"this merge is written as {what}, which a state dict in memory would not be: evaluate the "
                    "candidates from their folders (candidates='disk')"
                )
        refuse_unbatchable(prepared)
        say_not_merged_once([(p.plan, p.recipe.method) for p in prepared])  # as a merge from folders says it
        collected = [CollectedTensors(p.plan) for p in prepared]
        if len(prepared) > 1:
            _run_settings_job(prepared, [c.write for c in collected], options, layers, reuse, False)
        else:
            _run_alone(prepared[0], collected[0], options, layers)
    return [c.state_dict({}, order=[e.name for e in p.plan]) for c, p in zip(collected, prepared, strict=True)]


def _run_alone(
    prepared: PreparedMerge,
    collected: CollectedTensors,
    options: ComputeOptions,
    layers: Mapping[str, LayerProjections] | None,
) -> None:
    """One setting's merge as ``run_recipe`` runs it, into ``collected``."""
    job = ModelJob(prepared.plan, prepared.base, prepared.experts, collected.write, options, fsync=False, layers=layers)
    executor = StreamingExecutor()
    if options.device.type == "cuda":  # batches and the CPU for what does not fit, as run_recipe plans them
        from specmerge.pipeline.run import device_plan

        device_plan.plan_and_apply(job, executor, prepared.recipe)
    executor.run(job, progress=False)
