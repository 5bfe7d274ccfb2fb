"""The cost model (specmerge.pipeline.estimate.cost, .calibrate, specmerge.methods.operations) and the progress
bar it drives.

No timing is asserted (the machines are shared): rates are given (``ComputeRates.given``) wherever a number is
compared, and the counts are checked against the code paths they describe (which decomposition ``decompose``
takes, whether C is formed), against counts worked out by hand, and for monotonicity and linear scaling.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from specmerge.io.formats.sources import open_source
from specmerge.linalg.quadratic import normal_equation
from specmerge.linalg.spectrum import decompose
from specmerge.methods import all_methods, get_method
from specmerge.methods.operations import Operations, decompose_ops, normal_equation_ops, passes
from specmerge.methods.registry import LayerResult, register, registrations
from specmerge.pipeline.estimate.calibrate import ComputeRates, InputReads, input_reads, resident_pages
from specmerge.pipeline.estimate.cost import (
    BASE,
    UNDECLARED,
    ItemCost,
    item_costs,
    peak_memory,
    price,
    route_operations,
)
from specmerge.pipeline.plan.rules import TensorPlan
from specmerge.pipeline.run import executor as executor_module
from specmerge.pipeline.run import jobs as jobs_module
from specmerge.pipeline.run.executor import StreamingExecutor
from specmerge.pipeline.run.jobs import ComputeOptions, ModelJob
from specmerge.pipeline.run.work import WorkItem, work_items
from tiny_models import build_family

RATES = dict(matmul=1e11, qr=5e10, svd=2e-10, memory=1e10, fresh=4e9, linear=5e9, select=5e8, random=5e8)
EIGH = {256: 2e-3, 512: 1e-2, 1024: 7e-2, 2048: 0.5}


def given() -> ComputeRates:
    return ComputeRates.given(EIGH, **RATES)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("cost"), "llama")


def test_every_builtin_method_declares_its_cost():
    for method in all_methods().values():
        shape = (3, 24, 16)
        ops = method.operations(shape, 4, {})
        assert isinstance(ops, Operations), method.name
        assert ops.memory > 0 or ops.matmul > 0, method.name
        assert price(ops, given()) > 0, method.name


def test_counts_follow_the_code_paths():
    """eigh(C) exactly when decompose takes it (N d_out >= d_in), else QR + SVD of M; C formed when d_out >= d_in."""
    for n, d_out, d_in in [(3, 8, 12), (2, 4, 12), (3, 16, 8), (1, 5, 5)]:
        stack = torch.randn(n, d_out, d_in, dtype=torch.float64)
        eq = normal_equation(stack)
        assert eq.has_C == (d_out >= d_in)
        spectrum = decompose(eq)
        ops = decompose_ops(n, d_out, d_in, 8)
        assert (ops.eigh == (d_in,)) == (not spectrum.accurate)
        assert bool(ops.qr) == spectrum.accurate and bool(ops.svd) == spectrum.accurate
    # by hand: per expert the Gram tau tau^T is d_out^2 d_in (a symmetric update), times tau 2 d_out^2 d_in; A_i is
    # d_out d_in^2, tau A_i 2 d_out d_in^2
    assert normal_equation_ops(2, 8, 12, 4).matmul == 2 * 3 * 8 * 8 * 12
    assert normal_equation_ops(2, 12, 8, 4).matmul == 2 * 3 * 12 * 8 * 8
    assert decompose_ops(2, 8, 12, 4).matmul == 2 * 8 * 12 * 12  # C formed for eigh (d_out < d_in), symmetric updates


def test_a_top_k_filter_is_priced_on_the_partial_route_where_it_takes_it(monkeypatch):
    from specmerge.linalg import eigensolver

    monkeypatch.setattr(eigensolver, "PARTIAL_MIN_SIZE", 8)
    full, top = decompose_ops(4, 64, 48, 4), decompose_ops(4, 64, 48, 4, top_k=5)
    assert full.eigh == (48,) and not full.partial_eigh
    assert top.partial_eigh == ((48, 5),) and not top.eigh
    assert decompose_ops(4, 64, 48, 4, top_k=47).eigh == (48,)  # past the crossover: eigh, as the merge does
    assert decompose_ops(4, 64, 48, 4, top_k=47, rule=True).partial_eigh == ((48, 47),)  # a rule's K: partial
    rates = given()
    assert price(top, rates) < price(full, rates)
    monkeypatch.setattr(eigensolver, "PARTIAL_MIN_SIZE", 1024)
    assert decompose_ops(4, 64, 48, 4, top_k=5).eigh == (48,)  # small layers keep eigh


@pytest.mark.parametrize("name", ["swudi_a", "swudi", "closed_form", "tsv_m", "iso_c", "wudi", "optmerge", "ties"])
def test_a_bigger_layer_costs_more(name):
    method, rates = get_method(name), given()
    seconds = [price(method.operations((4, d, d), 4, {}), rates) for d in (128, 256, 512, 1024)]
    assert seconds == sorted(seconds) and len(set(seconds)) == 4, seconds
    wider = [price(method.operations((4, 256, d), 4, {}), rates) for d in (256, 512, 1024)]
    assert wider == sorted(wider) and len(set(wider)) == 3, wider
    more = [price(method.operations((n, 256, 256), 4, {}), rates) for n in (2, 4, 8)]
    assert more == sorted(more), more


def test_memory_bound_routes_scale_linearly():
    entry = TensorPlan("w", (64, 32), torch.float16, "average", None, {"scale": 1.0}, "embedding")
    for which, kinds in [("keep_base", []), ("unchanged", ["zero"] * 3), ("sum", ["dense", "zero", "dense"])]:
        one = route_operations(entry, which, (64, 32), kinds, [0] * len(kinds), in_size=2, out_size=2, itemsize=4)
        two = route_operations(entry, which, (128, 32), kinds, [0] * len(kinds), in_size=2, out_size=2, itemsize=4)
        assert one.matmul == two.matmul == 0 and not one.eigh
        assert two.memory == 2 * one.memory > 0, which
        assert math.isclose(price(two, given()), 2 * price(one, given()))


def reads(resident: float = 1.0) -> InputReads:
    labels = [BASE, "e0", "e1", "e2"]
    return InputReads({label: resident for label in labels}, cached_rate=1e10, disk_rate=5e8, write_rate=5e8)


def open_inputs(base: Path, experts: list[Path]):
    from specmerge.io.views.experts import CheckpointExpert

    source = open_source(base)
    return source, {key: CheckpointExpert(open_source(e)) for key, e in zip(["e0", "e1", "e2"], experts, strict=True)}


def test_linear_blocks_cost_in_proportion_to_their_rows(llama):
    base, experts = llama
    source, labelled = open_inputs(base, experts)
    with source:
        name = "model.embed_tokens.weight"
        info = source.infos()[name]
        entry = TensorPlan(name, tuple(info.shape), info.dtype, "average", None, {"scale": 1.0}, "embedding")
        items = work_items([entry], 4, block_bytes=24 * info.shape[1] * 4)  # blocks of 24 rows, last one shorter
        costs = item_costs(
            items, source, labelled, device=torch.device("cpu"), compute_dtype=torch.float32, rates=given(),
            reads=reads(0.5), overlap=False,
        )  # fmt: skip
        assert {c.route for c in costs} == {"linear"}
        rows = [item.rows[1] - item.rows[0] for item in items]
        assert len(set(rows)) == 2  # some blocks shorter than others
        for cost, count in zip(costs, rows, strict=True):
            assert math.isclose(cost.seconds / count, costs[0].seconds / rows[0])
            assert cost.read_bytes == 4 * count * info.shape[1] * info.dtype.itemsize
        # cold inputs cost more than cached ones, the same bytes
        cold = item_costs(
            items, source, labelled, device=torch.device("cpu"), compute_dtype=torch.float32, rates=given(),
            reads=reads(0.0), overlap=False,
        )  # fmt: skip
        assert all(c.seconds > w.seconds and c.read_bytes == w.read_bytes for c, w in zip(cold, costs, strict=True))


def test_peak_memory_counts_the_item_read_ahead_and_the_output_behind():
    entry = TensorPlan("w", (4, 4), torch.float32, "merge", "swudi_a", {}, "2-D linear weight")

    def cost(read: int, working: int, write: int) -> ItemCost:
        return ItemCost(WorkItem(entry), "dense", {BASE: read}, write, Operations(), working, 0, 0, 0, 0, 0, False)

    costs = [cost(10, 100, 1), cost(20, 5, 2), cost(1000, 7, 4), cost(3, 9, 8)]
    peak, where = peak_memory(costs, baseline=50)
    # item 1: its inputs, item 2's read ahead, its working set, its output, item 0's output being written
    assert (peak, where) == (50 + 20 + 1000 + 5 + 2 + 1, 1)
    assert peak_memory([], baseline=7) == (7, 0)


def test_a_plugin_without_a_declared_cost_is_estimated_and_said_so():
    with registrations():

        @register("plugin_mean", citation="", needs_matrix=False)
        def plugin_mean(task_vectors: torch.Tensor, *, scale: float = 1.0) -> LayerResult:
            """Mean.

            Args:
                scale: s.
            """
            return LayerResult(scale * task_vectors.mean(0))

        entry = TensorPlan("w", (8, 8), torch.float32, "merge", "plugin_mean", {}, "2-D linear weight")
        ops = route_operations(entry, "dense", (8, 8), ["dense"] * 2, [0, 0], in_size=4, out_size=4, itemsize=4)
        assert UNDECLARED in ops.assumed and ops.memory > passes(6, 64, 4).memory


def test_given_rates_are_not_probed_and_probes_only_what_is_used():
    rates = given()
    price(Operations(matmul=1e9, eigh=(300, 5000), memory=1e6), rates)
    assert set(rates.sources.values()) == {"given"} and rates.probe_seconds == 0
    assert rates.eigh_seconds(1024) == EIGH[1024]
    assert EIGH[1024] < rates.eigh_seconds(1500) < EIGH[2048]  # along the measured curve
    assert math.isclose(rates.eigh_seconds(4096), EIGH[2048] * 8)  # above the largest: d^3
    with pytest.raises(ValueError, match="unknown rate 'flops'"):
        ComputeRates.given(flops=1.0)
    fresh = ComputeRates()
    price(Operations(memory=1e6), fresh)
    assert set(fresh.sources) == {"memory"}  # nothing else probed


def test_page_cache_share_of_a_file_just_read(tmp_path):
    file = tmp_path / "data.bin"
    file.write_bytes(b"\1" * (4 * 2**20))
    file.read_bytes()
    if resident_pages(file) is None:
        pytest.skip("mincore is not available here")
    found = input_reads({"x": [file]}, probe=False)
    assert found.resident["x"] == 1.0 and found.sources["cached"] == "not measured: assumed"
    cached, disk = found.seconds("x", 1000)
    assert disk == 0 and cached > 0


def test_the_progress_bar_advances_by_each_items_estimate(llama, tmp_path, monkeypatch):
    """The job's Progress weights are its items' estimated seconds, and the executor moves the bar by them."""
    base, experts = llama
    source, labelled = open_inputs(base, experts)
    recorded = []

    def recording(*args, **kwargs):
        found = real_estimate(*args, **kwargs)
        recorded.append(found[0])
        return found

    real_estimate = jobs_module.estimate_items
    monkeypatch.setattr(jobs_module, "estimate_items", recording)
    updates = []

    class Bar(executor_module.tqdm):
        def update(self, n=1):
            updates.append(n)
            return super().update(n)

    monkeypatch.setattr(executor_module, "tqdm", Bar)
    with source:
        plan = [
            TensorPlan(name, tuple(info.shape), info.dtype, "average" if info.shape[0] == 64 else "merge", "swudi_a",
                       {"scale": 1.0} if info.shape[0] == 64 else {}, "test")
            for name, info in source.infos().items() if len(info.shape) == 2
        ]  # fmt: skip
        plan = [dataclasses.replace(e, method=None) if e.action == "average" else e for e in plan]
        options = ComputeOptions(torch.device("cpu"), torch.float32, ["e0", "e1", "e2"])
        written = []
        job = ModelJob(plan, source, list(labelled.values()), lambda *a, **k: written.append(a[0]), options)
        StreamingExecutor().run(job, progress=True)
    assert len(recorded) == 1 and job.progress.weights == tuple(c.seconds for c in recorded[0])
    assert updates == list(job.progress.weights) and len(updates) == len(job.items)
    assert math.isclose(job.progress.total, sum(c.seconds for c in recorded[0]))
    quiet = ModelJob(plan, open_source(base), list(labelled.values()), lambda *a, **k: None, options)
    StreamingExecutor().run(quiet, progress=False)  # no bar: nothing estimated
    assert len(recorded) == 1
