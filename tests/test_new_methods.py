"""The methods mergekit users reach for (issue 16), against values computed by hand: linear, slerp, model_stock,
della / della_linear, dare_linear, and per-expert weights in the sparsifying methods."""

from __future__ import annotations

import math

import pytest
import torch

from specmerge.methods import get_method
from specmerge.methods.della import keep_probabilities, magprune
from specmerge.methods.interpolation import slerp_coefficients

D = torch.float64
STACK = torch.tensor([[1.0, -2.0], [3.0, 1.0]], dtype=D)  # two experts, two entries


def test_linear_weighted_average_and_sum():
    linear = get_method("linear")
    # (1 * [1, -2] + 3 * [3, 1]) / 4 = [10, 1] / 4
    torch.testing.assert_close(linear(STACK, weights=[1.0, 3.0]).delta, torch.tensor([2.5, 0.25], dtype=D))
    torch.testing.assert_close(
        linear(STACK, weights=[1.0, 3.0], normalize=False).delta, torch.tensor([10.0, 1.0], dtype=D)
    )
    torch.testing.assert_close(linear(STACK).delta, torch.tensor([2.0, -0.5], dtype=D))  # no weights: the mean
    with pytest.raises(ValueError, match="sum to 0"):
        linear(STACK, weights=[1.0, -1.0])
    # negative weights are allowed where nothing divides by their sum (task negation)
    torch.testing.assert_close(
        linear(STACK, weights=[1.0, -1.0], normalize=False).delta, torch.tensor([-2.0, -3.0], dtype=D)
    )
    # DARE's normalize divides its weighted sum the same way, and says which setting to change
    dare = get_method("dare_task_arithmetic")
    with pytest.raises(ValueError, match=r"^normalize: true divides .* \[1.0, -1.0\] sum to 0: .* normalize: false$"):
        dare(STACK, weights=[1.0, -1.0], normalize=True, drop_rate=0.0)


def test_slerp_on_a_quarter_circle():
    base = torch.tensor([1.0, 0.0], dtype=D)
    expert = torch.tensor([0.0, 1.0], dtype=D)
    slerp = get_method("slerp")
    half = math.sqrt(0.5)  # theta = pi / 2: a = b = sin(pi / 4) at t = 1/2
    merged = base + slerp((expert - base)[None], base=base, t=0.5).delta
    torch.testing.assert_close(merged, torch.tensor([half, half], dtype=D))
    merged = base + slerp((expert - base)[None], base=base, t=1 / 3).delta  # a = sin(pi/3), b = sin(pi/6)
    torch.testing.assert_close(merged, torch.tensor([math.sqrt(3) / 2, 0.5], dtype=D))
    for t in (0.0, 1.0):  # the ends are the two models
        torch.testing.assert_close(base + slerp((expert - base)[None], base=base, t=t).delta, expert if t else base)
    # the angle comes from the directions; the norms scale the ends: |base| = 2, |expert| = 1
    big = 2 * base
    merged = big + slerp((expert - big)[None], base=big, t=0.5).delta
    torch.testing.assert_close(merged, torch.tensor([2 * half, half], dtype=D))


def test_slerp_of_collinear_weights_is_linear():
    base = torch.tensor([1.0, 2.0, 3.0], dtype=D)
    assert slerp_coefficients(base, 2 * base, 0.25) == (0.75, 0.25)
    assert slerp_coefficients(base, -base, 0.25) == (0.75, 0.25)  # opposite: no unique arc, linear too
    merged = base + get_method("slerp")(base[None], base=base, t=0.25).delta  # expert = 2 base
    torch.testing.assert_close(merged, 1.25 * base)


def test_slerp_takes_one_expert_and_the_base():
    with pytest.raises(ValueError, match="one expert, but 2 experts"):
        get_method("slerp")(STACK, base=torch.zeros(2, dtype=D))
    with pytest.raises(ValueError, match="pass the base tensor"):
        get_method("slerp")(STACK[:1])


