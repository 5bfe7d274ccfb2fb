"""A Ray executor: a merge's work items as Ray tasks, across the CPUs and GPUs of one machine or a cluster.

Every tensor is an independent job (:mod:`specmerge.pipeline.run.work`), so a merge spreads over workers as it is. The
driver (the process that called :func:`~specmerge.pipeline.run.api.run_recipe`) plans the merge, creates the output's
shard files with every tensor's place fixed (:meth:`~specmerge.io.output.writer.ShardWriter.placements`), groups the
work items (:func:`task_groups`: a spectral tensor alone, small items together up to :data:`GROUP_SECONDS` of work as
the cost model estimates it from their bytes and FLOPs) and submits one Ray task per group. A worker opens the inputs
itself, by path (on a cluster: shared storage at the same paths), prepares the same plan (checked against the
driver's), computes its items and writes each output at its place in the shards; only each item's report (and, for a
LoRA adapter, its small factors) travels back. The driver counts the items in, shows the progress bar, and then
writes the shards' headers, the index, the report and the card, and renames the folder into place, as the in-process
executor's merge does. The files are the same bits (tested for every method).

Failures: a worker that dies or is lost (killed, out of memory, a node gone) has its task run again by Ray
(``max_retries``); writing an item twice writes the same bytes at the same place. An error in the data (a NaN,
a shape that does not fit) is not retried: the driver cancels every other task, waits for them, and raises the
worker's own error, the same one-line message as in-process; the output folder is then removed as for any
failed merge (:func:`~specmerge.io.output.folder.atomic_directory`).

Ray is an optional extra: ``pip install 'specmerge[ray]'``. :class:`RayExecutor` connects to the cluster at
``address`` (``auto``: the one ``ray start`` runs on this machine), or uses the Ray already initialised in this
process, or starts a local one for the merge and stops it after.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import resource
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

from tqdm.auto import tqdm

from specmerge.errors import SpecmergeError
from specmerge.io.hub.ids import console_quiet
from specmerge.methods import get_method
from specmerge.pipeline.run.executor import BAR_FORMAT
from specmerge.pipeline.run.threads import merge_threads
from specmerge.pipeline.run.work import Job, RemoteJob, ReportAccumulator, TensorReport, WorkerSpec, WorkItem

GROUP_SECONDS = 0.5  # small items go together up to this much estimated work (Ray: ~5 ms a task, BENCHMARKS.md)
MAX_RETRIES = 3  # runs of a task whose worker died, after the first (Ray's own retry)
GPU_SHARE = 0.25  # of a GPU, for a task without a spectral tensor when the merge computes on CUDA


CONNECT_TIMEOUT = 10.0  # seconds to reach a cluster's address before giving up


class RayUnavailable(SpecmergeError):
    """Ray is not installed, or the cluster cannot be reached."""


class WorkerLost(SpecmergeError):
    """A task's worker died (or its node was lost) at every try."""


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else "no message"


def check_ray() -> None:
    """Raise the one-line :class:`RayUnavailable` when Ray is not installed."""
    if importlib.util.find_spec("ray") is None:
        raise RayUnavailable("executor 'ray' needs Ray, an optional extra: pip install 'specmerge[ray]'")


def task_groups(items: Sequence[WorkItem], weights: Sequence[float], target: float = GROUP_SECONDS) -> list[list[int]]:
    """The work items (by index) grouped into tasks, in order: a spectral method's tensor alone (it is the heavy
    work, and asks for a GPU where there is one); runs of other items together until their estimated seconds
    reach ``target``."""
    groups: list[list[int]] = []
    current: list[int] = []
    spent = 0.0
    for k, item in enumerate(items):
        if _spectral(item):
            groups += [current, [k]] if current else [[k]]
            current, spent = [], 0.0
            continue
        current.append(k)
        spent += weights[k]
        if spent >= target:
            groups.append(current)
            current, spent = [], 0.0
    if current:
        groups.append(current)
    return groups


def _spectral(item: WorkItem) -> bool:
    entry = item.entry
    return entry.action == "merge" and entry.method is not None and get_method(entry.method).spectral


