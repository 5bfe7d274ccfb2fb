"""The unified spectral filtering estimator (paper Eq. 8, Alg. 1) and the spectral merge built on it.

For a filter h, tau_hat = tau_init + (D - tau_init C) Q diag(h_k / lambda_k) Q^T. SWUDI, SWUDI-A, the plain
closed form D C^+ and the generic filter family are all one call of :func:`spectral_merge` with a different
filter. :func:`shared_decompositions` lets a parameter sweep reuse one layer's decomposition.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from specmerge.linalg.filters import Filter
from specmerge.linalg.quadratic import NormalEquation, TauInit, initial_point, normal_equation
from specmerge.linalg.spectrum import Spectrum, decompose, directions


def _gains_and_dropped(spectrum: Spectrum, filt: Filter) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse gains of the directions with an eigenvector, and which unresolved ones they leave out (see below)."""
    lam, resolved = directions(spectrum)
    gains = filt.inverse_gain(lam)
    if bool(resolved.all()):
        return gains, torch.zeros_like(resolved)
    at_zero = filt.inverse_gain(torch.where(resolved, lam, torch.zeros_like(lam)))
    at_floor = filt.inverse_gain(torch.where(resolved, lam, torch.full_like(lam, spectrum.floor)))
    bounded = at_zero.isfinite() & (at_floor >= at_zero / 2)
    kept = (resolved | bounded) & gains.isfinite()
    return torch.where(kept, gains, torch.zeros_like(gains)), ~kept


def inverse_gains(spectrum: Spectrum, filt: Filter) -> torch.Tensor:
    """g_k = h_k / lambda_k for each direction with an eigenvector, 0 for those left out.

    Resolved directions get the filter's gain at their eigenvalue. An unresolved one (eigenvalue at or
    below the floor f: its true value is anywhere in [0, f]) is inverted only when the gain is resolved
    there too, g(f) >= g(0) / 2 with g(0) finite: SWUDI and the exponential filter (h / lambda <= t) while
    t f < 1.6, Landweber, Tikhonov with alpha >= f. It is left out (Moore-Penrose) where the gain would
    amplify round-off without bound: the pseudoinverse, a hard cut reaching into unresolved eigenvalues,
    Tikhonov with alpha < f, a long time t. Dropping the bounded ones instead loses real signal in float32
    (1e-2 relative on SWUDI r = 1).
    """
    return _gains_and_dropped(spectrum, filt)[0]


def filtered_solve(
    eq: NormalEquation, spectrum: Spectrum, gains: Filter | torch.Tensor, tau_init: torch.Tensor | None
) -> torch.Tensor:
    """tau_init + (D - tau_init C) Q diag(h / lambda) Q^T (paper Eq. 8) for a filter h.

    ``gains`` is the :class:`Filter`, or the values h_k on ``spectrum.eigenvalues`` (then the resolved
    directions are inverted, nothing else is checked: the plain formula). With a Filter, directions are
    chosen by :func:`inverse_gains`, and a direction whose right-hand side B q_k = (D - tau_init C) q_k
    is not above the round-off of computing it (:func:`_rounding_level`) is skipped too: it carries no
    information, and inverting it would only amplify that round-off (by up to 1 / lambda_k).
    Directions with zero gain are skipped; tau_init C costs one product with C (or with M, when cheaper).
    """
    lam, _ = directions(spectrum)
    if isinstance(gains, Filter):
        inverse = inverse_gains(spectrum, gains)
    else:
        rank = spectrum.rank
        inverse = torch.zeros_like(lam)
        inverse[:rank] = gains[:rank] / spectrum.eigenvalues[:rank]
    active = inverse != 0
    if not bool(active.any()):
        return torch.zeros_like(eq.D) if tau_init is None else tau_init.clone()
    Q, lam, inverse = spectrum.vectors[:, active], lam[active], inverse[active]
    # (D - tau_init C) Q with C itself, not (tau_init Q) diag(lambda): the computed q_k are eigenvectors only up
    # to a residual of eps lambda_1, which D q_k carries and lambda_k tau_init q_k does not; on float32 layers
    # with steep spectra the difference, amplified by SWUDI's gain t, made the result 2-3x less accurate
    residual = eq.D if tau_init is None else eq.D - eq.times_C_once(tau_init)
    projected = residual @ Q
    if isinstance(gains, Filter):
        informative = projected.norm(dim=0) > _rounding_level(eq, spectrum, tau_init, lam, inverse, projected)
        if not bool(informative.all()):
            Q, projected, inverse = Q[:, informative], projected[:, informative], inverse[informative]
    update = (projected * inverse) @ Q.T
    return update if tau_init is None else tau_init + update


