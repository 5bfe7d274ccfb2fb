"""A top-K cut below float32's resolution of eigh(C): the K kept directions refined by Rayleigh-Ritz (issue 50, item 6).

eigh(C) and the reduction of C give eigenvalues to about eps lambda_1; a cut whose kept eigenvalues lie below
sqrt(d_in) eps lambda_1 must not invert them as computed. Before, such a merge decomposed again through the SVD of M
(and reduced C a second time); now the K leading vectors are refined through M (:func:`ritz_refined`), which resolves
their eigenvalues as the SVD does at a fraction of its cost. The layers here have C of exact rank K with eigenvalues
from lambda_1 down to a few eps lambda_1 (below the floor), so the filter inverts directions eigh does not resolve.
"""

import math

import pytest
import torch

import specmerge.linalg.ritz as ritz_module
import specmerge.linalg.solve as solve_module
import specmerge.linalg.spectrum as spectrum_module
from specmerge.linalg.quadratic import normal_equation
from specmerge.linalg.ritz import ritz_pays, ritz_refined
from specmerge.linalg.solve import FreshLayer
from specmerge.linalg.spectrum import decompose
from specmerge.methods import get_method

EPS = torch.finfo(torch.float32).eps


def exact_rank_layer(n: int, d_out: int, d_in: int, rank: int, lowest: float, seed: int = 0) -> torch.Tensor:
    """N experts sharing a rank-``rank`` row space; C's eigenvalues geometric from lambda_1 to ``lowest`` lambda_1.
    Float64 holding float32 numbers (both precisions see the same layer)."""
    g = torch.Generator().manual_seed(seed)
    V = torch.linalg.qr(torch.randn(d_in, rank, generator=g, dtype=torch.float64))[0]
    sigma = torch.logspace(0, math.log10(lowest) / 2, rank, dtype=torch.float64)
    taus = []
    for _ in range(n):
        U = torch.linalg.qr(torch.randn(d_out, rank, generator=g, dtype=torch.float64))[0]
        R = torch.linalg.qr(torch.randn(rank, rank, generator=g, dtype=torch.float64))[0]
        taus.append(U @ R @ torch.diag(sigma) @ V.T)
    return (1e-3 * torch.stack(taus)).float().double()


def plain_top_k(tau: torch.Tensor, k: int) -> torch.Tensor:
    """The paper's algorithm in tau's dtype: one eigh of C, the k leading directions inverted as computed."""
    eq = normal_equation(tau)
    lam, Q = torch.linalg.eigh(eq.C)
    lam, Q = lam.flip(0)[:k], Q.flip(1)[:, :k]
    start = tau.sum(0)
    return start + ((eq.D_times(Q) - start @ (eq.C @ Q)) / lam) @ Q.T


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


