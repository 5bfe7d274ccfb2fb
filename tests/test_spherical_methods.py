"""Multi-SLERP, the Karcher mean and NearSwap (issue 51: mergekit's remaining methods): their definitions worked
out on small cases, and their edges. Agreement with mergekit's own outputs: tests/test_mergekit_corpus.py."""

from __future__ import annotations

import math

import pytest
import torch

from specmerge.methods import get_method

EPS32 = torch.finfo(torch.float32).eps


def test_multislerp_of_two_unit_vectors_is_the_point_between_them_on_the_arc():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    delta = get_method("multislerp")(torch.stack([a, b]), base=torch.zeros_like(a)).delta
    # one tangent step from the normalized mean (1, 1)/sqrt 2: the tangent parts cancel, the mean of lengths is 1
    torch.testing.assert_close(delta, torch.tensor([1.0, 1.0]) / math.sqrt(2), rtol=0, atol=4 * EPS32)
    weighted = get_method("multislerp")(torch.stack([2 * a, b]), weights=[3.0, 1.0], base=torch.zeros_like(a)).delta
    assert float(torch.linalg.vector_norm(weighted)) == pytest.approx(0.75 * 2 + 0.25 * 1, rel=1e-6)  # mean length
    assert weighted[0] > weighted[1] > 0  # nearer the heavier expert


def test_multislerp_of_opposite_experts_is_linear_for_two_and_refused_for_more():
    a = torch.tensor([1.0, 2.0, -1.0])
    two = get_method("multislerp")(torch.stack([a, -a]), base=torch.zeros_like(a)).delta
    torch.testing.assert_close(two, torch.zeros(3))  # the linear fallback: 0.5 a - 0.5 a
    with pytest.raises(ValueError, match="cancel out"):
        get_method("multislerp")(torch.stack([a, -a, a, -a]), base=torch.zeros_like(a))


def test_the_karcher_mean_of_experts_on_one_great_circle_is_their_mean_angle():
    base = torch.zeros(2)
    angles = [0.0, 0.4, 1.0]
    points = torch.stack([torch.tensor([math.cos(x), math.sin(x)]) * (1 + k) for k, x in enumerate(angles)])
    result = get_method("karcher")(points, base=base)
    merged = result.delta + base
    assert math.atan2(float(merged[1]), float(merged[0])) == pytest.approx(sum(angles) / 3, abs=1e-5)
    assert float(torch.linalg.vector_norm(merged)) == pytest.approx(2.0, rel=1e-6)  # the mean of the lengths 1, 2, 3
    assert result.diagnostics["karcher_steps"] >= 1


def test_karcher_is_of_the_experts_weights_not_their_task_vectors():
    base = torch.tensor([10.0, 0.0])
    taus = torch.stack([torch.tensor([0.0, 1.0]), torch.tensor([0.0, -1.0])])
    merged = get_method("karcher")(taus, base=base).delta + base  # W_i = (10, 1), (10, -1): the mean is on the axis
    torch.testing.assert_close(merged, torch.tensor([math.hypot(10, 1), 0.0]), rtol=1e-6, atol=1e-6)


def test_nearswap_takes_the_expert_within_t_and_moves_part_way_beyond():
    tau = torch.tensor([[0.0005, -0.002, 0.01, 0.0]])
    delta = get_method("nearswap")(tau, t=0.001).delta
    torch.testing.assert_close(delta, torch.tensor([0.0005, -0.001, 0.001, 0.0]), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="give one"):
        get_method("nearswap").validate({"t": 0.1}, 2)


