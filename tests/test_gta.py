"""mergekit's convention of the task-arithmetic family (specmerge.methods.gta), worked out on small cases, and the
options it brought to specmerge's own methods: a density per expert, normalize (sum or mean), rescale."""

from __future__ import annotations

import pytest
import torch

import specmerge
from specmerge.methods import gta

D64 = torch.float64


def test_the_magnitude_trim_keeps_floor_of_density_n_at_least_one():
    tau = torch.tensor([0.1, -0.5, 0.3, 0.05, -0.2], dtype=D64)
    assert torch.equal(gta.magnitude(tau, 0.5, False), torch.tensor([0, -0.5, 0.3, 0, 0], dtype=D64))  # floor(2.5)
    assert torch.equal(gta.magnitude(tau, 0.01, False), torch.tensor([0, -0.5, 0, 0, 0], dtype=D64))  # at least 1
    assert torch.equal(gta.magnitude(tau, 1.0, False), tau) and not gta.magnitude(tau, 0.0, False).any()
    kept = gta.magnitude(tau, 0.5, True)  # scaled back to tau's L1 norm
    torch.testing.assert_close(kept.abs().sum(), tau.abs().sum())
    assert torch.equal(kept != 0, gta.magnitude(tau, 0.5, False) != 0)


def test_the_band_keeps_floor_density_n_below_the_floor_gamma_n_largest():
    tau = torch.arange(1, 11, dtype=D64)  # magnitudes 1..10
    assert gta.band(tau, 0.5, 0.2, False).nonzero().flatten().tolist() == [3, 4, 5, 6, 7]  # 8, 9, 10 outliers: 2
    # density + gamma over 1: fewer outliers dropped (mergekit), not fewer kept
    assert gta.band(tau, 0.9, 0.2, False).nonzero().flatten().tolist() == list(range(9))
    assert torch.equal(gta.band(tau, 1.0, 0.2, False), tau)  # density 1: every entry, outliers too


def test_the_election_is_plus_where_the_weighted_sum_is_zero_and_weights_come_first():
    sparse = torch.tensor([[1.0, 2.0, -1.0], [-1.0, -1.0, 3.0]], dtype=D64)
    # entry 0: the sum is 0, + is elected, expert 0 agrees; entry 1: + (2 - 1); entry 2: + (-1 + 3)
    merged = gta.combine(sparse, (1.0, 1.0), elect=True, normalize=False, scale=1.0)
    assert merged.tolist() == [1.0, 2.0, 3.0]
    # weights scale the task vectors before the election: with w = (3, 1) entry 2's weighted sum is -3 + 3 = 0, so
    # + is elected and only expert 1 agrees; normalize divides by the agreeing weights
    weighted = gta.combine(sparse, (3.0, 1.0), elect=True, normalize=True, scale=2.0)
    assert weighted.tolist() == [2.0, 4.0, 6.0]  # (3 / 3, 6 / 3, 3 / 1) times lambda 2
    plain = gta.combine(sparse, (0.5, 0.5), elect=False, normalize=True, scale=1.0)  # sum / sum w
    torch.testing.assert_close(plain, sparse.sum(0) * 0.5 / 1.0)
    tiny = gta.combine(sparse, (1e-9, -1e-9), elect=False, normalize=True, scale=1.0)  # |sum w| < 1e-8: divide by 1
    torch.testing.assert_close(tiny, 1e-9 * sparse[0] - 1e-9 * sparse[1])


def test_della_keep_probabilities_rise_with_the_rank_in_each_row():
    tau = torch.tensor([[0.1, -0.3, 0.2], [5.0, 1.0, -3.0]], dtype=D64)
    p = gta.della_probabilities(tau, 0.5, 0.1)
    torch.testing.assert_close(p, torch.tensor([[0.4, 0.6, 0.5], [0.6, 0.4, 0.5]]))
    assert gta.della_probabilities(torch.ones(4, 1), 0.5, 0.1).eq(0.5).all()  # a row of one entry: the density


