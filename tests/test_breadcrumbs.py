"""Model Breadcrumbs: the magnitude band on hand examples, deterministic ties, and its limits."""

import pytest
import torch

from specmerge import get_method
from specmerge.cli import main
from specmerge.methods import candidate_settings
from specmerge.methods.breadcrumbs import breadcrumbs
from specmerge.methods.linear import task_arithmetic

D64 = torch.float64

# Two experts of 10 entries. beta = 0.1 drops m = floor(1.0) = 1 largest magnitude, density = 0.5 keeps the next
# k = ceil(5.0) = 5, and the 4 smallest go.
TAU = torch.tensor(
    [
        [0.1, -5.0, 2.0, -0.3, 4.0, 1.0, -0.2, 3.0, 0.05, -1.5],  # drops -5; keeps 4, 3, 2, -1.5, 1
        [-0.5, 0.25, 6.0, -2.5, 0.75, -1.0, 3.5, -0.1, 2.0, 0.2],  # drops 6; keeps 3.5, -2.5, 2, -1, 0.75
    ],
    dtype=D64,
)
BAND = torch.tensor(
    [
        [0.0, 0.0, 2.0, 0.0, 4.0, 1.0, 0.0, 3.0, 0.0, -1.5],
        [0.0, 0.0, 0.0, -2.5, 0.75, -1.0, 3.5, 0.0, 2.0, 0.0],
    ],
    dtype=D64,
)


def test_band_on_a_hand_example():
    result = breadcrumbs(TAU, density=0.5, beta=0.1, scale=1.0)
    torch.testing.assert_close(result.delta, BAND.sum(dim=0), rtol=0, atol=0)
    assert result.diagnostics == {
        "n_experts": 2,
        "kept_per_expert": 5,
        "dropped_largest": 1,
        "delta_norm": pytest.approx(float(BAND.sum(dim=0).norm())),
    }
    torch.testing.assert_close(breadcrumbs(TAU, density=0.5, beta=0.1).delta, 0.3 * BAND.sum(dim=0), rtol=0, atol=0)
    for i in range(2):  # per expert: one expert alone gives its own band
        torch.testing.assert_close(breadcrumbs(TAU[i : i + 1], density=0.5, beta=0.1, scale=1.0).delta, BAND[i])


def test_ties_at_both_edges_go_in_storage_order():
    # beta = 0.25: m = 2 of the three |2| (positions 0, 1, 7) are dropped, the first two; density = 0.5: k = 4 are
    # kept, the remaining |2| (position 7) and the first three of the four |1| (positions 2, 3, 4, not 5).
    values = torch.tensor([2.0, -2.0, 1.0, 1.0, -1.0, 1.0, 0.5, 2.0])
    expected = torch.tensor([0.0, 0.0, 1.0, 1.0, -1.0, 0.0, 0.0, 2.0])
    for dtype in (torch.float32, D64, torch.float16):
        delta = breadcrumbs(values[None].to(dtype), density=0.5, beta=0.25, scale=1.0).delta
        assert delta.tolist() == expected.tolist(), dtype
    # the same band whatever else is in the stack, and on every call
    other = torch.randn(3, 8)
    stacked = breadcrumbs(torch.cat([values[None], other]), density=0.5, beta=0.25, scale=1.0).delta
    alone = breadcrumbs(other, density=0.5, beta=0.25, scale=1.0).delta
    torch.testing.assert_close(stacked - alone, expected)


def test_density_one_and_beta_zero_is_task_arithmetic():
    tau = torch.randn(4, 7, 5, dtype=torch.float32)
    for scale in (0.3, 1.0, -0.7):
        full = breadcrumbs(tau, density=1.0, beta=0.0, scale=scale).delta
        assert torch.equal(full, task_arithmetic(tau, scale=scale).delta)


def test_band_reaching_the_smallest_entries_keeps_all_but_the_largest():
    # density + beta > 1: k = min(ceil(density numel), numel - m), so only the m largest go
    result = breadcrumbs(TAU, density=1.0, beta=0.1, scale=1.0)
    top = TAU.abs() == TAU.abs().amax(dim=1, keepdim=True)
    torch.testing.assert_close(result.delta, torch.where(top, 0.0, TAU).sum(dim=0), rtol=0, atol=0)
    assert result.diagnostics["kept_per_expert"] == 9


def test_any_shape_no_mutation_and_empty_tensors():
    tau = torch.randn(3, 4, 5, 6)
    copy = tau.clone()
    assert breadcrumbs(tau).delta.shape == (4, 5, 6)
    assert torch.equal(tau, copy)
    assert breadcrumbs(torch.randn(2, 7)).delta.shape == (7,)
    assert breadcrumbs(torch.zeros(2, 0)).delta.shape == (0,)


def test_bounds_come_from_the_annotations():
    for params, name in (({"density": 0.0}, "density"), ({"density": 1.5}, "density"), ({"beta": 1.0}, "beta")):
        with pytest.raises(ValueError, match=f"parameter '{name}'"):
            breadcrumbs(TAU, **params)
    method = get_method("breadcrumbs")
    assert [(p.name, p.default) for p in method.params][:3] == [("density", 0.9), ("beta", 0.01), ("scale", 0.3)]
    more = [("normalize", False), ("rescale", False), ("convention", "paper")]
    assert [(p.name, p.default) for p in method.params][3:] == more
    assert method.param("beta").type_name == "float >=0 <1 (or one per expert)"


def test_registered_once_and_listed_everywhere(capsys):
    method = get_method("breadcrumbs")
    assert method is breadcrumbs
    assert not method.needs_matrix and not method.linear and not method.factored and not method.seeded
    assert method.featured and method.variant_of is None
    assert ("breadcrumbs", "Model Breadcrumbs") in [(s.label, s.title) for m, s in candidate_settings()]
    assert main(["methods", "breadcrumbs"]) == 0
    out = capsys.readouterr().out
    assert "Davari & Belilovsky" in out and "beta: float >=0 <1 (or one per expert) = 0.01" in out