def test_sce_selects_by_variance_weighs_by_energy_and_erases_disagreeing_signs():
    taus = torch.tensor([[1.0, 2.0, 0.0, -1.0], [1.0, -2.0, 0.5, -3.0]])
    # variance per entry: 0, 4, 1/16, 1 -> select_topk 0.5 keeps floor(0.5 * 3) = 1 of the 3 varying ones: entry 1
    selected = get_method("sce")(taus, select_topk=0.5)
    weights = torch.tensor([4.0, 4.0]) / 4  # mean squares of the selected vectors, (0, 2, 0, 0) and (0, -2, 0, 0)
    w = weights / weights.sum()
    # entry 1 sums to 0: + is elected, only expert 0 agrees: 2 w_0 / w_0 = 2
    torch.testing.assert_close(selected.delta, torch.tensor([0.0, 2.0, 0.0, 0.0]))
    assert selected.diagnostics["sce_weights"] == pytest.approx(w.tolist())
    full = get_method("sce")(taus).delta
    energy = taus.square().mean(dim=1)
    w = energy / energy.sum()
    expected = torch.tensor([1.0, (2.0 * w[0]) / w[0], 0.5, (-w[0] - 3 * w[1]) / (w[0] + w[1])])
    torch.testing.assert_close(full, expected)  # entry 2: only expert 1 is non-zero, so only it agrees


def test_nuslerp_of_two_orthogonal_task_vectors_follows_the_arc_at_the_weights_ratio():
    a, b = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 2.0])
    delta = get_method("nuslerp")(
        torch.stack([a, b]), weights=[3.0, 1.0], base=torch.zeros_like(a)
    ).delta  # t = 1/4 of the way to b
    angle = math.pi / 2 / 4
    torch.testing.assert_close(delta, 2 * torch.tensor([math.cos(angle), math.sin(angle)]), rtol=1e-6, atol=1e-6)
    collinear = get_method("nuslerp")(
        torch.stack([a, 3 * a]), base=torch.zeros_like(a)
    ).delta  # linear where they are collinear
    torch.testing.assert_close(collinear, 2 * a)
    rows = torch.stack([torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[0.0, 1.0], [1.0, 0.0]])])
    per_row = get_method("nuslerp")(
        rows, flatten=False, base=torch.zeros_like(rows[0])
    ).delta  # each row on its own arc
    torch.testing.assert_close(per_row, torch.full((2, 2), math.sqrt(0.5)), rtol=1e-6, atol=1e-6)


def test_arcee_fusion_takes_the_expert_only_where_importance_is_an_outlier():
    base = torch.zeros(1, 16)
    tau = torch.zeros(1, 1, 16)
    tau[0, 0, :15] = torch.linspace(1e-4, 1e-3, 15)  # small moves, spread: quartiles apart
    tau[0, 0, 15] = 2.0  # one entry moves far: its importance is the outlier
    result = get_method("arcee_fusion")(tau, base=base)
    expected = torch.zeros(1, 16)
    expected[0, 15] = 2.0
    torch.testing.assert_close(result.delta, expected)
    assert result.diagnostics["fused_fraction"] == pytest.approx(1 / 16)


def test_base_free_spherical_means_take_the_models_own_weights():
    """mergekit's multislerp / nuslerp without a base_model: the points are W_0, W_1, ... themselves, the base's
    weight among them; the result is the same whichever model stands as the base."""
    torch.manual_seed(5)
    w0, w1, w2 = (torch.randn(6, 4, dtype=torch.float64) for _ in range(3))
    multislerp = get_method("multislerp")
    merged = w0 + multislerp(torch.stack([w1 - w0, w2 - w0]), base=w0, base_free=True, base_weight=0.5,
                             weights=[0.3, 0.2]).delta  # fmt: skip
    swapped = w1 + multislerp(torch.stack([w0 - w1, w2 - w1]), base=w1, base_free=True, base_weight=0.3,
                              weights=[0.5, 0.2]).delta  # fmt: skip
    torch.testing.assert_close(merged, swapped)
    direct = multislerp(torch.stack([w0, w1, w2]), base=torch.zeros_like(w0), weights=[0.5, 0.3, 0.2]).delta
    torch.testing.assert_close(merged, direct)  # the barycentre of the weights, with the origin at 0
    nuslerp = get_method("nuslerp")
    pair = w0 + nuslerp((w1 - w0).unsqueeze(0), base=w0, base_free=True, base_weight=0.25, weights=[0.75]).delta
    torch.testing.assert_close(
        pair, nuslerp(torch.stack([w0, w1]), base=torch.zeros_like(w0), weights=[0.25, 0.75]).delta
    )
    with pytest.raises(ValueError, match="give 1"):
        nuslerp(torch.stack([w1 - w0, w2 - w0]), base=w0, base_free=True)
