"""The two jobs a merge runs through an executor: a merged model (shards) and a merged LoRA adapter (factors).

Both read the same way (:func:`~specmerge.pipeline.run.work.read_inputs`) and compute with the same functions
(:mod:`specmerge.pipeline.run.compute`); they differ in their sink. :class:`ModelJob` hands every merged tensor
(or block of rows) to a write function (a :class:`~specmerge.io.output.writer.ShardWriter`'s ``write``, which takes
them in any order); :class:`AdapterJob` keeps the merged LoRA factors of each tensor an adapter changes.
A NaN or Inf in an input is reported naming the files that hold it
(:func:`~specmerge.pipeline.run.finite.locate_nonfinite`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from specmerge.errors import SpecmergeError
from specmerge.io.formats.protocol import TensorSource
from specmerge.io.output.writer import Placement, ShardWriter, write_at
from specmerge.io.views.experts import Expert
from specmerge.linalg.lowrank import AdapterFactors
from specmerge.linalg.solve import LayerProjections, ProjectionMissing
from specmerge.methods import get_method
from specmerge.pipeline.estimate.cost import ItemCost, estimate_items
from specmerge.pipeline.plan.prepare import prepare_merge
from specmerge.pipeline.plan.rules import TensorPlan
from specmerge.pipeline.recipe.model import Recipe
from specmerge.pipeline.run.batched import batches_spectrally, merge_spectral_batch
from specmerge.pipeline.run.compute import (
    merge_adapter_tensor,
    merge_from_layer,
    merge_tensor,
    resolve_device,
    spectral_batchable,
)
from specmerge.pipeline.run.finite import NonFiniteInput, locate_nonfinite
from specmerge.pipeline.run.work import Inputs, Outcome, Progress, WorkItem, read_inputs, stage_inputs, work_items


@dataclass(frozen=True)
class ComputeOptions:
    """Where and how work items are computed: the device, the compute dtype and the keys that seed seeded
    methods (one per expert; None: seeded by content). Each tensor's expert weights are its plan's
    (``TensorPlan.weights``)."""

    device: torch.device
    compute_dtype: torch.dtype = torch.float32
    expert_keys: Sequence[str] | None = None

    @classmethod
    def for_recipe(cls, recipe: Recipe) -> ComputeOptions:
        """The recipe's device and compute dtype; seeded methods key each expert by its weights' content (no expert
        keys), so a merge never depends on folder names."""
        device, dtype = resolve_device(recipe.device), getattr(torch, recipe.compute_dtype)
        return cls(device, dtype, None)


class ModelJob:
    """A merged model: every planned tensor of the base, row-blocked where the work is row by row, merged and
    handed to ``write(name, tensor, row_start=...)`` (``row_start`` None for a whole tensor). ``fsync``: whether the
    writer flushes to disk (the estimate counts the disk's write rate then). ``layers``: stored projections by tensor
    name (a spectral cache's): a spectral method's entry found there reads only the base and is merged from them
    (:func:`~specmerge.pipeline.run.compute.merge_from_layer`), from the experts' values when they lack what it needs.
    ``recipe`` and ``shards`` (the writer behind ``write``) let other processes run its items (:meth:`remote`):
    they open the inputs themselves and write into the shards at each tensor's place."""

    def __init__(
        self,
        plan: Sequence[TensorPlan],
        base: TensorSource,
        experts: Sequence[Expert],
        write: Callable[..., None],
        options: ComputeOptions,
        *,
        block_bytes: int | None = None,
        fsync: bool = True,
        layers: Mapping[str, LayerProjections] | None = None,
        recipe: Recipe | None = None,
        shards: ShardWriter | None = None,
    ) -> None:
        self.base, self.experts, self.write, self.options = base, list(experts), write, options
        self.items = work_items(plan, options.compute_dtype.itemsize, block_bytes)
        self.fsync, self.layers, self.block_bytes = fsync, layers or {}, block_bytes
        self.recipe, self.shards = recipe, shards
        self.on_cpu: frozenset[str] = frozenset()  # tensors a device plan computes on the CPU (they do not fit)
        self._stream: Any = None  # the CUDA side stream inputs are staged on (stage)

    def on_device(self, device: torch.device) -> ModelJob:
        """This job computing on ``device``: a view sharing its inputs, plan and sink, with its own staging stream
        (:class:`~specmerge.pipeline.run.devices.DevicesExecutor` gives one to each device)."""
        view = copy.copy(self)
        view.options, view._stream = dataclasses.replace(self.options, device=device), None
        return view

    def stage(self, item: WorkItem, inputs: Inputs) -> Inputs:
        """On a CUDA device, ``inputs`` copied there on a side stream
        (:func:`~specmerge.pipeline.run.work.stage_inputs`) for an item merged or averaged on the device; as they are
        otherwise (the CPU, a kept tensor, a tensor the device plan sends to the CPU)."""
        device = self.options.device
        if device.type != "cuda" or item.entry.action == "keep_base" or item.name in self.on_cpu:
            return inputs
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return stage_inputs(inputs, device, self._stream)

    def _options(self, item: WorkItem) -> ComputeOptions:
        """Where ``item`` is computed: the job's device, or the CPU for a tensor the device plan sends there."""
        if item.name in self.on_cpu:
            return dataclasses.replace(self.options, device=torch.device("cpu"))
        return self.options

    def costs(self, *, probe: bool = True) -> list[ItemCost]:
        """The cost model's estimate of every item, in order
        (:func:`~specmerge.pipeline.estimate.cost.estimate_items`)."""
        o = self.options
        return estimate_items(
            self.items, self.base, self.experts, device=o.device, compute_dtype=o.compute_dtype,
            expert_keys=o.expert_keys, fsync=self.fsync, probe=probe,
        )[0]  # fmt: skip

    @functools.cached_property
    def progress(self) -> Progress:
        """Each item weighted by its estimated seconds."""
        return Progress(tuple(cost.seconds for cost in self.costs()), desc="merging")

    def _layer(self, item: WorkItem) -> LayerProjections | None:
        """The stored projections of a spectral method's whole-tensor entry, if there are any."""
        entry, layer = item.entry, self.layers.get(item.name)
        if layer is None or entry.action != "merge" or item.rows is not None or not get_method(entry.method).spectral:
            return None
        return layer

    def read(self, item: WorkItem) -> Inputs:
        if self._layer(item) is not None:
            return Inputs(self.base.load(item.name, item.rows), [])
        return read_inputs(item, self.base, self.experts)

    def compute(self, item: WorkItem, inputs: Inputs) -> Outcome:
        o = self._options(item)
        layer = self._layer(item)
        if layer is not None:
            try:
                merged, diagnostics = merge_from_layer(
                    item.entry, inputs.base, layer, device=o.device, compute_dtype=o.compute_dtype
                )
                return Outcome(merged, diagnostics)
            except ProjectionMissing:
                inputs = read_inputs(item, self.base, self.experts)
        try:
            merged, diagnostics = merge_tensor(
                item.entry,
                inputs.base,
                inputs.values,
                device=o.device,
                compute_dtype=o.compute_dtype,
                expert_keys=o.expert_keys,
                weights=item.entry.weights,
            )
        except NonFiniteInput as err:
            raise locate_nonfinite(item.entry, self.base, self.experts, err) from None
        return Outcome(merged, diagnostics)

    def deliver(self, item: WorkItem, output: Any) -> None:
        self.write(item.name, output, row_start=item.row_start)

    def batch_key(self, item: WorkItem) -> tuple | None:
        """Items of the same key may be computed together (:meth:`compute_batch`): whole weights that one spectral
        method merges with the same parameters, shape, layout and output dtype, with no stored projections and no
        per-expert weights; None: computed alone."""
        entry = item.entry
        if item.rows is not None or not spectral_batchable(entry) or entry.weights is not None:
            return None
        if item.name in self.layers or item.name in self.on_cpu:
            return None
        return (entry.method, repr(sorted(entry.params.items())), entry.shape, entry.transposed, entry.out_dtype)

    def compute_batch(self, items: Sequence[WorkItem], inputs: Sequence[Inputs]) -> list[Outcome]:
        """:meth:`compute` of items of one :meth:`batch_key`, their decompositions batched
        (:func:`~specmerge.pipeline.run.batched.merge_spectral_batch`) where every one takes the dense route: the same
        outputs as one call per item. A NaN or Inf in an input is reported as :meth:`compute` reports it."""
        o = self.options
        if not all(batches_spectrally(i.entry, x.values, o.device) for i, x in zip(items, inputs, strict=True)):
            return [self.compute(item, x) for item, x in zip(items, inputs, strict=True)]
        try:
            merged = merge_spectral_batch(
                [item.entry for item in items], [x.base for x in inputs], [x.values for x in inputs],
                device=o.device, compute_dtype=o.compute_dtype,
            )  # fmt: skip
        except NonFiniteInput:  # one at a time, in order: the first bad item's error, naming its files
            return [self.compute(item, x) for item, x in zip(items, inputs, strict=True)]
        return [Outcome(tensor, diagnostics) for tensor, diagnostics in merged]

    def remote(self) -> RemoteModelJob:
        """What a worker process needs to run this job's items (the shard files are created now); the spectral
        cache's ``layers`` stay here (a worker merges those tensors from the experts: the same bits)."""
        if self.recipe is None or self.shards is None:
            raise ValueError("this ModelJob runs in this process only: it was made without recipe= and shards=")
        return RemoteModelJob(
            uuid.uuid4().hex, self.recipe, self.options, items_digest(self.items), self.block_bytes,
            self.shards.placements(),
        )  # fmt: skip

    def delivered(self, item: WorkItem, returned: Any) -> None:
        """A worker wrote ``item``'s output at its place (:meth:`RemoteModelJob.open`): count it written."""
        entry = item.entry
        shape = entry.shape if item.rows is None else (item.rows[1] - item.rows[0], *entry.shape[1:])
        self.shards.written(item.name, shape, entry.out_dtype, row_start=item.row_start)


def items_digest(items: Sequence[WorkItem]) -> str:
    """A fingerprint of a job's work items (names, rows, actions, methods, parameters, shapes, dtypes) that a
    worker compares with its own: both sides must mean the same item by the same index."""
    text = repr([(i.name, i.rows, i.entry.action, i.entry.method, i.entry.params, i.entry.shape, i.entry.out_dtype)
                 for i in items])  # fmt: skip
    return hashlib.sha256(text.encode()).hexdigest()


def _worker_options(options: ComputeOptions) -> ComputeOptions:
    """The driver's compute options as a worker uses them: a CUDA device is the GPU the worker was given."""
    if options.device.type == "cuda":
        return dataclasses.replace(options, device=torch.device("cuda"))
    return options


def _check_items(job: ModelJob | AdapterJob, digest: str) -> None:
    if items_digest(job.items) != digest:
        raise SpecmergeError(
            "a worker planned different tensors than the driver: the inputs changed while merging, or the worker "
            "reads other files at these paths; give every worker the same inputs (shared storage) and run again"
        )


@dataclass(frozen=True)
class RemoteModelJob:
    """A model merge as another process runs it (picklable): it opens the recipe's inputs by path and writes each
    output at its placement in the shards the driver created; only each item's report travels back."""

    key: str  # one per run: a worker keeps the job it opened for the next items of the same run
    recipe: Recipe
    options: ComputeOptions
    digest: str
    block_bytes: int | None
    placements: Mapping[str, Placement]

    def open(self, stack: ExitStack) -> ModelJob:
        prepared = prepare_merge(stack, self.recipe, None)  # the same plan, by path

        def write(name: str, tensor: torch.Tensor, *, row_start: int | None = None) -> None:
            write_at(self.placements[name], name, tensor, row_start=row_start)

        job = ModelJob(
            prepared.plan, prepared.base, prepared.experts, write, _worker_options(self.options),
            block_bytes=self.block_bytes, fsync=False,
        )  # fmt: skip
        _check_items(job, self.digest)
        return job


@dataclass(frozen=True)
class RemoteAdapterJob:
    """A merged LoRA adapter as another process runs it (picklable): it opens the experts by path and sends each
    tensor's factors back (they are small)."""

    key: str
    recipe: Recipe
    options: ComputeOptions
    digest: str
    max_rank: int | None
    out_dtype: torch.dtype | None

    def open(self, stack: ExitStack) -> AdapterJob:
        prepared = prepare_merge(stack, self.recipe, None)  # the same plan, by path
        job = AdapterJob(
            prepared.plan, prepared.experts, _worker_options(self.options), max_rank=self.max_rank,
            out_dtype=self.out_dtype, ship=True,
        )  # fmt: skip
        _check_items(job, self.digest)
        return job


class AdapterJob:
    """A merged LoRA adapter: every tensor that some adapter changes and the plan merges or averages, merged
    into LoRA factors (:func:`~specmerge.pipeline.run.compute.merge_adapter_tensor`); the base is not read. Every
    other tensor of the merged model is the base's. :meth:`factors` gives the result, in plan order. With
    ``recipe``, other processes can run its items (:meth:`remote`); with ``ship`` (a worker's job) ``deliver``
    returns each item's factors, to be sent back, instead of keeping them."""

    def __init__(
        self,
        plan: Sequence[TensorPlan],
        experts: Sequence[Expert],
        options: ComputeOptions,
        *,
        max_rank: int | None = None,
        out_dtype: torch.dtype | None = None,
        recipe: Recipe | None = None,
        ship: bool = False,
    ) -> None:
        self.experts, self.options, self.max_rank, self.out_dtype = list(experts), options, max_rank, out_dtype
        self.recipe, self.ship = recipe, ship
        changed = [e for e in plan if e.action != "keep_base" and any(x.changes(e.name) for x in self.experts)]
        self.items = [WorkItem(entry) for entry in changed]
        self._factors: dict[str, AdapterFactors] = {}

    def costs(self, *, probe: bool = True) -> list[ItemCost]:
        """The cost model's estimate of every item (the base is not read; the factors are written at the end)."""
        o = self.options
        return estimate_items(
            self.items, None, self.experts, device=o.device, compute_dtype=o.compute_dtype,
            expert_keys=o.expert_keys, write_output=False, probe=probe,
        )[0]  # fmt: skip

    @functools.cached_property
    def progress(self) -> Progress:
        """Each item weighted by its estimated seconds."""
        return Progress(tuple(cost.seconds for cost in self.costs()), desc="merging adapters")

    def read(self, item: WorkItem) -> Inputs:
        return read_inputs(item, None, self.experts)

    def compute(self, item: WorkItem, inputs: Inputs) -> Outcome:
        o = self.options
        try:
            factors, diagnostics = merge_adapter_tensor(
                item.entry,
                inputs.values,
                device=o.device,
                compute_dtype=o.compute_dtype,
                max_rank=self.max_rank,
                out_dtype=self.out_dtype,
                expert_keys=o.expert_keys,
                weights=item.entry.weights,
            )
        except NonFiniteInput as err:
            raise locate_nonfinite(item.entry, None, self.experts, err) from None
        return Outcome(factors, diagnostics)

    def deliver(self, item: WorkItem, output: AdapterFactors | None) -> AdapterFactors | None:
        if self.ship:
            return output
        if output is not None:  # a zero delta writes no module
            self._factors[item.name] = output
        return None

    def remote(self) -> RemoteAdapterJob:
        """What a worker process needs to run this job's items."""
        if self.recipe is None:
            raise ValueError("this AdapterJob runs in this process only: it was made without recipe=")
        return RemoteAdapterJob(
            uuid.uuid4().hex, self.recipe, self.options, items_digest(self.items), self.max_rank, self.out_dtype
        )

    def delivered(self, item: WorkItem, returned: AdapterFactors | None) -> None:
        """A worker computed ``item``: keep the factors it sent back."""
        self.deliver(item, returned)

    def factors(self) -> dict[str, AdapterFactors]:
        """The merged factors by base weight name, in plan order (whatever order the items ran in)."""
        return {item.name: self._factors[item.name] for item in self.items if item.name in self._factors}
