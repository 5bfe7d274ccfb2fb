"""The device plan (issue 50, item 3): batch sizes that fit a memory budget, the CPU for a layer that does not fit,
the time from per-operation rates, and the memory model held against what a batch really allocates."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from specmerge.cli import main
from specmerge.pipeline.plan.device import (
    GIB,
    H200,
    KNOWN_DEVICES,
    LayerShape,
    batch_peak,
    default_budget,
    eigh_workspace,
    known_device,
    layer_steps,
    plan_device,
)
from specmerge.pipeline.run.api import merge_recipe
from specmerge.pipeline.run.device_plan import apply, plan_for
from specmerge.pipeline.run.executor import StreamingExecutor
from test_executor_interface import merged_both_ways
from tiny_models import build_family

LLAMA_3B = [  # (N, d_out, d_in, layers): Llama-3.2-3B's projections, 28 decoder layers, 4 experts
    LayerShape(4, 3072, 3072, 56, ("q_proj", "o_proj")),
    LayerShape(4, 1024, 3072, 56, ("k_proj", "v_proj")),
    LayerShape(4, 8192, 3072, 56, ("gate_proj", "up_proj")),
    LayerShape(4, 3072, 8192, 28, ("down_proj",)),
]


def test_a_large_budget_batches_every_group_up_to_the_cap():
    plan = plan_device(LLAMA_3B, 1000 * GIB, H200, max_batch=16)
    assert [g.batch for g in plan.groups] == [16, 16, 16, 16]
    assert plan.peak <= 1000 * GIB and not plan.cpu_layers()


def test_each_batch_is_the_largest_that_fits_the_budget():
    budget = 20 * GIB
    plan = plan_device(LLAMA_3B, budget, H200)
    for g in plan.groups:
        steps = layer_steps(g.shape, 4, 2, True)
        assert batch_peak(steps, g.batch, g.shape.d_in, 8, staged=True) <= budget
        assert g.batch == g.shape.count or batch_peak(steps, g.batch + 1, g.shape.d_in, 8, staged=True) > budget
    assert plan.groups[1].batch > plan.groups[3].batch  # small k/v layers batch more than the wide down_proj


def test_a_tight_budget_runs_layers_one_at_a_time_and_a_layer_that_cannot_fit_on_the_cpu():
    down = LLAMA_3B[3]
    one = batch_peak(layer_steps(down, 4, 2, True), 1, down.d_in, 8, staged=True)
    plan = plan_device([down], one, H200)
    assert plan.groups[0].batch == 1 and plan.groups[0].peak == one
    plan = plan_device([down], one - 1, H200)
    assert plan.groups[0].batch == 0 and plan.groups[0].where == "cpu"
    assert plan.cpu_layers() == [("down_proj", plan.groups[0])]
    assert plan.seconds == 0.0  # nothing planned on the device


def test_the_memory_model_counts_the_workspace_and_float64_spectra():
    shape = LayerShape(4, 3584, 18944, 1)
    f64, f32 = layer_steps(shape, 4, 2, True), layer_steps(shape, 4, 2, False)
    assert f64["eigh"] == 2 * (f32["eigh"] - 18944 * 4) + 18944 * 8  # C and its vectors in float64
    assert eigh_workspace(18944, 8) == (1 + 6 * 18944 + 2 * 18944**2) * 8 + (3 + 5 * 18944) * 4
    # the Qwen2-7B down_proj: about 4 x 271 MB of experts, C and vectors 2.9 GB each in float64
    assert 10 * GIB < batch_peak(f64, 1, 18944, 8) < 20 * GIB


def test_time_comes_from_the_measured_eigh_and_the_rates():
    assert H200.eigh_seconds(8192) == pytest.approx(0.66)
    assert H200.eigh_seconds(18944) == pytest.approx(3.26)
    assert 0.66 < H200.eigh_seconds(12000) < 3.26
    assert H200.eigh_seconds(2 * 18944) == pytest.approx(8 * 3.26)
    plan = plan_device(LLAMA_3B, 80 * GIB, H200)
    assert plan.seconds == pytest.approx(sum(g.seconds for g in plan.groups))
    down = plan.groups[3]
    assert down.seconds > 28 * H200.eigh_seconds(8192)  # at least the decompositions


def test_known_devices_by_their_cuda_names_and_scaled_rates_say_so():
    assert known_device("NVIDIA H100 80GB HBM3").name == "H100"
    assert known_device("NVIDIA A100-SXM4-80GB").name == "A100"
    assert known_device("NVIDIA GeForce RTX 4090").name == "RTX4090"
    assert known_device("some future GPU") is H200
    assert "measured" in H200.source and "not measured" in KNOWN_DEVICES["A100"].source
    assert KNOWN_DEVICES["A100"].eigh_seconds(8192) > H200.eigh_seconds(8192)
    assert not KNOWN_DEVICES["RTX4090"].float64_spectra  # slow float64: float32 spectra, as float64_spectra() says


def test_default_budget_leaves_a_margin():
    assert default_budget(80 * GIB) == 72 * GIB
    assert default_budget(4 * GIB) == 3 * GIB
    assert default_budget(0) == 0


def test_describe_is_json():
    text = json.dumps(plan_device(LLAMA_3B, 40 * GIB, H200, budget_from="--gpu-memory 40GiB").describe())
    assert '"budget_from": "--gpu-memory 40GiB"' in text


MEASURE = textwrap.dedent(
    """
    import json, sys, torch
    from specmerge.io.views.task_vectors import Dense
    from specmerge.pipeline.plan.device import LayerShape, batch_peak, layer_steps
    from specmerge.pipeline.plan.rules import TensorPlan
    from specmerge.pipeline.run.batched import merge_spectral_batch

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    torch.set_num_threads(1)
    batch, n, d_out, d_in = map(int, sys.argv[1:])
    g = torch.Generator().manual_seed(0)
    bases = [torch.randn(d_out, d_in, generator=g) for _ in range(batch)]
    values = [[Dense(b + 0.01 * torch.randn(d_out, d_in, generator=g)) for _ in range(n)] for b in bases]
    plans = [TensorPlan(f"l{k}", (d_out, d_in), torch.bfloat16, "merge", "swudi_a", {}, "") for k in range(batch)]
    cpu = torch.device("cpu")
    merge_spectral_batch(plans[:1], bases[:1], values[:1], device=cpu, compute_dtype=torch.float32)  # warm up
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts again from now
    before = status("VmRSS")
    out = merge_spectral_batch(plans, bases, values, device=cpu, compute_dtype=torch.float32)
    planned = batch_peak(layer_steps(LayerShape(n, d_out, d_in, batch), 4, 2, False), batch, d_in, 4)
    print(json.dumps({"measured": status("VmHWM") - before, "planned": planned, "batch": out[0][1].get("batch")}))
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak resident set reset")
@pytest.mark.parametrize(("batch", "n", "d_out", "d_in"), [(4, 4, 512, 512), (3, 4, 768, 768), (2, 4, 2048, 512)])
def test_a_batch_allocates_no_more_than_planned_on_the_cpu(batch, n, d_out, d_in):
    """The resident set's peak over a batch (glibc told to map every allocation over 64 KiB on its own, so that
    freeing returns it and the resident set follows what is allocated) against the plan's figure: within it, and
    not a blanket (more than half of it)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run([sys.executable, "-c", MEASURE, *map(str, (batch, n, d_out, d_in))], env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["batch"] == batch  # decomposed together
    assert result["planned"] / 2 < result["measured"] <= result["planned"]


# ---------------------------------------------------------------------------------------------
# The plan in a merge and in a dry run (the CPU stands in for the device: the same code, stages in sequence)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("device-plan"), "llama", n_experts=3)


class PlannedExecutor(StreamingExecutor):
    """The streaming executor with a device plan applied as a CUDA merge applies it, here on the CPU."""

    def __init__(self, recipe):
        super().__init__()
        self.recipe, self.plan = recipe, None

    def run(self, job, *, progress=True):
        self.plan, sizes = plan_for(job, self.recipe, None)
        apply(job, self, self.plan, sizes)
        return super().run(job, progress=progress)


@pytest.mark.parametrize("budget", ["1MiB", "100KiB"])
def test_a_planned_merge_writes_the_same_files_and_says_which_layers_leave_the_device(llama, tmp_path, caplog, budget):
    base, experts = llama
    options = {"method": "swudi_a", "shard_size": "8KB", "progress": False, "threads": 1}
    executor = PlannedExecutor(merge_recipe(base, experts, method="swudi_a", gpu_memory=budget))
    with caplog.at_level(logging.INFO, logger="specmerge.output"):
        merged_both_ways(base, experts, tmp_path, executor, **options)  # the same files, planned or not
    groups = executor.plan.groups
    assert len(groups) == 4  # q/o, k/v, gate/up and down of the tiny Llama
    if budget == "1MiB":
        assert all(g.batch > 1 for g in groups) and not executor.plan.cpu_layers()
    else:
        assert {g.batch for g in groups} >= {0, 1}  # some one at a time, some over the budget
    for name, _ in executor.plan.cpu_layers():
        assert any(name in r.getMessage() and "computed on the CPU" in r.getMessage() for r in caplog.records)
    assert any(r.getMessage().startswith("device plan on") for r in caplog.records)


@pytest.mark.skipif(torch.cuda.is_available(), reason="plans for a GPU that is not here")
def test_a_dry_run_plans_for_a_gpu_that_is_not_here(llama, capsys):
    base, experts = llama
    argv = ["merge", str(base), *map(str, experts), "--device", "cuda", "--dry-run"]
    assert main([*argv, "--gpu-memory", "80GiB", "--json"]) == 0
    estimate = json.loads(capsys.readouterr().out)
    plan = estimate["device_plan"]
    assert plan["budget_bytes"] == 80 * GIB and plan["rates"] == "H200" and len(plan["groups"]) == 4
    assert "not here" in estimate["device"]
    assert main([*argv, "--gpu-memory", "80GiB"]) == 0
    text = capsys.readouterr().out
    assert "device: cuda (not here), budget 80" in text and "batches of" in text
    assert main(argv) == 2
    assert "--gpu-memory 80GiB" in capsys.readouterr().err  # what to add, in the one line


def test_gpu_memory_is_a_size():
    from specmerge.errors import RecipeError
    from specmerge.pipeline.recipe.model import Recipe

    for bad in ("lots", True, -1, 0, [1]):
        with pytest.raises(RecipeError, match="gpu_memory"):
            Recipe.from_dict({"base": "/b", "experts": ["/e"], "gpu_memory": bad})
    assert Recipe.from_dict({"base": "/b", "experts": ["/e"], "gpu_memory": 8e10}).gpu_memory == 80_000_000_000
