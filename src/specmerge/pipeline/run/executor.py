"""The in-process streaming executor: one work item at a time, reading the next while computing, writing behind.

For every work item of a job (:mod:`specmerge.pipeline.run.work`) in plan order: its inputs are read on a reader
thread one item ahead, it is computed on the calling thread (torch's compute threads), and its output is
delivered on a writer thread one item behind, so disk and compute overlap and at most one result waits to be
written. Peak memory is about two sets of inputs of the largest item plus its compute's workspace, never a
model. A progress bar shows the job's progress (:class:`~specmerge.pipeline.run.work.Progress`: each item advances it by
its estimated seconds), the time elapsed and left, and the tensors finished.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from tqdm.auto import tqdm

from specmerge.pipeline.run.threads import io_thread_setup
from specmerge.pipeline.run.work import Job, ReportAccumulator, TensorReport

T = TypeVar("T")
R = TypeVar("R")

BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]"  # no units: weights are estimates


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
    """Runs a job's work items in plan order: reads one ahead, computes here, delivers one behind."""

    def describe(self) -> dict[str, Any]:
        return {"name": "local"}

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
            for k, (item, inputs) in enumerate(prefetched(job.items, job.read)):
                start = time.perf_counter()
                outcome = job.compute(item, inputs)
                seconds = time.perf_counter() - start
                if writing is not None:
                    writing.result()  # the previous item is delivered (or its error is raised here)
                writing = writer.submit(job.deliver, item, outcome.output)
                del inputs
                reports.add(item, seconds, outcome.diagnostics)
                done += item.completes
                bar.set_postfix_str(f"{done}/{tensors} tensors", refresh=False)
                bar.update(weights[k])
                del outcome
            if writing is not None:
                writing.result()
        return reports.reports()
