"""A merge's device plan, made from its job and applied to it (issue 50, item 3).

:func:`job_shapes` groups a model job's spectral layers by batch key (one method, parameters and shape:
:meth:`~specmerge.pipeline.run.jobs.ModelJob.batch_key`) into :class:`~specmerge.pipeline.plan.device.LayerShape`\\ s,
as the method sees them (a Conv1D weight transposed); :func:`plan_for` plans them for the recipe's device within the
budget (``gpu_memory``, or the device's free memory less a margin) with the device's rates; :func:`apply` gives the
streaming executor each key's batch size and sends the layers that do not fit to the CPU, one console line each.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

import torch

from specmerge.errors import RecipeError
from specmerge.io.output.folder import OUTPUT_LOG
from specmerge.pipeline.plan.device import DevicePlan, LayerShape, default_budget, known_device, plan_device
from specmerge.pipeline.recipe.model import Recipe
from specmerge.pipeline.recipe.values import parse_size
from specmerge.pipeline.run.devices import DevicesExecutor
from specmerge.pipeline.run.executor import StreamingExecutor
from specmerge.pipeline.run.jobs import ModelJob


def job_shapes(job: ModelJob) -> dict[Hashable, LayerShape]:
    """The job's batchable layers by batch key, each group with its layers' names in plan order."""
    groups: dict[Hashable, list[str]] = {}
    shapes: dict[Hashable, tuple[int, int]] = {}
    for item in job.items:
        key = job.batch_key(item)
        if key is None:
            continue
        entry = item.entry
        groups.setdefault(key, []).append(item.name)
        shapes[key] = tuple(entry.shape[::-1]) if entry.transposed else tuple(entry.shape)
    n = len(job.experts)
    return {key: LayerShape(n, *shapes[key], len(names), tuple(names)) for key, names in groups.items()}


def budget_for(recipe: Recipe, device: torch.device | None) -> tuple[int, str]:
    """The device memory the plan may use, and where the figure comes from: ``gpu_memory``, else the device's free
    memory less a margin (:func:`~specmerge.pipeline.plan.device.default_budget`). Without a device (a dry run for a
    GPU that is not here) the budget must be given."""
    if recipe.gpu_memory is not None:
        return parse_size(recipe.gpu_memory, "gpu_memory"), f"gpu_memory {recipe.gpu_memory}"
    if device is None or device.type != "cuda":
        raise RecipeError(
            "no GPU here to read free memory from: give the budget to plan for, e.g. --gpu-memory 80GiB",
            ("gpu_memory",),
        )
    free, _ = torch.cuda.mem_get_info(device)
    return default_budget(free), f"free memory of {torch.cuda.get_device_name(device)} less a margin"


def plan_for(job: ModelJob, recipe: Recipe, device: torch.device | None) -> tuple[DevicePlan, dict[Hashable, int]]:
    """The device plan of ``job`` and each batch key's batch size (0: computed on the CPU)."""
    budget, source = budget_for(recipe, device)
    name = torch.cuda.get_device_name(device) if device is not None and device.type == "cuda" else "H200"
    rates = known_device(name)
    shapes = job_shapes(job)
    itemsize = job.options.compute_dtype.itemsize
    out = {p.entry.out_dtype.itemsize for p in job.items if p.entry.action == "merge"}
    plan = plan_device(
        list(shapes.values()), budget, rates, itemsize=itemsize, out_itemsize=max(out, default=2),
        device=str(device) if device is not None else "cuda (not here)", budget_from=source,
    )  # fmt: skip
    sizes = {key: group.batch for key, group in zip(shapes, plan.groups, strict=True)}
    return plan, sizes


def plan_and_apply(job: ModelJob, executor: Any, recipe: Recipe) -> DevicePlan:
    """The device plan of ``job`` on its (CUDA) device (:func:`plan_for`), applied (:func:`apply`)."""
    plan, sizes = plan_for(job, recipe, job.options.device)
    apply(job, executor, plan, sizes)
    return plan


def apply(job: ModelJob, executor: Any, plan: DevicePlan, sizes: dict[Hashable, int]) -> None:
    """Batch sizes for the streaming executor and the CPU for the layers that do not fit, each said on the console."""
    if not plan.groups:  # no spectral layer: nothing to batch or to send to the CPU
        return
    job.on_cpu = frozenset(name for name, _ in plan.cpu_layers())
    log = logging.getLogger(OUTPUT_LOG)
    batches = ", ".join(f"{g.shape.d_out}x{g.shape.d_in} by {g.batch}" for g in plan.groups if g.batch)
    log.info(
        f"device plan on {plan.device}: budget {plan.budget / 2**30:.1f} GiB ({plan.budget_from}), spectral layers "
        f"batched {batches or 'none'}, peak {plan.peak / 2**30:.1f} GiB"
    )
    say_cpu_layers(plan)
    if isinstance(executor, StreamingExecutor | DevicesExecutor) and executor.batch == 1:
        executor.batch = lambda key: max(1, sizes.get(key, 1))


def say_cpu_layers(plan: DevicePlan) -> None:
    """One console line for each layer the plan computes on the CPU."""
    log = logging.getLogger(OUTPUT_LOG)
    for name, group in plan.cpu_layers():
        log.warning(
            f"{name}: needs {group.peak / 2**30:.1f} GiB of device memory, over the budget of "
            f"{plan.budget / 2**30:.1f} GiB ({plan.budget_from}): computed on the CPU (raise --gpu-memory to keep "
            "it on the device)"
        )
