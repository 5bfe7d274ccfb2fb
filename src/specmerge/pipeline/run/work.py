"""The executor interface: a merge as work items, each read, computed and delivered, and the report they add up to.

A merge (a :class:`Job`) is a list of :class:`WorkItem`\\ s, one per planned tensor or per block of its rows.
Each item goes through three steps, which any :class:`Executor` may schedule as it likes (in order, reversed,
in parallel, on other machines) as long as each item's steps run in this order:

1. ``job.read(item)`` -> :class:`Inputs`: the base's tensor (or rows) and every expert's task-vector value
   (:mod:`specmerge.io.views.task_vectors`), read from disk;
2. ``job.compute(item, inputs)`` -> :class:`Outcome`: the item's output (a merged tensor, LoRA factors, ...)
   and its diagnostics; a pure function of the inputs (:mod:`specmerge.pipeline.run.compute`), the same bits
   whatever the schedule;
3. ``job.deliver(item, outcome.output)``: hands the output to the job's sink (a shard writer that writes any
   tensor or block at its place, a dict of adapter factors). Safe to call from any one thread at a time.

The executor adds each item's compute time and diagnostics to a :class:`ReportAccumulator`, which gives one
:class:`TensorReport` per tensor in plan order, the row blocks combined in row order (so the report does not
depend on the schedule either). :class:`specmerge.pipeline.run.executor.StreamingExecutor` is the in-process
implementation: reads one item ahead, writes one behind, a progress bar.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specmerge.io.formats.protocol import Rows, TensorSource, row_ranges
from specmerge.io.views.experts import Expert
from specmerge.io.views.task_vectors import Dense, TaskVector
from specmerge.methods import get_method
from specmerge.pipeline.plan.rules import TensorPlan

BLOCK_BYTES = 16 * 2**20  # small enough for reads, compute and writes to overlap well (BENCHMARKS.md, issue 6)


@dataclass(frozen=True)
class WorkItem:
    """One unit of work: a plan entry, whole (``rows`` None) or a block of its rows ``start:stop`` (dim 0)."""

    entry: TensorPlan
    rows: Rows = None

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def row_start(self) -> int | None:
        """The first row of the block, None for a whole tensor (what a shard writer takes as ``row_start``)."""
        return None if self.rows is None else self.rows[0]

    @property
    def completes(self) -> bool:
        """Whether this item holds the tensor's last rows (in plan order, it finishes the tensor)."""
        return self.rows is None or self.rows[1] == self.entry.shape[0]


def row_blocks(entry: TensorPlan, itemsize: int, block_bytes: int | None = None) -> list[Rows]:
    """Row ranges to process ``entry`` in (``[None]``: the whole tensor at once); default BLOCK_BYTES per block.

    Only work that is the same function of every row is split: keeping the base, averaging, and merges whose
    method declares itself linear in the task vectors (:attr:`specmerge.methods.registry.Method.linear`).
    """
    rowwise = entry.action in ("keep_base", "average") or (entry.action == "merge" and get_method(entry.method).linear)
    if not rowwise:
        return [None]
    return row_ranges(entry.shape, itemsize, BLOCK_BYTES if block_bytes is None else block_bytes)


def work_items(plan: Sequence[TensorPlan], itemsize: int, block_bytes: int | None = None) -> list[WorkItem]:
    """Every plan entry as work items, in plan order, row-blocked where :func:`row_blocks` says."""
    return [WorkItem(entry, rows) for entry in plan for rows in row_blocks(entry, itemsize, block_bytes)]


@dataclass
class Inputs:
    """What one work item reads: the base's tensor (None when the job does not read the base) and, unless the
    entry keeps the base, each expert's value, in expert order. ``ready``: staged on a device by another stream
    (:func:`stage_inputs`), the event the compute stream waits for before using them (None: usable as they are)."""

    base: torch.Tensor | None
    values: list[TaskVector]
    ready: Any = None

    def wait(self) -> None:
        """Make the current (compute) stream wait until the staging copies are done."""
        if self.ready is not None:
            torch.cuda.current_stream(self.ready.device).wait_event(self.ready)


