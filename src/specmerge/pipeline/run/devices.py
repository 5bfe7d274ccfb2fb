"""Several devices in one process: a merge's work spread over the GPUs of one machine (issue 50, item 4).

:class:`DevicesExecutor` runs a job's units (items, or batches of same-shape spectral layers: :func:`~specmerge.
pipeline.run.executor.units`) on one thread per device, each unit computed where it was assigned: the units are
given out longest first to the device with the least estimated work so far (:func:`balance`, by the cost model's
seconds, :meth:`~specmerge.pipeline.run.jobs.ModelJob.costs`), so the devices finish together. Each thread reads,
stages and computes its units with its own view of the job (:meth:`~specmerge.pipeline.run.jobs.ModelJob.on_device`);
outputs are delivered one at a time under a lock (the shard writer takes any order). The files are the same bits as
the streaming executor's at equal thread counts: every item is the same pure function of its inputs.

``specmerge merge --device cuda`` uses it when torch sees more than one GPU and the executor is the local one
(:func:`~specmerge.pipeline.run.api.executor_for`); with Ray installed, ``--executor ray`` gives each spectral task
a GPU of its own instead. On the CPU (the tests) it runs the same code with every thread on the CPU.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from tqdm.auto import tqdm

from specmerge.pipeline.run.executor import BAR_FORMAT, BatchSize, compute_unit, job_units, read_unit
from specmerge.pipeline.run.threads import io_thread_setup
from specmerge.pipeline.run.work import Job, ReportAccumulator, TensorReport


def balance(costs: Sequence[float], workers: int) -> list[list[int]]:
    """Indices of ``costs`` for each of ``workers``: longest first, each to the worker with the least so far (ties
    to the lower worker), each worker's list in the original order. Within 4/3 of the best split (Graham)."""
    if workers < 1:
        raise ValueError(f"need at least one worker, got {workers}")
    loads = [(0.0, w) for w in range(workers)]
    assigned: list[list[int]] = [[] for _ in range(workers)]
    for k in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        load, w = heapq.heappop(loads)
        assigned[w].append(k)
        heapq.heappush(loads, (load + costs[k], w))
    return [sorted(indices) for indices in assigned]


class DevicesExecutor:
    """Runs a job's units on several devices at once, one thread each, balanced by estimated time (see the module
    docstring). ``batch``: as :class:`~specmerge.pipeline.run.executor.StreamingExecutor`'s (a device plan sets it)."""

    def __init__(self, devices: Sequence[torch.device | str], batch: BatchSize = 1) -> None:
        self.devices = [torch.device(d) for d in devices]
        if not self.devices:
            raise ValueError("DevicesExecutor needs at least one device")
        self.batch = batch
        self.assigned: list[list[str]] = []  # the tensors each device computed (in its order), after a run

    def describe(self) -> dict[str, Any]:
        return {"name": "devices", "devices": [str(d) for d in self.devices]}

    def run(self, job: Job, *, progress: bool = True) -> list[TensorReport]:
        if not hasattr(job, "on_device"):
            raise TypeError(f"{type(job).__name__} cannot run on several devices (it has no on_device)")
        plan = job_units(job, self.batch)
        estimates = [cost.seconds for cost in job.costs(probe=False)]
        shares = balance([sum(estimates[k] for k in unit) for unit in plan], len(self.devices))
        self.assigned = [[job.items[k].name for u in share for k in plan[u]] for share in shares]
        views = [job.on_device(device) for device in self.devices]
        reports = ReportAccumulator(job.items)
        lock, failed = threading.Lock(), threading.Event()
        tensors = len({item.name for item in job.items})
        done = [0]
        spec = job.progress if progress else None
        weights = spec.weights if spec is not None else (0.0,) * len(job.items)
        bar = tqdm(
            total=spec.total if spec is not None else 0, desc=spec.desc if spec is not None else "", smoothing=0,
            bar_format=BAR_FORMAT, disable=not progress,
        )  # fmt: skip

        def work(view: Any, share: list[int]) -> None:
            for u in share:
                if failed.is_set():
                    return
                unit = plan[u]
                items = [job.items[k] for k in unit]
                outcomes, seconds = compute_unit(view, items, read_unit(view, unit))
                with lock:
                    for k, item, outcome in zip(unit, items, outcomes, strict=True):
                        job.deliver(item, outcome.output)
                        reports.add(item, seconds, outcome.diagnostics)
                        done[0] += item.completes
                        bar.set_postfix_str(f"{done[0]}/{tensors} tensors", refresh=False)
                        bar.update(weights[k])

        def guarded(view: Any, share: list[int]) -> None:
            try:
                work(view, share)
            except BaseException:
                failed.set()  # the other devices stop after their current unit
                raise

        with bar, ThreadPoolExecutor(len(self.devices), "specmerge-device", initializer=io_thread_setup) as pool:
            futures = [pool.submit(guarded, view, share) for view, share in zip(views, shares, strict=True)]
            errors = []
            for future in futures:
                try:
                    future.result()
                except BaseException as err:  # the first device's error in device order, after all stopped
                    errors.append(err)
            if errors:
                raise errors[0]
        return reports.reports()