class RayExecutor:
    """Runs a job's work items as Ray tasks (see the module docstring). ``address``: a running cluster (``auto``,
    or ``ray://host:10001`` ...); None: the Ray this process already initialised, else a local one started for the
    merge with ``num_cpus`` CPUs (default: all). ``cpus_per_task``: CPUs (and torch threads) each task asks for;
    ``max_retries``: runs of a task again after its worker died."""

    def __init__(
        self,
        address: str | None = None,
        *,
        num_cpus: int | None = None,
        cpus_per_task: int = 1,
        max_retries: int = MAX_RETRIES,
        threads: int | None = None,
    ) -> None:
        check_ray()
        self.address, self.num_cpus, self.cpus_per_task = address, num_cpus, cpus_per_task
        self._session: str | None = None  # the session folder of a Ray started here
        self.max_retries, self.threads = max_retries, threads
        self.stats: dict[str, Any] = {}

    def describe(self) -> dict[str, Any]:
        # no address nor host names: report.json is published with the model (the work folder's marker has the host)
        return {"name": "ray", "cluster": self.address is not None, "cpus_per_task": self.cpus_per_task, **self.stats}

    def run(self, job: Job, *, progress: bool = True) -> list[TensorReport]:
        import ray

        remote_job: RemoteJob = job  # type: ignore[assignment]
        if not hasattr(job, "remote"):
            raise SpecmergeError(f"executor 'ray' cannot run a {type(job).__name__}: it has no remote form")
        started_here = not ray.is_initialized()
        if started_here:
            self._connect(ray)
        try:
            return self._run(ray, remote_job, progress)
        finally:
            if started_here:
                ray.shutdown()
                if self._session is not None:  # its logs and sockets, not left in /tmp
                    shutil.rmtree(self._session, ignore_errors=True)
                    self._session = None

    def check_reachable(self, timeout: float = CONNECT_TIMEOUT) -> None:
        """Refuse, before any work (and before the output's work folder exists), a cluster address nothing answers
        at within ``timeout`` seconds: Ray itself would retry for as long as it is left to."""
        if self.address is None or self.address == "auto":
            return
        host, _, port = self.address.removeprefix("ray://").rpartition(":")
        if not host or not port.isdigit():
            return  # Ray names what is wrong with such an address
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
        except OSError as err:
            raise RayUnavailable(
                f"could not reach the Ray cluster at {self.address} within {timeout:.0f} s ({err}): start it "
                "(ray start --head) or fix --address"
            ) from None

    def _connect(self, ray: Any) -> None:
        try:
            # --quiet: Ray's own warnings (its token-authentication notice) are not printed either
            quiet = {"log_to_driver": False, "logging_level": logging.ERROR if console_quiet() else logging.WARNING}
            if self.address is None:  # a Ray of our own: its session files in a folder removed when it stops
                self._session = tempfile.mkdtemp(prefix="specmerge-ray-")
                ray.init(num_cpus=self.num_cpus, include_dashboard=False, _temp_dir=self._session, **quiet)
            else:
                ray.init(address=self.address, **quiet)
        except (ConnectionError, RuntimeError, ValueError) as err:
            where = "a local Ray instance" if self.address is None else f"the Ray cluster at {self.address}"
            raise RayUnavailable(f"could not start or reach {where}: {_first_line(err)}") from None

    def task_options(self, group: Sequence[WorkItem], gpus: bool) -> dict[str, Any]:
        """The resources one task asks Ray for: its CPUs (torch threads) and, when ``gpus`` (the merge computes on
        CUDA and the cluster has GPUs), a whole GPU for a spectral tensor or :data:`GPU_SHARE` of one otherwise."""
        options: dict[str, Any] = {"num_cpus": self.cpus_per_task, "max_retries": self.max_retries}
        if gpus:
            options["num_gpus"] = 1 if any(_spectral(item) for item in group) else GPU_SHARE
        return options

    def worker_spec(self, job: RemoteJob) -> WorkerSpec:
        """What the workers get (tests wrap it to inject failures)."""
        return job.remote()

    def _run(self, ray: Any, job: RemoteJob, progress: bool) -> list[TensorReport]:
        from ray.exceptions import RayError, RayTaskError

        items = job.items
        spec = job.progress if progress else None  # the bar's weights, else the estimate without probing the disk
        weights = spec.weights if spec is not None else tuple(cost.seconds for cost in job.costs(probe=False))
        groups = task_groups(items, weights)
        gpus = gpus_per_task(ray, job)
        spec_ref = ray.put(self.worker_spec(job))
        task = ray.remote(run_task)
        pending: dict[Any, list[int]] = {}
        try:
            for group in groups:
                options = self.task_options([items[k] for k in group], gpus)
                pending[task.options(**options).remote(spec_ref, group, self.threads)] = group
        except BaseException:
            _cancel(ray, pending)
            raise
        reports = ReportAccumulator(items)
        tensors = len({item.name for item in items})
        done, peaks, nodes, started = 0, {}, {}, time.perf_counter()
        with tqdm(
            total=spec.total if spec is not None else 0,
            desc=spec.desc if spec is not None else "",
            bar_format=BAR_FORMAT,
            smoothing=0,
            disable=not progress,
        ) as bar:
            try:
                while pending:
                    ready, _ = ray.wait(list(pending), num_returns=1)
                    group = pending.pop(ready[0])
                    try:
                        results, (host, pid, peak) = ray.get(ready[0])
                    except RayTaskError as err:  # raised in the worker: the data, the inputs, or a bug
                        cause = getattr(err, "cause", None)
                        if not isinstance(cause, BaseException):
                            raise
                        # the worker's own exception; a bug keeps Ray's error (with the remote traceback) as cause
                        raise cause from (None if isinstance(cause, SpecmergeError) else err)
                    except RayError as err:  # the worker or its node lost at every try
                        names = sorted({items[k].name for k in group})
                        raise WorkerLost(
                            f"Ray lost the worker computing {', '.join(names[:3])}{', ...' if len(names) > 3 else ''} "
                            f"{self.max_retries + 1} times ({type(err).__name__}: {_first_line(err)}); out of memory? "
                            "give each task more (cpus_per_task) or run with fewer workers per node"
                        ) from None
                    for k, seconds, diagnostics, returned in results:
                        item = items[k]
                        job.delivered(item, returned)
                        reports.add(item, seconds, diagnostics)
                        done += item.completes
                        bar.update(weights[k])
                    bar.set_postfix_str(f"{done}/{tensors} tensors", refresh=False)
                    worker = f"node {nodes.setdefault(host, len(nodes))}, pid {pid}"  # nodes numbered as seen
                    peaks[worker] = max(peaks.get(worker, 0), peak)
            except BaseException:
                _cancel(ray, pending)
                raise
        self.stats = {
            "tasks": len(groups),
            "workers": len(peaks),
            "seconds": round(time.perf_counter() - started, 3),
            "worker_peak_rss_bytes": peaks,
        }
        return reports.reports()


