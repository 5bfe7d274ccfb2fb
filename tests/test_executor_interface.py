"""A second executor written against the interface only (specmerge.pipeline.run.work), producing the same files.

The test executors below know nothing of the streaming executor's internals: they take a job's work items,
call ``job.read``, ``job.compute`` and ``job.deliver`` for each, and add the results to a
``ReportAccumulator``. One runs the items last to first; the other reads and delivers them on a thread pool
and computes them in a shuffled order. Both must write byte-identical output files to the streaming
executor, for full-checkpoint merges (a row-blocked linear method with a tiny block size, an elementwise one,
a matrix one, over several shards) and for a merged LoRA adapter; the per-tensor reports agree too, apart
from the seconds.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from specmerge.pipeline.run import work
from specmerge.pipeline.run.api import merge
from specmerge.pipeline.run.work import Job, ReportAccumulator, TensorReport
from tiny_models import build_family, save_adapter

KEYS = ["e0", "e1", "e2"]


class ReversedExecutor:
    """Every work item, last to first: read, compute, deliver, one item at a time."""

    def __init__(self) -> None:
        self.order: list[tuple[str, tuple[int, int] | None]] = []

    def run(self, job: Job, *, progress: bool = True) -> list[TensorReport]:
        reports = ReportAccumulator(job.items)
        for item in reversed(job.items):
            self.order.append((item.name, item.rows))
            inputs = job.read(item)
            start = time.perf_counter()
            outcome = job.compute(item, inputs)
            reports.add(item, time.perf_counter() - start, outcome.diagnostics)
            job.deliver(item, outcome.output)
        return reports.reports()


class PooledExecutor:
    """Reads every item on a pool of threads, computes them here in a shuffled order, delivers each on the pool
    (one delivery at a time, as the interface asks)."""

    def run(self, job: Job, *, progress: bool = True) -> list[TensorReport]:
        reports = ReportAccumulator(job.items)
        order = list(job.items)
        random.Random(0).shuffle(order)
        with ThreadPoolExecutor(max_workers=4) as readers, ThreadPoolExecutor(max_workers=1) as deliverer:
            reads = {id(item): readers.submit(job.read, item) for item in order}
            delivered = []
            for item in order:
                start = time.perf_counter()
                outcome = job.compute(item, reads.pop(id(item)).result())
                reports.add(item, time.perf_counter() - start, outcome.diagnostics)
                delivered.append(deliverer.submit(job.deliver, item, outcome.output))
            for future in delivered:
                future.result()
        return reports.reports()


def output_files(folder: Path) -> dict[str, bytes]:
    """Every file of an output folder but report.json (it holds times), by name."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "report.json"}


def tensor_reports(report: dict) -> list[dict]:
    """The report's per-tensor rows without what depends on the schedule: the seconds, and the size of the batch a
    spectral layer was decomposed in (``diagnostics["batch"]``)."""
    rows = []
    for row in report["tensors"]:
        row = {k: v for k, v in row.items() if k != "seconds"}
        if "diagnostics" in row:
            row["diagnostics"] = {k: v for k, v in row["diagnostics"].items() if k != "batch"}
        rows.append(row)
    return rows


def merged_both_ways(base, experts, folder: Path, executor, **options) -> tuple[dict, dict]:
    """The reports of one merge by the streaming executor (``folder/plain``) and by ``executor``
    (``folder/other``), after checking that they wrote the same files and per-tensor reports."""
    plain = merge(base, experts, folder / "plain", **options)
    other = merge(base, experts, folder / "other", executor=executor, **options)
    assert_same_outputs(folder / "plain", folder / "other", plain, other)
    return plain, other


def assert_same_outputs(streamed: Path, other: Path, streamed_report: dict, other_report: dict) -> None:
    expected, got = output_files(streamed), output_files(other)
    assert expected.keys() == got.keys()
    for name in expected:
        assert expected[name] == got[name], name
    assert tensor_reports(streamed_report) == tensor_reports(other_report)
    assert json.loads((other / "report.json").read_text())["summary"] == streamed_report["summary"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("interface"), "llama")


@pytest.mark.parametrize(
    "method,params",
    [("task_arithmetic", {"scale": 0.4}), ("ties", {"density": 0.3}), ("swudi_a", {})],
)
@pytest.mark.parametrize("executor_class", [ReversedExecutor, PooledExecutor])
def test_full_checkpoint_merges_are_the_same_files_whatever_the_schedule(
    llama, tmp_path, monkeypatch, method, params, executor_class
):
    monkeypatch.setattr(work, "BLOCK_BYTES", 256)  # linear merges and averages in blocks of a few rows
    base, experts = llama
    options = {"method": method, "params": params, "expert_keys": KEYS, "shard_size": "8KB", "progress": False,
               "merge_embeddings": False}  # embeddings averaged: in row blocks, whatever the method  # fmt: skip
    streamed = merge(base, experts, tmp_path / "streamed", **options)
    executor = executor_class()
    other = merge(base, experts, tmp_path / "other", executor=executor, **options)
    assert len(list((tmp_path / "other").glob("model-*.safetensors"))) > 2  # several shards, filled out of order
    if isinstance(executor, ReversedExecutor):
        blocked = [rows for name, rows in executor.order if rows is not None]
        assert blocked and executor.order[0][0] == streamed["tensors"][-1]["name"]  # last tensor first
    assert_same_outputs(tmp_path / "streamed", tmp_path / "other", streamed, other)


@pytest.mark.parametrize("max_rank", [None, 2])
@pytest.mark.parametrize("executor_class", [ReversedExecutor, PooledExecutor])
def test_merged_adapters_are_the_same_files_whatever_the_schedule(llama, tmp_path, executor_class, max_rank):
    base, _ = llama
    adapters = [
        save_adapter(base, tmp_path / "a0", 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        save_adapter(base, tmp_path / "a1", 2, r=2, lora_alpha=4, target_modules=["q_proj", "o_proj", "up_proj"]),
    ]
    options = {"output_format": "lora", "method": "swudi_a", "max_rank": max_rank, "progress": False}
    streamed = merge(base, adapters, tmp_path / "streamed", **options)
    other = merge(base, adapters, tmp_path / "other", executor=executor_class(), **options)
    assert (tmp_path / "other" / "adapter_model.safetensors").is_file()
    assert_same_outputs(tmp_path / "streamed", tmp_path / "other", streamed, other)