def _rounding_level(
    eq: NormalEquation,
    spectrum: Spectrum,
    tau_init: torch.Tensor | None,
    lam: torch.Tensor,
    gains: torch.Tensor,
    projected: torch.Tensor,
    chunk: int = 1024,
) -> torch.Tensor:
    """The round-off in the computed right-hand side B q_k of each inverted direction, as it affects the update.

    Two parts, u = eps / 2 the unit round-off:
    - D and tau_init C are formed with errors of a few u times their norms (measured in float32: 4-8 u ||D||_F
      in all, 0.3-1 u ||D||_F along one direction): u (||D||_F + lambda_k ||tau_init||_F);
    - the computed q_k holds each other q_j at an angle of u lambda_1 / |lambda_j - lambda_k| (eigh) or
      u sigma_1 max(sigma_j, sigma_k) / |sigma_j^2 - sigma_k^2| (SVD) (Davis-Kahan, Wedin), which moves the
      update along q_k by that angle times (g_k - g_j) ||B q_j||: relative to g_k, |1 - g_j / g_k| ||B q_j||.
      It matters only where the gains differ: the tail of a pseudoinverse (1 / lambda_k against 1 / lambda_j),
      C's null space under SWUDI (t against 1 / lambda_j on dense LoRA experts).
    A direction whose B q_k is below this carries no information, and inverting it would only amplify round-off.
    """
    unit = torch.finfo(eq.D.dtype).eps / 2
    start = 0.0 if tau_init is None else float(tau_init.norm())
    level = unit * (float(eq.D.norm()) + lam * start)
    if lam.numel() < 2:
        return level
    size = projected.norm(dim=0)
    lam = lam.to(torch.float64)  # the gaps below are differences of eigenvalues: take them without new round-off
    if spectrum.accurate:
        sigma = lam.sqrt()
        scale = unit * float(sigma[0])
    else:
        scale = unit * float(lam[0])
    mixing = []
    for rows in torch.split(torch.arange(lam.numel(), device=lam.device), chunk):
        if spectrum.accurate:
            gap = (lam[rows, None] - lam[None, :]).abs() / torch.maximum(sigma[rows, None], sigma[None, :])
        else:
            gap = (lam[rows, None] - lam[None, :]).abs()
        differ = (1 - gains[None, :].double() / gains[rows, None].double()).abs()
        angle = torch.where(differ > 0, differ / gap, torch.zeros_like(gap))  # equal gains: no effect
        angle[torch.arange(rows.numel()), rows] = 0
        mixing.append((angle * size[None, :].double()).norm(dim=1))
    return level + scale * torch.cat(mixing).to(level.dtype)