def gpus_per_task(ray: Any, job: Job) -> bool:
    """Whether tasks ask for GPUs: the merge computes on CUDA and the cluster has GPUs."""
    options = getattr(job, "options", None)
    device = getattr(options, "device", None)
    return device is not None and device.type == "cuda" and ray.cluster_resources().get("GPU", 0) > 0


def _cancel(ray: Any, pending: dict[Any, list[int]]) -> None:
    """Stop every task still pending or running (their workers killed: nothing writes into the output after
    this returns), and wait until they are gone."""
    refs = list(pending)
    for ref in refs:
        ray.cancel(ref, force=True, recursive=True)
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=60)


_OPEN: dict[str, tuple[ExitStack, Job]] = {}  # in a worker: the job of the run it last served, kept open


def _worker_job(spec: WorkerSpec) -> Job:
    """In a worker: the job of ``spec`` opened once per run (the inputs stay open for its next tasks)."""
    if spec.key not in _OPEN:
        for stack, _ in _OPEN.values():
            stack.close()
        _OPEN.clear()
        stack = ExitStack()
        try:
            job = spec.open(stack)
        except BaseException:
            stack.close()
            raise
        _OPEN[spec.key] = (stack, job)
    return _OPEN[spec.key][1]


def run_task(spec: WorkerSpec, group: list[int], threads: int | None) -> tuple[list, tuple[str, int, int]]:
    """A Ray task: read, compute and deliver the items ``group`` of the job; their reports, and this worker's
    host, process id and peak resident memory in bytes."""
    results = []
    with merge_threads(threads):
        job = _worker_job(spec)
        for k in group:
            item = job.items[k]
            inputs = job.read(item)
            start = time.perf_counter()
            outcome = job.compute(item, inputs)
            seconds = time.perf_counter() - start
            del inputs
            returned = job.deliver(item, outcome.output)
            results.append((k, seconds, outcome.diagnostics, returned))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return results, (os.uname().nodename, os.getpid(), peak)
