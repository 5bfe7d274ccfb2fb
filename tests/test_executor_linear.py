"""The chunked CPU route of linear merges (average, task arithmetic, weight average) against the generic one."""

import pytest
import torch

from specmerge.io.views.task_vectors import Dense, Zero
from specmerge.methods import get_method
from specmerge.pipeline.plan.rules import TensorPlan
from specmerge.pipeline.run import compute


def plan(action, method, params, shape, out_dtype):
    return TensorPlan("t", shape, out_dtype, action, method, params, "test")


CASES = [
    ("merge", "task_arithmetic", {"scale": 0.3}),
    ("merge", "task_arithmetic", {}),  # the registry default scale (0.3) is used
    ("merge", "weight_average", {"scale": 0.7}),
    ("average", None, {"scale": 1.0}),
    ("average", None, {"scale": 0.5}),
]


@pytest.mark.parametrize("action,method,params", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(37, 29), (1000,), (3, 5, 7)])
def test_chunked_linear_merge_equals_the_stacked_route(action, method, params, dtype, shape, monkeypatch):
    monkeypatch.setattr(compute, "CHUNK_ELEMENTS", 64)  # many chunks and a ragged last one
    g = torch.Generator().manual_seed(0)
    base = torch.randn(shape, generator=g).to(dtype)
    experts = [(base.float() + 1e-2 * torch.randn(shape, generator=g)).to(dtype) for _ in range(4)]
    entry = plan(action, method, params, shape, dtype)
    merged, diagnostics = compute.merge_tensor(
        entry, base, [Dense(e) for e in experts], device=torch.device("cpu"), compute_dtype=torch.float32
    )
    stack = torch.stack([e.float() - base.float() for e in experts])
    if action == "average":
        delta = params["scale"] * stack.mean(0)
        assert diagnostics == {"route": "linear"}
    else:
        result = get_method(method)(stack, **params)
        delta = result.delta
        assert diagnostics["n_experts"] == 4 and diagnostics["route"] == "linear"
        assert diagnostics["delta_norm"] == pytest.approx(result.diagnostics["delta_norm"], rel=1e-5)
    expected = (base.float() + delta).to(dtype)
    assert merged.dtype == dtype and merged.shape == base.shape
    # equal up to the last bit of the output dtype (float32 sums in another order)
    ulp = torch.finfo(dtype).eps * expected.float().abs().clamp(min=1e-3)
    assert bool(((merged.float() - expected.float()).abs() <= ulp).all())


def test_other_methods_and_low_rank_items_keep_the_generic_route():
    base = torch.zeros(4, 4)
    ties = plan("merge", "ties", {"density": 0.2, "scale": 1.0}, (4, 4), torch.float32)
    assert compute.linear_coefficient(ties, 2) is None
    ta = plan("merge", "task_arithmetic", {"scale": 0.3}, (4, 4), torch.float32)
    assert compute.linear_coefficient(ta, 2) == (0.3, 0.3) and compute.linear_coefficient(ta, 0) is None
    wa = plan("merge", "weight_average", {"scale": 1.0}, (4, 4), torch.float32)
    assert compute.linear_coefficient(wa, 4) == (0.25,) * 4
    merged, diagnostics = compute.merge_tensor(
        ta, base, [Dense(torch.ones(4, 4)), Zero((4, 4))], device=torch.device("cpu"), compute_dtype=torch.float32
    )  # an adapter that leaves this tensor alone: the generic route
    assert torch.allclose(merged, torch.full((4, 4), 0.3)) and diagnostics["route"] == "dense"
