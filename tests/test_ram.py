"""mergekit's RAM and RAM+ (tensor-local) methods, on entries worked out by hand."""

from __future__ import annotations

import pytest
import torch

import specmerge

D64 = torch.float64


def test_ram_keeps_a_lone_change_and_averages_shared_ones():
    tau = torch.tensor([[0.5, 0.2, 0.0, 1e-7], [0.0, 0.4, 0.0, 0.3], [0.0, 0.0, 0.0, 0.0]], dtype=D64)
    merged = specmerge.get_method("ram")(tau, epsilon=1e-5).delta
    # entry 0: expert 0 alone; 1: the mean of 0.2 and 0.4; 2: nobody; 3: expert 1 alone (1e-7 does not contribute)
    torch.testing.assert_close(merged, torch.tensor([0.5, 0.3, 0.0, 0.3], dtype=D64))
    task_arithmetic_mean = tau.mean(dim=0)
    assert not torch.allclose(merged, task_arithmetic_mean)


def test_ramplus_scales_each_experts_unique_entries_by_its_overlap():
    tau = torch.tensor([[0.5, 0.2, 0.1, 0.0], [0.0, 0.4, 0.3, 0.6]], dtype=D64)
    result = specmerge.get_method("ramplus_tl")(tau, r=0.5, alpha=10.0, epsilon=1e-5)
    # expert 0: 2 shared, 1 unique: rho 2, scale 1 + 0.5 * 2 = 2; expert 1 the same
    assert result.diagnostics["unique_scale"] == [2.0, 2.0]
    torch.testing.assert_close(result.delta, torch.tensor([1.0, 0.3, 0.2, 1.2], dtype=D64))
    capped = specmerge.get_method("ramplus_tl")(tau, r=0.5, alpha=0.2, epsilon=1e-5)
    assert capped.diagnostics["unique_scale"] == pytest.approx([1.1, 1.1], rel=1e-6)  # rho capped at alpha (float32)
    with pytest.raises(ValueError, match="parameter 'r'"):
        specmerge.get_method("ramplus_tl")(tau, r=-1.0)