def stage_inputs(inputs: Inputs, device: torch.device, stream: Any) -> Inputs:
    """The inputs copied to ``device`` on ``stream`` (a CUDA side stream) through pinned host memory, so that the
    copies of the next item overlap the compute of this one; the event recorded after them (``Inputs.ready``).
    Only the base's tensor and full checkpoints' weights move (LoRA factors are small and go with their compute); on
    the CPU, or with no stream, the inputs are returned as they are (the stages then run in sequence)."""
    if device.type != "cuda" or stream is None:
        return inputs
    with torch.cuda.stream(stream):

        def move(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.pin_memory().to(device, non_blocking=True)

        base = None if inputs.base is None else move(inputs.base)
        values = [Dense(move(v.weight)) if isinstance(v, Dense) else v for v in inputs.values]
        ready = torch.cuda.Event()
        ready.record(stream)
    return Inputs(base, values, ready)


def read_inputs(item: WorkItem, base: TensorSource | None, experts: Sequence[Expert]) -> Inputs:
    """Read one work item's inputs: the base's tensor or rows (unless ``base`` is None) and the experts' values."""
    base_tensor = None if base is None else base.load(item.name, item.rows)
    if item.entry.action == "keep_base":
        return Inputs(base_tensor, [])
    return Inputs(base_tensor, [expert.read(item.name, item.rows) for expert in experts])


@dataclass
class Outcome:
    """What computing one work item gives: its output for the sink, and diagnostics."""

    output: Any
    diagnostics: dict[str, Any]


@dataclass(frozen=True)
class Progress:
    """How a job's progress is shown, whatever the executor: finishing ``job.items[k]`` advances the bar by
    ``weights[k]``, out of their sum. A merge's weights are its items' estimated seconds
    (:mod:`specmerge.pipeline.estimate.cost`), so a spectral layer moves the bar by its share of the time and the time
    left stays steady; the bar also counts the tensors finished."""

    weights: tuple[float, ...]
    desc: str = "merging"

    @property
    def total(self) -> float:
        return sum(self.weights)


class Job(Protocol):
    """A merge as work items (see the module docstring): what to read, compute and deliver for each, and how its
    progress is shown (an executor asks for ``progress`` only when it shows a bar: it may cost a calibration)."""

    items: Sequence[WorkItem]
    progress: Progress

    def read(self, item: WorkItem) -> Inputs: ...

    def compute(self, item: WorkItem, inputs: Inputs) -> Outcome: ...

    def deliver(self, item: WorkItem, output: Any) -> None: ...


class WorkerSpec(Protocol):
    """A job as another process runs it (picklable): ``open`` opens the inputs by path there and returns the job
    whose ``deliver`` puts each output in place (a shard at its offset) and returns what goes back to the driver
    (None, or small outputs such as LoRA factors); ``key`` is one per run."""

    key: str

    def open(self, stack: ExitStack) -> Job: ...


class RemoteJob(Job, Protocol):
    """A job whose items other processes may run (:class:`specmerge.pipeline.run.ray_executor.RayExecutor`):
    ``remote()`` gives the :class:`WorkerSpec`, and the driver calls ``delivered(item, returned)`` for every item
    a worker finished, with what that worker's ``deliver`` returned; ``costs(probe=False)`` estimates each item
    (:mod:`specmerge.pipeline.estimate.cost`), to group them into tasks."""

    def remote(self) -> WorkerSpec: ...

    def costs(self, *, probe: bool = True) -> list[Any]: ...

    def delivered(self, item: WorkItem, returned: Any) -> None: ...


class Executor(Protocol):
    """Runs every work item of a job (read, compute, deliver) and returns the per-tensor report. An executor may
    also have ``describe() -> dict``: how it ran, recorded as the report's ``executor``."""

    def run(self, job: Job, *, progress: bool = True) -> list[TensorReport]: ...


@dataclass
class TensorReport:
    """What happened to one tensor: action, method, seconds spent computing, and the method's diagnostics."""

    name: str
    shape: tuple[int, ...]
    action: str
    method: str | None
    reason: str
    seconds: float
    diagnostics: dict[str, Any] = field(default_factory=dict)


class ReportAccumulator:
    """Collects each work item's compute time and diagnostics, in any order; :meth:`reports` gives one
    :class:`TensorReport` per tensor of ``items``, in their order: the seconds of its row blocks added up and
    the norms of their deltas combined (``delta_norm``), in row order; other diagnostics are the first block's."""

    def __init__(self, items: Sequence[WorkItem]) -> None:
        self._entries = {item.name: item.entry for item in items}
        self._blocks: dict[str, list[tuple[int, float, dict[str, Any]]]] = {}

    def add(self, item: WorkItem, seconds: float, diagnostics: dict[str, Any]) -> None:
        self._blocks.setdefault(item.name, []).append((item.row_start or 0, seconds, diagnostics))

    def reports(self) -> list[TensorReport]:
        reports = []
        for name, entry in self._entries.items():
            blocks = sorted(self._blocks.get(name, ()), key=lambda block: block[0])
            if not blocks:
                continue
            _, seconds, diagnostics = blocks[0]
            for _, more_seconds, more in blocks[1:]:
                seconds += more_seconds
                if "delta_norm" in more:
                    diagnostics["delta_norm"] = math.hypot(diagnostics["delta_norm"], more["delta_norm"])
            reports.append(
                TensorReport(name, entry.shape, entry.action, entry.method, entry.reason, seconds, diagnostics)
            )
        return reports