class Count:
    """Wraps a function and counts its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


# (N, d_out, d_in, K, lowest eigenvalue / lambda_1): the lowest below sqrt(d_in) eps (9.5e-7 at 64, 1.3e-6 at 128)
LAYERS = [(4, 48, 64, 16, 3e-7), (2, 96, 128, 24, 5e-7), (4, 64, 256, 32, 1e-6)]


@pytest.mark.parametrize(("n", "d_out", "d_in", "rank", "lowest"), LAYERS)
def test_a_cut_below_the_floor_is_refined_not_decomposed_again(monkeypatch, n, d_out, d_in, rank, lowest):
    tau = exact_rank_layer(n, d_out, d_in, rank, lowest)
    params = {"filter": "pinv", "rank": "ratio", "rank_ratio": rank / d_in}  # top-K with K = rank, h = 1
    exact = get_method("spectral_filter")(tau, **params).delta
    ritz, svd = Count(solve_module.ritz_refined), Count(spectrum_module.singular_pairs)
    decompositions = Count(decompose)
    monkeypatch.setattr(solve_module, "ritz_refined", ritz)
    monkeypatch.setattr(spectrum_module, "singular_pairs", svd)
    monkeypatch.setattr(solve_module, "decompose", decompositions)
    refined = get_method("spectral_filter")(tau.float(), **params)
    assert refined.diagnostics["kept_rank"] == rank and refined.diagnostics["refined"]  # said in report.json
    assert (ritz.calls, decompositions.calls) == (1, 1)  # one decomposition, refined; no SVD, no second reduction
    assert svd.calls == 0 or n * d_out < d_in  # (a wide layer's own route is the SVD)
    monkeypatch.setattr(ritz_module, "RITZ_MAX_SHARE", 0.0)  # the route before: the SVD of M
    by_svd = get_method("spectral_filter")(tau.float(), **params).delta
    plain = plain_top_k(tau.float(), rank)
    # as close to float64 as the SVD route (the float32 rounding of D, amplified by 1 / lambda_K, dominates both)
    assert distance(refined.delta, exact) <= 1.5 * distance(by_svd, exact)
    # and far closer than inverting eigh's eigenvalues as computed (the bound: at most 3x that)
    assert distance(refined.delta, exact) <= distance(plain, exact) / 2


@pytest.mark.parametrize("lowest", [3e-7, 1e-5])
def test_ritz_values_are_off_by_the_square_of_the_subspace_angle(lowest):
    """On C of exact rank K (row space Z), computed leading vectors Q = Z S + (null part): the Ritz values are the
    eigenvalues of S^T (Z^T C Z) S, within a factor [cos^2 alpha_max, 1] of C's by Ostrowski's theorem, alpha the
    largest angle between span(Q) and Z; plus the rounding of M Q, eps sigma_1 / sigma_k relative. eigh's own
    eigenvalues are off by its backward error, about eps lambda_1, relative to lambda_k: first order in the angle."""
    n, d_out, d_in, rank = 4, 48, 64, 16
    tau = exact_rank_layer(n, d_out, d_in, rank, lowest)
    C = normal_equation(tau).C
    true, Z = torch.linalg.eigh(C)
    true, Z = true.flip(0)[:rank], Z.flip(1)[:, :rank]  # float64: exact to about 1e-16 lambda_1 here
    eq = normal_equation(tau.float())
    spectrum = decompose(eq)
    assert ritz_pays(rank, spectrum)
    refined = ritz_refined(eq, spectrum, rank)
    assert refined.accurate and refined.refined and refined.vectors.shape == (d_in, rank)
    Q = spectrum.leading(rank).double()
    cos_min = float(torch.linalg.svdvals(Z.T @ Q).min())  # the cosine of the largest angle
    rounding = 4 * math.sqrt(d_in) * EPS / torch.sqrt(true / true[0])  # M Q's rounding relative to sigma_k
    error = ((refined.computed_eigenvalues.double()[:rank] - true) / true).abs()
    assert bool((error <= (1 - cos_min**2) + rounding).all()), (error, 1 - cos_min**2)
    # the refined vectors: orthonormal to float32 rounding, resolved eigenvalues (above the SVD's floor)
    vectors = refined.vectors.double()
    assert float((vectors.T @ vectors - torch.eye(rank, dtype=torch.float64)).abs().max()) <= 4 * math.sqrt(rank) * EPS
    assert bool((refined.eigenvalues[:rank] > 0).all())


def test_pays_only_for_a_leading_count_of_the_layer_itself():
    tau = exact_rank_layer(2, 96, 128, 24, 1e-4).float()
    eq = normal_equation(tau)
    spectrum = decompose(eq)
    assert ritz_pays(24, spectrum) and ritz_pays(64, spectrum)
    assert not ritz_pays(65, spectrum)  # past half of d_in the SVD's flops are not much more
    assert not ritz_pays(None, spectrum) and not ritz_pays(0, spectrum)  # any direction (pinv): the SVD
    assert not ritz_pays(24, decompose(eq, accurate=True))  # already accurate
    core = decompose(eq, (200, 512))  # LoRA cores: the SVD of the small cores
    assert not ritz_pays(24, core)


def test_a_layer_asked_twice_decomposes_once(monkeypatch):
    """Before, a merge that needed the accurate spectrum reduced C twice (the partial spectrum was not kept)."""
    tau = exact_rank_layer(4, 48, 64, 16, 3e-7).float()
    decompositions = Count(decompose)
    monkeypatch.setattr(solve_module, "decompose", decompositions)
    layer = FreshLayer(tau)
    layer.projection("sum")
    layer.projection("mean")
    layer.projection("sum", accurate=True)
    layer.projection("sum", accurate=True, leading=16)
    assert decompositions.calls == 2  # eigh once, the SVD once; the refined one from eigh's