def test_mergekit_convention_on_the_registered_methods():
    torch.manual_seed(0)
    tau = torch.randn(3, 40, 30, dtype=D64)
    ties = specmerge.get_method("ties")
    ours = ties(tau, density=(0.5, 0.3, 0.7), convention="mergekit", weights=(0.5, 0.3, 0.2)).delta
    how = gta.Sparsify("magnitude", (0.5, 0.3, 0.7))
    expected = gta.merge(tau, how, weights=(0.5, 0.3, 0.2), elect=True, normalize=True, scale=1.0)
    assert torch.equal(ours, expected)
    assert (ours != 0).float().mean() > 0.5  # three trims at 30-70 %: most entries kept by someone
    with pytest.raises(ValueError, match=r"rescale .* is mergekit's: set convention: mergekit"):
        ties(tau, rescale=True)
    with pytest.raises(ValueError, match="has 2 values, one per expert, for 3 experts"):
        ties(tau, density=(0.5, 0.3))
    with pytest.raises(ValueError, match=r"parameter 'density' .* \(value 1 of the values per expert\)"):
        ties(tau, density=(0.5, 1.5, 0.2))


def test_paper_convention_takes_a_density_per_expert_and_normalize():
    torch.manual_seed(1)
    tau = torch.randn(2, 10, 10, dtype=D64)
    ties = specmerge.get_method("ties")
    one = [ties(tau[i : i + 1], density=d).delta for i, d in enumerate((0.2, 0.6))]
    assert [int(r.ne(0).sum()) for r in one] == [20, 60]
    both = ties(tau, density=(0.2, 0.6), normalize=False).delta  # the disjoint sum of the two trims
    sign = torch.sign(one[0] + one[1])
    expected = sum(torch.where(r * sign > 0, r, 0) for r in one)
    torch.testing.assert_close(both, expected)
    mean = ties(tau, density=(0.2, 0.6)).delta
    agree = sum(((r * sign) > 0).to(D64) for r in one)
    torch.testing.assert_close(mean, expected / torch.where(agree > 0, agree, 1))


def test_dare_and_della_take_rescale_and_a_rate_per_expert():
    torch.manual_seed(2)
    tau = torch.randn(2, 50, 40, dtype=D64)
    dare = specmerge.get_method("dare_linear")
    kept = dare(tau, drop_rate=(0.0, 0.5), rescale=False, tensor_name="w").delta
    plain = dare(tau, drop_rate=(0.0, 0.5), tensor_name="w").delta
    dropped = kept - tau[0]  # expert 0 keeps everything; expert 1 about half, unscaled
    assert 0.4 < float((dropped != 0).to(D64).mean()) < 0.6
    torch.testing.assert_close(plain - tau[0], 2 * dropped)  # rescale: the kept entries divided by 1 - p
    della = specmerge.get_method("della")
    with pytest.raises(ValueError, match=r"must lie in \(0, 1\)"):  # mergekit's bound is open
        della(tau, density=0.9, epsilon=0.1, convention="mergekit", tensor_name="w")
    della(tau, density=1.0, epsilon=0.15, convention="mergekit", tensor_name="w")  # density 1 drops nothing
    with pytest.raises(ValueError, match=r"must lie in \(0, 1\]"):
        della(tau, density=(0.5, 0.95), epsilon=0.1, tensor_name="w")


def test_linear_base_weight_and_karcher_include_base():
    torch.manual_seed(3)
    tau = torch.randn(2, 6, 5, dtype=D64)
    linear = specmerge.get_method("linear")
    got = linear(tau, weights=(0.5, 0.3), base_weight=0.2).delta  # (0.2 W0 + 0.5 W1 + 0.3 W2) / 1.0 - W0
    torch.testing.assert_close(got, 0.5 * tau[0] + 0.3 * tau[1])
    with pytest.raises(ValueError, match="base_weight weighs the base"):
        linear(tau, normalize=False, base_weight=0.5)
    karcher = specmerge.get_method("karcher")
    base = torch.randn(6, 5, dtype=D64)
    with_base = karcher(tau, base=base, include_base=True).delta
    three = karcher(torch.cat([torch.zeros_like(tau[:1]), tau]), base=base).delta
    torch.testing.assert_close(with_base, three)
    assert not torch.allclose(with_base, karcher(tau, base=base).delta)
