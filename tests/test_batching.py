"""Same-shape spectral layers decomposed by one batched eigh (issue 50, item 2): the same bits as one call per layer.

``decompose_batch`` stacks the matrices :func:`~specmerge.linalg.spectrum.decompose` would hand to eigh (C, or C in
float64 on a GPU with fast float64) and builds each layer's spectrum from the batched result; the streaming executor
with ``batch`` > 1 computes the same-shape spectral layers of a merge together. On the CPU, torch's batched eigh runs
LAPACK once per matrix, so batched and unbatched must agree bit for bit; this is what the tests check, on the
spectra and on whole merges' files.
"""

from __future__ import annotations

import json

import pytest
import torch

from specmerge.linalg import eigensolver
from specmerge.linalg.quadratic import normal_equation
from specmerge.linalg.spectrum import decompose, decompose_batch
from specmerge.pipeline.run.api import merge
from specmerge.pipeline.run.executor import StreamingExecutor, units
from test_executor_interface import assert_same_outputs, merged_both_ways
from tiny_models import build_family, poisoned_copy


def stacks(count: int, n: int, d_out: int, d_in: int, dtype=torch.float32, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d_out, d_in, generator=g).to(dtype) for _ in range(count)]


def assert_same_spectrum(a, b) -> None:
    assert torch.equal(a.eigenvalues, b.eigenvalues)
    assert torch.equal(a.computed_eigenvalues, b.computed_eigenvalues)
    assert torch.equal(a.vectors, b.vectors)
    assert (a.floor, a.accurate, a.error, a.n_rows, a.n_cols) == (b.floor, b.accurate, b.error, b.n_rows, b.n_cols)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("n", "d_out", "d_in"), [(3, 24, 16), (2, 40, 40), (4, 16, 48)])
def test_a_batch_gives_each_layers_own_spectrum_bit_for_bit(dtype, n, d_out, d_in):
    equations = [normal_equation(stack) for stack in stacks(5, n, d_out, d_in, dtype)]
    batched = decompose_batch(equations)
    assert batched is not None and len(batched) == 5
    for eq, spectrum in zip(equations, batched, strict=True):
        assert_same_spectrum(spectrum, decompose(eq))


def test_layers_that_take_another_route_are_not_batched(monkeypatch):
    wide = [normal_equation(stack) for stack in stacks(3, 2, 8, 48)]  # N d_out < d_in: the SVD of M
    assert decompose_batch(wide) is None
    tall = [normal_equation(stack) for stack in stacks(3, 2, 40, 32)]
    monkeypatch.setattr(eigensolver, "PARTIAL_MIN_SIZE", 16)
    assert decompose_batch(tall, partial=[True, True, True]) is None  # the partial eigensolver's reduction
    assert decompose_batch(tall, partial=[False, False, False]) is not None
    mixed = [normal_equation(stacks(1, 2, 40, 32)[0]), normal_equation(stacks(1, 2, 40, 24)[0])]
    assert decompose_batch(mixed) is None  # two shapes
    assert decompose_batch([]) is None


class Item:
    def __init__(self, key):
        self.key = key


def test_units_group_same_keys_in_plan_order_up_to_the_batch_size():
    items = [Item(k) for k in ["q", "k", None, "q", "k", "q", None, "q"]]
    assert units(items, lambda item: item.key, 2) == [[0, 3], [1, 4], [2], [5, 7], [6]]
    assert units(items, lambda item: item.key, 1) == [[k] for k in range(8)]
    assert units(items, lambda item: item.key, 8) == [[0, 3, 5, 7], [1, 4], [2], [6]]


def test_batch_must_be_a_whole_number():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="batch must be a whole number"):
            StreamingExecutor(batch=bad)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("batching"), "llama", n_experts=4)


@pytest.mark.parametrize(("method", "params"), [("swudi_a", {}), ("swudi", {"rank_ratio": 0.5}), ("closed_form", {})])
@pytest.mark.parametrize("batch", [2, 8])
def test_a_batched_merge_writes_the_same_files(llama, tmp_path, method, params, batch):
    base, experts = llama
    options = {"method": method, "params": params, "shard_size": "8KB", "progress": False, "threads": 1}
    _, batched = merged_both_ways(base, experts, tmp_path, StreamingExecutor(batch=batch), **options)
    report = json.loads((tmp_path / "other" / "report.json").read_text())
    assert report["executor"]["batch"] == batch
    sizes = [row.get("diagnostics", {}).get("batch") for row in batched["tensors"]]
    assert any(sizes) and all(size <= batch for size in sizes if size)


def test_a_nan_in_a_batched_layer_is_refused_as_without_batching(llama, tmp_path):
    base, experts = llama
    bad, name = poisoned_copy(experts[1], tmp_path / "bad", lambda n: n.endswith("layers.1.self_attn.q_proj.weight"))
    messages = []
    for executor in (None, StreamingExecutor(batch=4)):
        with pytest.raises(Exception) as caught:
            merge(base, [experts[0], bad, *experts[2:]], tmp_path / f"out{len(messages)}", method="swudi_a",
                  progress=False, executor=executor)  # fmt: skip
        messages.append(str(caught.value).replace(str(tmp_path / "out0"), "").replace(str(tmp_path / "out1"), ""))
        assert name in messages[-1]
    assert messages[0] == messages[1]
    assert not (tmp_path / "out1").exists()


def test_inputs_are_staged_on_the_reader_thread_and_the_cpu_stages_nothing(llama, tmp_path, monkeypatch):
    """The device pipeline's staging step (pinned buffers, copies on a side stream on a GPU) runs on the reader
    thread, one unit ahead of the compute; on the CPU it returns the inputs as they are: the same files."""
    import threading

    from specmerge.pipeline.run import jobs
    from specmerge.pipeline.run.work import Inputs, stage_inputs

    inputs = Inputs(torch.ones(2), [])
    assert stage_inputs(inputs, torch.device("cpu"), object()) is inputs
    assert stage_inputs(inputs, torch.device("cuda"), None) is inputs  # no stream: in sequence
    inputs.wait()  # nothing to wait for
    threads, stage = [], jobs.ModelJob.stage

    def spy(self, item, read):
        threads.append(threading.current_thread().name)
        staged = stage(self, item, read)
        assert staged is read
        return staged

    monkeypatch.setattr(jobs.ModelJob, "stage", spy)
    base, experts = llama
    options = {"method": "swudi_a", "shard_size": "8KB", "progress": False, "threads": 1}
    staged = merge(base, experts, tmp_path / "staged", **options)
    monkeypatch.setattr(jobs.ModelJob, "stage", stage)
    plain = merge(base, experts, tmp_path / "plain", **options)
    assert threads and all(name.startswith("specmerge-read") for name in threads)
    assert_same_outputs(tmp_path / "plain", tmp_path / "staged", plain, staged)
