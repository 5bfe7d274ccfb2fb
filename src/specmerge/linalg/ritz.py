"""Rayleigh-Ritz refinement of a top-K cut below float32's resolution of eigh(C) (issue 50, item 6).

eigh(C) and the reduction of C give eigenvalues to about eps lambda_1; a filter keeping the leading K directions
whose kept eigenvalues lie below sqrt(d_in) eps lambda_1 would invert unresolved eigenvalues.
:func:`~specmerge.linalg.solve.spectral_merge` then asks for an accurate spectrum, and for a top-K filter
(:func:`ritz_pays`) that is :func:`ritz_refined`: the K kept directions refined through the experts, instead of a
second decomposition through the SVD of M. BENCHMARKS "SWUDI-A at the K real fine-tunes keep" measures it.
"""

from __future__ import annotations

import torch

from specmerge.linalg.quadratic import NormalEquation
from specmerge.linalg.spectrum import Spectrum, resolution_floor

RITZ_MAX_SHARE = 0.5  # refine the leading k of d by Rayleigh-Ritz while k <= this share of d (else the SVD of M)


def ritz_pays(k: int | None, spectrum: Spectrum) -> bool:
    """Whether the leading ``k`` directions of an eigh or partial ``spectrum`` are made accurate by
    :func:`ritz_refined` rather than by the SVD of M: a filter that keeps the leading k (a top-K cut), a spectrum of
    the layer itself (not of LoRA cores), and k at most RITZ_MAX_SHARE of d_in. Its flops, 2 N d_out d_in k for
    M Q_k, are k / d_in of the QR of M alone; the SVD then adds a d_in-sized decomposition on top."""
    if k is None or k <= 0 or spectrum.accurate or spectrum.n_cols != spectrum.vector_length:
        return False
    return k <= RITZ_MAX_SHARE * spectrum.n_cols


def ritz_refined(eq: NormalEquation, spectrum: Spectrum, k: int) -> Spectrum:
    """The leading k eigenpairs of C made accurate by Rayleigh-Ritz through M (issue 50): one product with the
    experts, no second decomposition of C.

    eigh(C) and the reduction of C give eigenvalues to about eps lambda_1, so a top-K cut that reaches below
    sqrt(d_in) eps lambda_1 (SWUDI-A's psqrt K at 1e-5 of lambda_1 on a 3072 x 8192 layer with little noise) would
    invert unresolved eigenvalues. Their eigenvectors span the leading subspace well (their error is in the
    eigenvalues, not in the subspace). Here W_i = tau_i Q_k / sqrt(n_i) for the computed leading vectors Q_k, the
    k x k matrix G = sum_i W_i^T W_i = Q_k^T C Q_k formed in float64 from W (so its small entries carry the
    relative accuracy of M Q_k, eps sigma_1 sigma_j, not C's eps lambda_1), and G = Y diag(theta) Y^T: the Ritz
    values theta are the new eigenvalues of the k leading directions and Q_k Y their vectors, marked ``accurate``
    (their floor is the SVD's). The directions past k keep their eigenvalues and have no vector: the filter keeps
    none of them. Cost: 2 N d_out d_in k flops for W, against the QR of M (2 N d_out d_in^2) and a d_in-sized SVD.
    """
    Q = spectrum.leading(k)
    G = Q.new_zeros(k, k, dtype=torch.float64)
    for rows, n in zip(eq.rows, eq.norms_sq, strict=True):  # one expert at a time: no copy of the stack
        W = (rows @ Q).double()
        G.addmm_(W.T, W, alpha=1 / float(n))
    theta, Y = torch.linalg.eigh(G)
    theta, Y = theta.flip(0), Y.flip(1)
    vectors = (Q.double() @ Y).to(Q.dtype)
    computed = spectrum.computed_eigenvalues.clone()
    computed[:k] = theta.clamp(min=0).to(computed.dtype)
    floor = resolution_floor(computed, spectrum.n_cols, accurate=True)
    eigenvalues = spectrum.eigenvalues.clone()
    eigenvalues[:k] = torch.where(computed[:k] > floor, computed[:k], torch.zeros_like(computed[:k]))
    return Spectrum(eigenvalues, vectors, spectrum.n_rows, spectrum.n_cols, floor, computed, True, refined=True)