def test_model_stock_golden():
    stock = get_method("model_stock")
    tau = torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=D)  # cos = 1 / sqrt 2
    c = 1 / math.sqrt(2)
    t = 2 * c / (1 + c)  # N cos / (1 + (N - 1) cos), N = 2: 2 (sqrt 2 - 1)
    assert t == pytest.approx(2 * (math.sqrt(2) - 1))
    result = stock(tau)
    torch.testing.assert_close(result.delta, t * torch.tensor([1.0, 0.5], dtype=D))
    assert result.diagnostics["model_stock_t"] == pytest.approx(t)
    orthogonal = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=D)  # cos 0: t = 0, the base
    torch.testing.assert_close(stock(orthogonal).delta, torch.zeros(2, dtype=D))
    same = torch.tensor([[1.0, 2.0], [2.0, 4.0], [3.0, 6.0]], dtype=D)  # cos 1: t = 1, the average
    torch.testing.assert_close(stock(same).delta, same.mean(0))
    # three experts: the mean of the three pairwise cosines (1/sqrt2, 0, 1/sqrt2)
    three = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]], dtype=D)
    c3 = (2 * c) / 3
    t3 = 3 * c3 / (1 + 2 * c3)
    torch.testing.assert_close(stock(three).delta, t3 * three.mean(0))
    with pytest.raises(ValueError, match="at least two experts"):
        stock(tau[:1])


def test_model_stock_filter_wise_takes_one_angle_per_row():
    tau = torch.tensor([[[1.0, 0.0], [1.0, 2.0]], [[1.0, 1.0], [1.0, 2.0]]], dtype=D)  # row 0 as above; row 1 same
    c = 1 / math.sqrt(2)
    expected = torch.stack([2 * c / (1 + c) * tau[:, 0].mean(0), tau[:, 1].mean(0)])
    torch.testing.assert_close(get_method("model_stock")(tau, filter_wise=True).delta, expected)


def test_della_keep_probabilities_follow_the_magnitude_rank_in_each_row():
    tau = torch.tensor([[0.1, -3.0, 2.0, 0.5], [4.0, 0.0, -1.0, 2.0]], dtype=D)
    # ranks 0..3 by |.|, u = rank / 3, p = 0.5 - 0.15 + 0.3 u
    expected = torch.tensor([[0.35, 0.65, 0.55, 0.45], [0.65, 0.35, 0.45, 0.55]])  # float32, as computed
    torch.testing.assert_close(keep_probabilities(tau, 0.5, 0.15), expected)
    equal = torch.ones(1, 3, dtype=D)  # equal magnitudes rank in storage order
    torch.testing.assert_close(keep_probabilities(equal, 0.5, 0.1), torch.tensor([[0.4, 0.5, 0.6]]))
    torch.testing.assert_close(keep_probabilities(torch.ones(1), 0.5, 0.1), torch.tensor([0.5]))


def test_magprune_keeps_entries_divided_by_their_probability_and_is_seeded():
    g = torch.Generator().manual_seed(0)
    tau = torch.randn(2, 200, 500, generator=g, dtype=D)
    pruned = magprune(tau, 0.5, 0.15, seed=3, tensor_name="w")
    kept = pruned != 0
    p = torch.stack([keep_probabilities(t, 0.5, 0.15) for t in tau])
    torch.testing.assert_close(pruned[kept], (tau / p)[kept], rtol=0, atol=0)
    # 200 000 entries kept with mean probability 0.5: the kept fraction is within 6 standard deviations (0.0067)
    assert abs(float(kept.double().mean()) - 0.5) < 6 * math.sqrt(0.25 / kept.numel())
    # large entries are kept more often: the top fifth of each row near 0.62, the bottom fifth near 0.38
    order = tau.abs().argsort(dim=2)
    top, bottom = kept.gather(2, order[..., -100:]).double().mean(), kept.gather(2, order[..., :100]).double().mean()
    assert 0.59 < float(top) < 0.65 and 0.35 < float(bottom) < 0.41
    torch.testing.assert_close(magprune(tau, 0.5, 0.15, seed=3, tensor_name="w"), pruned, rtol=0, atol=0)
    assert not torch.equal(magprune(tau, 0.5, 0.15, seed=4, tensor_name="w"), pruned)
    # epsilon 0: every probability is the density (no ranks); density 1 as well: nothing dropped
    flat = magprune(tau, 0.4, 0.0, seed=3, tensor_name="w")
    kept = flat != 0
    torch.testing.assert_close(
        flat[kept], (tau / torch.tensor(0.4, dtype=torch.float32).double())[kept], rtol=0, atol=0
    )
    assert abs(float(kept.double().mean()) - 0.4) < 6 * math.sqrt(0.24 / kept.numel())
    assert torch.equal(magprune(tau, 1.0, 0.0, seed=3, tensor_name="w"), tau)


