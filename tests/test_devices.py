"""Several devices in one process (issue 50, item 4): units balanced by estimated time, the same files.

On the CPU the devices executor runs its threads on the CPU: the test of its logic and of its output, which must be
the streaming executor's bit for bit at equal thread counts (one torch thread everywhere here)."""

from __future__ import annotations

import itertools

import pytest

from specmerge.pipeline.run.api import merge
from specmerge.pipeline.run.devices import DevicesExecutor, balance
from test_executor_interface import merged_both_ways
from tiny_models import build_family, poisoned_copy


def test_balance_gives_out_the_longest_first_to_the_least_loaded():
    assert balance([5, 1, 4, 2, 3], 2) == [[0, 1, 3], [2, 4]]  # 5+2+1 against 4+3
    assert balance([1.0] * 5, 3) == [[0, 3], [1, 4], [2]]
    assert balance([], 2) == [[], []]
    with pytest.raises(ValueError):
        balance([1.0], 0)


@pytest.mark.parametrize("workers", [2, 3])
def test_balance_is_within_four_thirds_of_the_best_split(workers):
    costs = [7, 3, 9, 2, 2, 5, 8, 1]
    best = min(
        max(sum(c for c, w in zip(costs, assignment, strict=True) if w == k) for k in range(workers))
        for assignment in itertools.product(range(workers), repeat=len(costs))
    )
    shares = balance(costs, workers)
    assert sorted(k for share in shares for k in share) == list(range(len(costs)))
    assert max(sum(costs[k] for k in share) for share in shares) <= 4 / 3 * best


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("devices"), "llama", n_experts=3)


@pytest.mark.parametrize(("method", "params"), [("swudi_a", {}), ("ties", {"density": 0.3}), ("task_arithmetic", {})])
@pytest.mark.parametrize("batch", [1, 4])
def test_three_devices_write_the_streaming_executors_files(llama, tmp_path, method, params, batch):
    base, experts = llama
    options = {"method": method, "params": params, "shard_size": "8KB", "progress": False, "threads": 1}
    executor = DevicesExecutor(["cpu", "cpu", "cpu"], batch=batch)
    plain, spread = merged_both_ways(base, experts, tmp_path, executor, **options)
    assert spread["executor"] == {"name": "devices", "devices": ["cpu", "cpu", "cpu"]}
    names = [name for share in executor.assigned for name in share]
    assert sorted(set(names)) == sorted(row["name"] for row in plain["tensors"])
    assert all(executor.assigned)  # every device computed something


def test_an_error_on_one_device_stops_the_others_and_is_raised_as_in_the_streaming_executor(llama, tmp_path):
    base, experts = llama
    bad, name = poisoned_copy(experts[1], tmp_path / "bad", lambda n: n.endswith("layers.1.mlp.down_proj.weight"))
    messages = []
    for k, executor in enumerate((None, DevicesExecutor(["cpu", "cpu"]))):
        with pytest.raises(Exception) as caught:
            merge(base, [experts[0], bad, experts[2]], tmp_path / f"out{k}", method="swudi_a", progress=False,
                  executor=executor)  # fmt: skip
        messages.append(str(caught.value).replace(str(tmp_path / f"out{k}"), "OUT"))
        assert not (tmp_path / f"out{k}").exists()
    assert name in messages[0] and messages[0] == messages[1]
