"""The Ray executor (issue 18) on a local Ray cluster of 2 CPUs started by these tests: the same files as the
in-process executor for every method, a worker killed mid-merge survived by Ray's retry, a data error ending
the merge with the in-process one-line error and nothing left behind.

torch's results depend on its thread count (the demo's SWUDI-A MLP weights differ between 1 and 2 threads in
process too), so each comparison runs both executors at one thread: the workers ask for one CPU each.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest
import torch

from specmerge.demo import build_experts
from specmerge.errors import NonFiniteError, RecipeError
from specmerge.methods import all_methods, get_method
from specmerge.pipeline.recipe.model import Recipe
from specmerge.pipeline.run import api
from test_executor_interface import assert_same_outputs
from tiny_models import expert_count, poisoned_copy, save_adapter

ray = pytest.importorskip("ray")
from specmerge.pipeline.run.ray_executor import RayExecutor, task_groups  # noqa: E402

TESTS = Path(__file__).resolve().parent
QUICK = {"wudi": {"steps": 3}, "wudi_reference": {"steps": 3}, "optmerge": {"steps": 3}, "optmerge_lora": {"steps": 3}}


@pytest.fixture(scope="module")
def cluster():
    """A local Ray instance of 2 CPUs whose workers can import tests/ray_faults.py; stopped after the module."""
    if ray.is_initialized():
        ray.shutdown()
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's tiny Llama and its four experts."""
    base, experts, _ = build_experts(tmp_path_factory.mktemp("demo"))
    return base, experts


def _both(base, experts, tmp_path, executor=None, **options):
    options = {"progress": False, **options}
    local = api.merge(base, experts, tmp_path / "local", threads=1, **options)
    remote = api.merge(base, experts, tmp_path / "ray", executor=executor or RayExecutor(threads=1), **options)
    return local, remote


@pytest.mark.parametrize("method", sorted(all_methods()))
def test_every_method_writes_the_same_files_through_ray(cluster, demo, tmp_path, method):
    base, experts = demo
    given = experts[: expert_count(get_method(method), len(experts))]  # slerp: the base and one expert
    local, remote = _both(base, given, tmp_path, method=method, params=QUICK.get(method), shard_size="200KB")
    assert len(list((tmp_path / "ray").glob("model-*.safetensors"))) > 1  # several shards, filled by workers
    assert_same_outputs(tmp_path / "local", tmp_path / "ray", local, remote)
    assert remote["executor"]["name"] == "ray" and remote["executor"]["tasks"] >= 1
    # published with the model: no host name, no cluster address (issue 49, item 5)
    assert platform.node() not in (tmp_path / "ray" / "report.json").read_text()
    assert all(worker.startswith("node 0, pid ") for worker in remote["executor"]["worker_peak_rss_bytes"])