def test_della_without_dropping_is_ties_without_trim_and_della_linear_the_sum():
    # density 1, epsilon 0: every keep probability 1. Signs of [4, -1]: entry 0 mean(1, 3), entry 1 only -2 agrees.
    torch.testing.assert_close(
        get_method("della")(STACK, density=1.0, epsilon=0.0).delta, torch.tensor([2.0, -2.0], dtype=D)
    )
    torch.testing.assert_close(
        get_method("della_linear")(STACK, density=1.0, epsilon=0.0, scale=0.5).delta,
        torch.tensor([2.0, -0.5], dtype=D),
    )
    get_method("della").validate({"density": 0.5, "epsilon": 0.3})  # 0.2 .. 0.8: fine
    with pytest.raises(ValueError, match=r"method 'della': keep probabilities density -/\+ epsilon = 0 .. 1 must"):
        get_method("della").validate({"density": 0.5, "epsilon": 0.5})
    with pytest.raises(ValueError, match="must lie in"):
        get_method("della_linear").validate({"density": 0.9, "epsilon": 0.2})


def test_dare_linear_is_dare_task_arithmetic_at_lambda_one():
    torch.testing.assert_close(
        get_method("dare_linear")(STACK, drop_rate=0.0).delta, torch.tensor([4.0, -1.0], dtype=D)
    )
    g = torch.Generator().manual_seed(1)
    tau = torch.randn(3, 20, 10, generator=g)
    same = get_method("dare_task_arithmetic")(tau, drop_rate=0.3, scale=1.0, tensor_name="x").delta
    torch.testing.assert_close(get_method("dare_linear")(tau, drop_rate=0.3, tensor_name="x").delta, same)


def test_weighted_ties_elects_from_the_weighted_sum_and_takes_the_weighted_mean():
    # weights 1, 3: sums [1 + 9, -2 + 3] = [10, 1], both +; entry 0 (1 + 9) / 4, entry 1 only expert 2: 3 / 3
    ties = get_method("ties")
    torch.testing.assert_close(ties(STACK, density=1.0, weights=[1.0, 3.0]).delta, torch.tensor([2.5, 1.0], dtype=D))
    torch.testing.assert_close(ties(STACK, density=1.0).delta, torch.tensor([2.0, -2.0], dtype=D))
    with pytest.raises(ValueError, match="must be finite and > 0"):
        ties(STACK, weights=[1.0, -1.0])
    dare_ties = get_method("dare_ties")
    torch.testing.assert_close(
        dare_ties(STACK, drop_rate=0.0, weights=[1.0, 3.0]).delta, torch.tensor([2.5, 1.0], dtype=D)
    )
    torch.testing.assert_close(  # 0.3 * (1 * [1, -2] + 3 * [3, 1])
        get_method("dare_task_arithmetic")(STACK, drop_rate=0.0, weights=[1.0, 3.0]).delta,
        0.3 * torch.tensor([10.0, 1.0], dtype=D),
    )


def test_weighted_breadcrumbs_and_task_arithmetic():
    tau = torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]], dtype=D)
    # beta 0.25 drops the largest (1 entry), density 0.5 keeps the next 2: [0, 2, 3, 0] and [0, 3, 2, 0]
    band = get_method("breadcrumbs")(tau, density=0.5, beta=0.25, scale=1.0, weights=[2.0, -1.0]).delta
    torch.testing.assert_close(band, torch.tensor([0.0, 1.0, 4.0, 0.0], dtype=D))
    ta = get_method("task_arithmetic")(tau, scale=0.5, weights=[2.0, -1.0]).delta
    torch.testing.assert_close(ta, 0.5 * torch.tensor([-2.0, 1.0, 4.0, 7.0], dtype=D))


def test_methods_without_weights_refuse_them():
    for name in ("swudi_a", "tsv_m", "model_stock", "slerp"):
        with pytest.raises(ValueError, match="does not define per-expert weights"):
            get_method(name).check_weights([0.5, 1.0])
    get_method("swudi_a").check_weights([1.0, 1.0])  # weights of 1 are no weights


def test_inspect_refuses_whole_weight_methods_and_too_few_experts_up_front():
    from specmerge.diagnostics.method_specs import parse_method_spec

    with pytest.raises(ValueError, match="method 'slerp' merges whole weights"):
        parse_method_spec("slerp:t=0.3", 1)
    with pytest.raises(ValueError, match="model_stock': it needs at least two experts"):
        parse_method_spec("model_stock", 1)
    assert parse_method_spec("model_stock", 2).name == "model_stock"
