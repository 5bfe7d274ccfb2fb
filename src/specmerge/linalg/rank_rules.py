"""Rank rules: how many leading eigendirections of C to keep (paper Sec. 4.2, App. B.5).

Every rule reads the eigenvalues lambda_k of C = M^T M (descending), i.e. the squared singular
values sigma_k of the stacked normalised task-vector matrix M (n_rows = N d_out, n_cols = d_in).
"""

from __future__ import annotations

import functools
import math

import torch

# Slack when rounding a ratio up to an integer rank: a flat spectrum of K equal values gives
# (sum sigma)^2 / sum sigma^2 = K up to float rounding, which must not become K + 1.
_CEIL_SLACK = 1e-9


def _ceil(x: float) -> int:
    return math.ceil(x * (1 - _CEIL_SLACK))


def _singular_values(eigenvalues: torch.Tensor) -> torch.Tensor:
    return eigenvalues.detach().double().clamp(min=0).sqrt()


def fixed_ratio_rank(ratio: float, d_in: int) -> int:
    """K = ceil(ratio * d_in) (SWUDI, paper Eq. 11), clipped to [0, d_in]."""
    if not 0 <= ratio <= 1:
        raise ValueError(f"rank ratio must be in [0, 1], got {ratio}")
    return min(d_in, _ceil(ratio * d_in))


def participation_ratio(values: torch.Tensor) -> float:
    """(sum v)^2 / sum v^2 of non-negative values (negatives clamped to 0): K for K equal values; 0 if all zero."""
    v = values.detach().double().clamp(min=0)
    square = float((v * v).sum())
    return 0.0 if square == 0 else float(v.sum()) ** 2 / square


def psqrt_rank(eigenvalues: torch.Tensor) -> int:
    """K = ceil((sum sigma)^2 / sum sigma^2), the participation ratio of sigma = sqrt(lambda) (Eq. 12)."""
    return _ceil(participation_ratio(_singular_values(eigenvalues)))


def participation_rank(eigenvalues: torch.Tensor) -> int:
    """K = ceil((sum lambda)^2 / sum lambda^2), the participation ratio of the eigenvalues themselves."""
    return _ceil(participation_ratio(eigenvalues))


@functools.lru_cache(maxsize=256)
def marchenko_pastur_median(beta: float) -> float:
    """Median of the Marchenko-Pastur law with aspect ratio beta in (0, 1] (variance 1).

    Solves CDF(mu) = 1/2 numerically. The density sqrt((b+ - x)(x - b-)) / (2 pi beta x) on
    [b-, b+], b+- = (1 +- sqrt(beta))^2, is integrated in x = b- + (b+ - b-)(1 - cos theta)/2,
    which removes the square-root endpoint singularities.
    """
    from scipy import integrate, optimize  # here, not at module level: scipy costs 0.2 s of every start-up

    if not 0 < beta <= 1:
        raise ValueError(f"Marchenko-Pastur ratio beta must be in (0, 1], got {beta}")
    lo, hi = (1 - math.sqrt(beta)) ** 2, (1 + math.sqrt(beta)) ** 2
    half_width = (hi - lo) / 2

    def density_in_theta(theta: float) -> float:
        x = lo + half_width * (1 - math.cos(theta))
        sin = math.sin(theta)
        if x == 0:  # beta = 1 at theta = 0: the limit of sin^2 / x is 1 / half_width
            return half_width / (2 * math.pi * beta)
        return half_width**2 * sin * sin / (2 * math.pi * beta * x)

    def cdf_minus_half(theta: float) -> float:
        return integrate.quad(density_in_theta, 0.0, theta, epsabs=1e-13, epsrel=1e-12)[0] - 0.5

    theta = optimize.brentq(cdf_minus_half, 0.0, math.pi, xtol=1e-14)
    return lo + half_width * (1 - math.cos(theta))


def gavish_donoho_omega(beta: float) -> float:
    """omega(beta) = lambda_star(beta) / sqrt(mu_beta), the unknown-noise optimal hard threshold ratio."""
    lambda_star = math.sqrt(2 * (beta + 1) + 8 * beta / ((beta + 1) + math.sqrt(beta**2 + 14 * beta + 1)))
    return lambda_star / math.sqrt(marchenko_pastur_median(beta))


def gavish_donoho_rank(
    eigenvalues: torch.Tensor, n_rows: int, n_cols: int, median_of: torch.Tensor | None = None
) -> int:
    """K = #{sigma_k > omega(beta) median(sigma)} for the n_rows x n_cols matrix M (paper Eq. 13).

    beta = min/max of M's shape and the median runs over its min(n_rows, n_cols) singular values;
    ``eigenvalues`` may hold more (structural zeros of C when n_rows < n_cols), which are ignored.
    ``median_of``: the eigenvalues whose median sets the noise level, when they differ from those counted
    (specmerge counts the resolved eigenvalues and takes the median of all of them as computed).
    K = 0 is a valid answer: no singular value stands above the noise bulk.
    """
    m = min(n_rows, n_cols)
    noise = eigenvalues if median_of is None else median_of
    if min(eigenvalues.numel(), noise.numel()) < m:
        raise ValueError(f"need the {m} singular values of a {n_rows} x {n_cols} matrix, got {eigenvalues.numel()}")
    sigma = _singular_values(eigenvalues)[:m]
    threshold = gavish_donoho_omega(m / max(n_rows, n_cols)) * float(_singular_values(noise)[:m].quantile(0.5))
    return int((sigma > threshold).sum())