def test_a_merged_lora_adapter_is_the_same_through_ray(cluster, tmp_path):
    from tiny_models import build_family

    base, _ = build_family(tmp_path / "family", "llama")
    adapters = [
        save_adapter(base, tmp_path / "a0", 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        save_adapter(base, tmp_path / "a1", 2, r=2, lora_alpha=4, target_modules=["q_proj", "o_proj", "up_proj"]),
    ]
    local, remote = _both(base, adapters, tmp_path, output_format="lora", method="swudi_a", max_rank=2)
    assert_same_outputs(tmp_path / "local", tmp_path / "ray", local, remote)


def test_a_worker_killed_mid_merge_is_survived_by_retry(cluster, demo, tmp_path):
    from ray_faults import DieOnce

    marker = tmp_path / "died"

    class Dying(RayExecutor):
        def worker_spec(self, job):
            return DieOnce(job.remote(), str(marker), at=len(job.items) // 2)

    base, experts = demo
    local, remote = _both(base, experts, tmp_path, executor=Dying(threads=1), method="swudi_a")
    assert marker.is_file()  # a worker did die in the middle of the merge
    assert_same_outputs(tmp_path / "local", tmp_path / "ray", local, remote)


def test_a_worker_lost_at_every_try_ends_the_merge_in_one_line(cluster, demo, tmp_path):
    from ray_faults import DieOnce
    from specmerge.pipeline.run.ray_executor import WorkerLost

    class AlwaysDying(RayExecutor):
        def worker_spec(self, job):
            self.name = job.items[3].name
            return DieOnce(job.remote(), str(tmp_path / "died"), at=3, always=True)

    base, experts = demo
    executor = AlwaysDying(threads=1, max_retries=1)
    with pytest.raises(WorkerLost, match=r"Ray lost the worker computing .* 2 times") as caught:
        api.merge(base, experts, tmp_path / "out", method="swudi_a", progress=False, executor=executor)
    assert executor.name in str(caught.value) and "\n" not in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["died"]


def test_a_data_error_ends_the_merge_with_the_one_line_error_and_leaves_nothing(cluster, demo, tmp_path):
    base, experts = demo
    late = "model.layers.1.mlp.down_proj.weight"  # late in the plan: other tasks are done or running
    poisoned, name = poisoned_copy(experts[1], tmp_path / "poisoned", late, index=5)
    given = [experts[0], poisoned, *experts[2:]]
    errors = []
    for where, executor in (("local", None), ("ray", RayExecutor(threads=1))):
        with pytest.raises(NonFiniteError) as caught:
            api.merge(base, given, tmp_path / where, method="swudi_a", progress=False, executor=executor)
        errors.append(str(caught.value))
    assert errors[0] == errors[1] and f"'{name}'" in errors[1] and "\n" not in errors[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["poisoned"]  # no output, no work folder


def test_tasks_group_small_items_and_keep_spectral_tensors_alone(demo):
    from contextlib import ExitStack

    from specmerge.pipeline.plan.prepare import prepare_merge
    from specmerge.pipeline.run.work import work_items

    base, experts = demo
    with ExitStack() as stack:
        prepared = prepare_merge(stack, api.merge_recipe(base, experts, method="swudi"), None)
    items = work_items(prepared.plan, 4)
    groups = task_groups(items, [0.1] * len(items), target=0.3)
    assert [k for g in groups for k in g] == list(range(len(items)))  # every item once, runs in order
    for group in groups:
        spectral = [get_method(items[k].entry.method).spectral for k in group if items[k].entry.action == "merge"]
        assert len(group) == 1 or not any(spectral)
        assert len(group) <= 3


def test_the_recipe_names_the_executor_and_the_written_recipe_does_not(cluster, demo, tmp_path):
    base, experts = demo
    with pytest.raises(RecipeError, match=r"address .* applies only to executor ray"):
        Recipe(base=str(base), experts=[str(e) for e in experts], address="auto")
    recipe = Recipe(base=str(base), experts=[str(e) for e in experts], executor="ray", address="auto")
    assert isinstance(api.executor_for(recipe), RayExecutor)
    by_name = api.merge(base, experts, tmp_path / "named", method="task_arithmetic", progress=False, executor="ray")
    assert by_name["executor"]["name"] == "ray"
    assert "executor: local" in (tmp_path / "named" / "recipe.yaml").read_text()
    report = api.merge(base, experts, tmp_path / "out", method="task_arithmetic", progress=False)
    assert report["executor"] == {"name": "local"}
    assert "executor: local" in (tmp_path / "out" / "recipe.yaml").read_text()


def test_without_ray_installed_the_error_is_one_line(demo, monkeypatch):
    import importlib.util

    from specmerge.pipeline.run import ray_executor

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ray_executor.RayUnavailable, match=r"pip install 'specmerge\[ray\]'"):
        ray_executor.check_ray()


def test_an_in_memory_merge_refuses_ray_in_one_line():
    from specmerge.pipeline.run.memory import merge_state_dicts

    base = {"w": torch.zeros(3, 2)}
    experts = [{"w": torch.ones(3, 2)}, {"w": -torch.ones(3, 2)}]
    with pytest.raises(RecipeError, match="executor 'ray' does not apply to an in-memory merge"):
        merge_state_dicts(base, experts, executor="ray")
    with pytest.raises(RecipeError, match="option 'address' does not apply"):
        merge_state_dicts(base, experts, address="auto")
    merged = merge_state_dicts(base, experts, method="task_arithmetic", executor="local")
    assert torch.equal(merged["w"], torch.zeros(3, 2))


def test_tasks_ask_for_a_gpu_only_when_the_merge_computes_on_cuda_and_the_cluster_has_gpus(demo):
    from contextlib import ExitStack
    from types import SimpleNamespace

    from specmerge.pipeline.plan.prepare import prepare_merge
    from specmerge.pipeline.run.ray_executor import GPU_SHARE, gpus_per_task
    from specmerge.pipeline.run.work import work_items

    base, experts = demo
    with ExitStack() as stack:
        prepared = prepare_merge(stack, api.merge_recipe(base, experts, method="swudi"), None)
    items = work_items(prepared.plan, 4)
    spectral = next(i for i in items if i.entry.action == "merge")
    averaged = next(i for i in items if i.entry.action != "merge")
    executor = RayExecutor(cpus_per_task=2, max_retries=5)
    assert executor.task_options([spectral], gpus=False) == {"num_cpus": 2, "max_retries": 5}
    assert executor.task_options([averaged, spectral], gpus=True)["num_gpus"] == 1
    assert executor.task_options([averaged], gpus=True)["num_gpus"] == GPU_SHARE

    def job_on(device):
        return SimpleNamespace(options=SimpleNamespace(device=torch.device(device)))

    def cluster_with(gpus):
        return SimpleNamespace(cluster_resources=lambda: {"CPU": 16.0, **({"GPU": gpus} if gpus else {})})

    assert gpus_per_task(cluster_with(8), job_on("cuda"))
    assert not gpus_per_task(cluster_with(0), job_on("cuda"))  # no GPU in the cluster: CPU tasks
    assert not gpus_per_task(cluster_with(8), job_on("cpu"))  # the recipe computes on the CPU
