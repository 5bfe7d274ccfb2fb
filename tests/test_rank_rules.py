"""Rank rules: psqrt, participation, exact Gavish-Donoho with the Marchenko-Pastur median."""

import math

import numpy as np
import pytest
import torch
from scipy import integrate

from specmerge.linalg.rank_rules import (
    fixed_ratio_rank,
    gavish_donoho_omega,
    gavish_donoho_rank,
    marchenko_pastur_median,
    participation_rank,
    psqrt_rank,
)


@pytest.mark.parametrize("k", [1, 2, 3, 7, 50, 499, 768])
@pytest.mark.parametrize("value", [1e-6, 0.37, 12.0])
def test_psqrt_is_exact_on_a_flat_spectrum(k, value):
    lam = torch.cat([torch.full((k,), value), torch.zeros(768 - k)])
    assert psqrt_rank(lam) == k
    assert participation_rank(lam) == k
    assert psqrt_rank(lam.double()) == k


def test_psqrt_hand_computed():
    lam = torch.tensor([4.0, 1.0, 1.0, 0.0])  # sigma = 2, 1, 1: (4)^2 / 6 = 2.67 -> 3
    assert psqrt_rank(lam) == 3
    assert participation_rank(lam) == 2  # 6^2 / 18 = 2
    assert psqrt_rank(torch.zeros(5)) == 0


def test_psqrt_keeps_more_than_eigenvalue_participation_on_heavy_tails():
    lam = torch.tensor([1.0 / (k + 1) ** 2 for k in range(200)])
    assert psqrt_rank(lam) > participation_rank(lam)


def test_fixed_ratio_rank():
    assert fixed_ratio_rank(0.65, 768) == 500  # the paper's CLIP cut, K = 500
    assert fixed_ratio_rank(0.55, 100) == 55  # 0.55 * 100 = 55.000000000000007 in floats
    assert fixed_ratio_rank(1.0, 3072) == 3072
    assert fixed_ratio_rank(0.0, 64) == 0
    with pytest.raises(ValueError):
        fixed_ratio_rank(1.5, 10)


def test_marchenko_pastur_median_published_value():
    assert marchenko_pastur_median(1.0) == pytest.approx(0.6528, abs=5e-5)


@pytest.mark.parametrize("beta", [0.05, 0.25, 0.5, 0.8, 1.0])
def test_marchenko_pastur_median_halves_the_density(beta):
    # independent check: integrate the density directly in x (quad copes with the endpoint roots)
    lo, hi = (1 - math.sqrt(beta)) ** 2, (1 + math.sqrt(beta)) ** 2

    def density(x):
        return math.sqrt(max((hi - x) * (x - lo), 0.0)) / (2 * math.pi * beta * x)

    mu = marchenko_pastur_median(beta)
    assert integrate.quad(density, lo, mu, limit=200)[0] == pytest.approx(0.5, abs=1e-6)
    assert integrate.quad(density, lo, hi, limit=200)[0] == pytest.approx(1.0, abs=1e-6)


def test_marchenko_pastur_median_matches_random_matrices():
    rng = np.random.default_rng(0)
    n, m = 1600, 800  # beta = 0.5
    X = rng.standard_normal((n, m)) / math.sqrt(n)
    eig = np.linalg.eigvalsh(X.T @ X)
    assert np.median(eig) == pytest.approx(marchenko_pastur_median(0.5), rel=1e-2)


@pytest.mark.parametrize(("beta", "omega"), [(1.0, 2.858), (0.5, 2.171), (0.25, 1.837)])
def test_gavish_donoho_omega_published_values(beta, omega):
    assert gavish_donoho_omega(beta) == pytest.approx(omega, abs=1e-3)


@pytest.mark.parametrize(("n_rows", "n_cols", "rank"), [(600, 200, 5), (200, 600, 3), (300, 300, 8), (2048, 96, 1)])
def test_gavish_donoho_recovers_planted_rank(n_rows, n_cols, rank):
    g = torch.Generator().manual_seed(rank)
    m = min(n_rows, n_cols)
    noise = torch.randn(n_rows, n_cols, generator=g, dtype=torch.float64) / math.sqrt(max(n_rows, n_cols))
    U = torch.linalg.qr(torch.randn(n_rows, rank, generator=g, dtype=torch.float64)).Q
    V = torch.linalg.qr(torch.randn(n_cols, rank, generator=g, dtype=torch.float64)).Q
    strengths = torch.linspace(4.0, 8.0, rank, dtype=torch.float64)  # well above the bulk edge 1 + sqrt(beta)
    M = U * strengths @ V.T + noise
    lam = torch.linalg.eigvalsh(M.T @ M).flip(0)
    assert gavish_donoho_rank(lam, n_rows, n_cols) == rank
    # same answer from the first m eigenvalues alone (structural zeros of C beyond min(n_rows, n_cols))
    assert gavish_donoho_rank(lam[:m], n_rows, n_cols) == rank


def test_gavish_donoho_beta_and_median_come_from_the_stacked_matrix():
    # 8 experts of 4 x 64: M is 32 x 64, so beta = 32 / 64 and the median runs over its 32 singular
    # values (median 1 here), not over the 64 eigenvalues of C (median 0.5) nor one expert's beta = 4 / 64
    threshold = gavish_donoho_omega(0.5) * 1.0
    sigma = torch.cat([torch.tensor([1.01 * threshold, 0.99 * threshold]), torch.ones(30), torch.zeros(32)])
    assert gavish_donoho_rank(sigma**2, 32, 64) == 1
    assert 0.99 * threshold > gavish_donoho_omega(0.5) * 0.5  # a median over all 64 would keep 2
    assert 0.99 * threshold > gavish_donoho_omega(4 / 64) * 1.0  # one expert's beta would keep 2


def test_gavish_donoho_pure_noise_gives_zero():
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(500, 250, generator=g, dtype=torch.float64)
    lam = torch.linalg.eigvalsh(noise.T @ noise).flip(0)
    assert gavish_donoho_rank(lam, 500, 250) == 0


def test_gavish_donoho_noise_level_can_come_from_other_eigenvalues():
    """specmerge counts resolved eigenvalues but takes the noise median from all of them as computed: zeroing the
    bottom of a noise bulk (below what float32's eigh resolves) must not drag the median, and the cut, to 0."""
    spikes = torch.tensor([9.0, 7.0, 5.0], dtype=torch.float64)
    bulk = torch.linspace(1e-2, 1e-4, 17, dtype=torch.float64)
    computed = torch.cat([spikes, bulk])
    resolved = torch.where(computed > 9e-3, computed, torch.zeros_like(computed))  # 15 of 20 zeroed: median 0
    assert gavish_donoho_rank(resolved, 40, 20) == int((resolved > 0).sum()) == 5  # every resolved one kept
    assert gavish_donoho_rank(resolved, 40, 20, median_of=computed) == gavish_donoho_rank(computed, 40, 20) == 3
