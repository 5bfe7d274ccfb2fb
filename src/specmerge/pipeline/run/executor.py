"""The in-process streaming executor: one work item at a time, reading the next while computing, writing behind.

For every work item of a job (:mod:`specmerge.pipeline.run.work`) in plan order: its inputs are read on a reader
thread one item ahead, it is computed on the calling thread (torch's compute threads), and its output is
delivered on a writer thread one item behind, so disk and compute overlap and at most one result waits to be
written. Peak memory is about two sets of inputs of the largest item plus its compute's workspace, never a
model. A progress bar shows the job's progress (:class:`~specmerge.pipeline.run.work.Progress`: each item advances it by
its estimated seconds), the time elapsed and left, and the tensors finished.

With ``batch`` > 1 (a job that can batch: :meth:`~specmerge.pipeline.run.jobs.ModelJob.batch_key`), items of the same
key (one spectral method, parameters and shape) are read and computed together, up to ``batch`` at a time, their
decompositions in one batched eigh (:func:`~specmerge.pipeline.run.batched.merge_spectral_batch`): a unit is placed
at its first item's position, and the items it takes from later in the plan leave theirs. The output is the same
bits; memory holds two units' inputs and one unit's compute.

On a CUDA device the reader thread also stages each item's inputs (``job.stage``: through pinned host memory, copied
on a side stream, :func:`~specmerge.pipeline.run.work.stage_inputs`), and the compute stream waits for them: the
copies of the next unit overlap the compute of this one. On the CPU staging does nothing: the same code, with the
stages in sequence.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from tqdm.auto import tqdm

from specmerge.pipeline.run.threads import io_thread_setup
from specmerge.pipeline.run.work import Inputs, Job, ReportAccumulator, TensorReport, WorkItem

T = TypeVar("T")
R = TypeVar("R")

BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]"  # no units: weights are estimates


BatchSize = int | Callable[[Hashable], int]  # one size for every key, or a size per key (a device plan's)


def units(items: Sequence[WorkItem], key: Callable[[WorkItem], Hashable | None], size: BatchSize) -> list[list[int]]:
    """The indices of ``items`` in the units an executor computes together: items of the same non-None ``key``, in
    plan order, up to ``size`` per unit (or ``size(key)``), each unit at the position of its first item; every other
    item alone."""
    out: list[list[int]] = []
    filling: dict[Hashable, list[int]] = {}
    for k, item in enumerate(items):
        group = key(item) if callable(size) or size > 1 else None
        limit = (size(group) if callable(size) else size) if group is not None else 1
        if group is None or limit <= 1:
            out.append([k])
            continue
        unit = filling.get(group)
        if unit is None or len(unit) >= limit:
            unit = filling[group] = []
            out.append(unit)
        unit.append(k)
    return out


def job_units(job: Job, batch: BatchSize) -> list[list[int]]:
    """The units a job's items are computed in (:func:`units` by its ``batch_key``; one item each for a job that
    cannot batch)."""
    key = getattr(job, "batch_key", None)
    return units(job.items, key, batch) if key is not None else [[k] for k in range(len(job.items))]


def read_unit(job: Job, unit: Sequence[int]) -> list[Inputs]:
    """The inputs of a unit's items, staged on the job's device where it stages them (``job.stage``)."""
    inputs = [job.read(job.items[k]) for k in unit]
    stage = getattr(job, "stage", None)
    return inputs if stage is None else [stage(job.items[k], x) for k, x in zip(unit, inputs, strict=True)]


def compute_unit(job: Job, items: Sequence[WorkItem], inputs: Sequence[Inputs]) -> tuple[list[Any], float]:
    """A unit's outcomes (``job.compute_batch`` for several items) and the compute seconds each item is counted, the
    unit's time shared by its items; the compute stream first waits for the unit's staged copies (none on the CPU)."""
    for staged in inputs:
        getattr(staged, "wait", lambda: None)()
    start = time.perf_counter()
    outcomes = job.compute_batch(items, inputs) if len(items) > 1 else [job.compute(items[0], inputs[0])]
    return outcomes, (time.perf_counter() - start) / len(items)


def prefetched(items: Sequence[T], read: Callable[[T], R]) -> Iterator[tuple[T, R]]:
    """Yield ``(item, read(item))`` in order, reading item k + 1 on a reader thread while the caller works on k."""
    if not items:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="specmerge-read", initializer=io_thread_setup) as pool:
        pending = pool.submit(read, items[0])
        for k, item in enumerate(items):
            inputs = pending.result()
            if k + 1 < len(items):
                pending = pool.submit(read, items[k + 1])
            yield item, inputs


class StreamingExecutor:
    """Runs a job's work items in plan order: reads one ahead, computes here, delivers one behind; ``batch``: up to
    that many same-shape spectral layers computed together (see the module docstring)."""

    def __init__(self, batch: BatchSize = 1) -> None:
        if not callable(batch) and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
            raise ValueError(f"batch must be a whole number of at least 1, got {batch!r}")
        self.batch = batch

    def describe(self) -> dict[str, Any]:
        if callable(self.batch):
            return {"name": "local", "batch": "by the device plan"}
        return {"name": "local", **({"batch": self.batch} if self.batch > 1 else {})}

    def run(self, job: Job, *, progress: bool = True) -> list[TensorReport]:
        """Read, compute and deliver every item of ``job``; the per-tensor report, in plan order.

        ``job.deliver`` is called for one item at a time, in plan order, on a writer thread; an error in it is
        raised here, at the latest when the next item is delivered.
        """
        reports = ReportAccumulator(job.items)
        tensors = len({item.name for item in job.items})
        done = 0
        writing: Future | None = None
        spec = job.progress if progress else None  # estimating may probe the machine: only for a bar
        weights = spec.weights if spec is not None else (0.0,) * len(job.items)
        with (
            tqdm(
                total=spec.total if spec is not None else 0,
                desc=spec.desc if spec is not None else "",
                bar_format=BAR_FORMAT,
                smoothing=0,  # the rate over the whole run: with estimated weights it is steady
                disable=not progress,
            ) as bar,
            ThreadPoolExecutor(1, thread_name_prefix="specmerge-write", initializer=io_thread_setup) as writer,
        ):
            # a unit's inputs are read, and staged on the device, on the reader thread
            for unit, inputs in prefetched(job_units(job, self.batch), lambda unit: read_unit(job, unit)):
                items = [job.items[k] for k in unit]
                outcomes, seconds = compute_unit(job, items, inputs)
                del inputs
                for k, item, outcome in zip(unit, items, outcomes, strict=True):
                    if writing is not None:
                        writing.result()  # the previous item is delivered (or its error is raised here)
                    writing = writer.submit(job.deliver, item, outcome.output)
                    reports.add(item, seconds, outcome.diagnostics)
                    done += item.completes
                    bar.set_postfix_str(f"{done}/{tensors} tensors", refresh=False)
                    bar.update(weights[k])
                del outcomes, outcome
            if writing is not None:
                writing.result()
        return reports.reports()