def spectral_merge(
    task_vectors: torch.Tensor,
    make_filter: Callable[[Spectrum], tuple[Filter, int | None]],
    tau_init: TauInit,
    scale: float,
    full_shape: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The one code path of every closed-form spectral method: ``(scale * tau_hat, diagnostics)``.

    ``make_filter(spectrum) -> (Filter, kept_rank or None)`` lets a rank rule look at the spectrum.
    The diagnostics are the spectrum's (:func:`spectrum_diagnostics`). With ``full_shape`` the task
    vectors are cores of larger layers (see :func:`~specmerge.linalg.spectrum.decompose`), and so is
    the result. No non-zero expert: zeros, unscaled.
    """
    start = initial_point(task_vectors, tau_init)
    eq, spectrum = equation_and_spectrum(task_vectors, full_shape)
    if spectrum is None:
        return torch.zeros_like(task_vectors[0]), {"n_experts": 0, "kept_rank": 0}
    filt, kept = make_filter(spectrum)
    if not spectrum.accurate and bool(_gains_and_dropped(spectrum, filt)[1].any()):
        # the filter inverts eigenvalues eigh(C) does not resolve without bound (pseudoinverse, small
        # Tikhonov alpha): decompose again through the SVD of M, which resolves them (the rank rule,
        # if any, keeps the K it chose on the first spectrum)
        spectrum = _accurate_spectrum(task_vectors, eq, full_shape)
    gains = filt(spectrum.eigenvalues)
    tau_hat = filtered_solve(eq, spectrum, filt, start)
    return scale * tau_hat, spectrum_diagnostics(eq, spectrum, kept, gains)


_SHARED: ContextVar[dict | None] = ContextVar("specmerge_shared_decompositions", default=None)


@contextlib.contextmanager
def shared_decompositions() -> Iterator[None]:
    """Within this block, spectral methods called again on the same task-vector tensor reuse its decomposition.

    For parameter sweeps (filters, rank rules, tau_init, scale): the normal equation and the
    eigendecomposition of a layer are computed on the first call and reused while the tensor object
    is unchanged (same object, no in-place edit). Results are identical to separate calls. The cache
    lives until the block ends: open one block per layer.
    """
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def equation_and_spectrum(
    task_vectors: torch.Tensor, full_shape: tuple[int, int] | None = None
) -> tuple[NormalEquation, Spectrum | None]:
    """WUDI's normal equation of a stack and the spectrum of its C (None when no expert is non-zero).

    Shared within :func:`shared_decompositions`; ``full_shape`` as in :func:`~specmerge.linalg.spectrum.decompose`.
    """
    cache = _SHARED.get()
    key = (id(task_vectors), task_vectors._version, full_shape)
    if cache is not None and key in cache:
        return cache[key][1:]
    eq = normal_equation(task_vectors)
    spectrum = decompose(eq, full_shape) if eq.n_experts else None
    if cache is not None:
        cache[key] = (task_vectors, eq, spectrum)  # the tensor is held so that its id stays unique
    return eq, spectrum


def _accurate_spectrum(task_vectors: torch.Tensor, eq: NormalEquation, full_shape: tuple[int, int] | None) -> Spectrum:
    """decompose(eq, accurate=True), shared like :func:`equation_and_spectrum` within shared_decompositions()."""
    cache = _SHARED.get()
    key = (id(task_vectors), task_vectors._version, full_shape, "accurate")
    if cache is not None and key in cache:
        return cache[key][2]
    spectrum = decompose(eq, full_shape, accurate=True)
    if cache is not None:
        cache[key] = (task_vectors, eq, spectrum)
    return spectrum


def spectrum_diagnostics(eq: NormalEquation, spectrum: Spectrum, kept: int | None, gains: torch.Tensor) -> dict:
    """Per-layer figures: kept rank K, eigenvalue summary, energy kept, filter gain summary."""
    lam = spectrum.eigenvalues.double()
    total = float(lam.sum())
    k = spectrum.rank if kept is None else min(kept, spectrum.eigenvalues.numel())
    return {
        "n_experts": eq.n_experts,
        "kept_rank": k,
        "numerical_rank": spectrum.rank,
        "spectrum_size": spectrum.eigenvalues.numel(),
        "lambda_max": float(lam[0]),
        "lambda_kept_min": float(lam[k - 1]) if k > 0 else None,
        "lambda_sum": total,
        "energy_kept": float(lam[:k].sum()) / total if total > 0 else 0.0,
        "mean_gain": float(gains[: spectrum.rank].double().mean()) if spectrum.rank else 0.0,
    }
