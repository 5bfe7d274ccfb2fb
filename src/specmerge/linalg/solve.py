"""The unified spectral filtering estimator (paper Eq. 8, Alg. 1) and the spectral merge built on it.

For a filter h, tau_hat = tau_init + (D - tau_init C) Q diag(h_k / lambda_k) Q^T. SWUDI, SWUDI-A, the plain
closed form D C^+ and the generic filter family are all one call of :func:`spectral_merge` with a different
filter. :func:`shared_decompositions` lets a parameter sweep reuse one layer's decomposition. The merge is two steps:
a layer's :class:`Projection` (its spectrum, start and right-hand sides B Q, formed from the task vectors or read
from a spectral cache) and :func:`solve` (the filter on it), so a setting re-synthesized from a cache runs the very
same arithmetic as a fresh merge.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, Protocol

import torch

from specmerge.linalg import eigensolver
from specmerge.linalg.filters import Filter
from specmerge.linalg.projection import (
    Projection,
    ProjectionMissing,  # noqa: F401 (re-exported: the tuning code and the executors catch it from here)
    RightHandSide,
    fresh_projection,
    projection,
    shared_update,
)
from specmerge.linalg.quadratic import NormalEquation, TauInit, initial_point, normal_equation
from specmerge.linalg.ritz import ritz_pays, ritz_refined
from specmerge.linalg.spectrum import Spectrum, choose_rank, decompose, directions, prefix


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
    """tau_init + (D - tau_init C) Q diag(h / lambda) Q^T (paper Eq. 8) for a filter h: :func:`solve` on the fresh
    :func:`projection` of ``eq``."""
    return solve(projection(eq, spectrum, tau_init), gains)


def solve(p: Projection, gains: Filter | torch.Tensor, leading: int | None = None) -> torch.Tensor:
    """tau_init + (D - tau_init C) Q diag(h / lambda) Q^T (paper Eq. 8) for a filter h, from a :class:`Projection`.

    ``gains`` is the :class:`Filter`, or the values h_k on ``spectrum.eigenvalues`` (then the resolved
    directions are inverted, nothing else is checked: the plain formula). With a Filter, directions are
    chosen by :func:`inverse_gains`, and a direction whose right-hand side B q_k = (D - tau_init C) q_k
    is not above the round-off of computing it (:func:`_rounding_level`) is skipped too: it carries no
    information, and inverting it would only amplify that round-off (by up to 1 / lambda_k).
    Directions with zero gain are skipped. ``leading``: the filter keeps at most that many leading directions
    (a top-K filter's K): the eigenvectors of a partial spectrum are those computed for that count
    (``spectrum.basis``), whatever the solve then drops, so a spectral cache can store their columns.
    """
    spectrum = p.spectrum
    lam, _ = directions(spectrum)
    if isinstance(gains, Filter):
        inverse = inverse_gains(spectrum, gains)
    else:
        rank = spectrum.rank
        inverse = torch.zeros_like(lam)
        inverse[:rank] = gains[:rank] / spectrum.eigenvalues[:rank]
    active = inverse != 0
    if not bool(active.any()):
        return p.zeros() if p.start is None else p.start.clone()
    index = active.nonzero().squeeze(1)
    leading = prefix(index) if leading is None or not spectrum.partial else solve_count(spectrum, leading, index)
    basis = spectrum.basis(leading)[0]  # the set of eigenvectors Q and the projections come from
    Q, lam, inverse = spectrum.columns(index, leading), lam[active], inverse[active]
    projected = p.columns(index, leading)
    if isinstance(gains, Filter):
        informative = projected.norm(dim=0) > _rounding_level(p, lam, inverse, projected, basis)
        if not bool(informative.all()):
            Q, projected, inverse, index = (
                Q[:, informative],
                projected[:, informative],
                inverse[informative],
                index[informative],
            )
    shared = p.shared is not None
    update = shared_update(p, index, inverse, projected, Q, basis) if shared else (projected * inverse) @ Q.T
    return update if p.start is None else p.start + update


def solve_count(spectrum: Spectrum, leading: int, index: torch.Tensor | None = None) -> int:
    """How many leading eigenvectors of a partial spectrum :func:`solve` asks for when the filter keeps ``leading``
    (at most every one; at least those of the directions ``index`` it inverts)."""
    return max(min(leading, spectrum.n_vectors), 0 if index is None else prefix(index))


def _rounding_level(
    p: Projection,
    lam: torch.Tensor,
    gains: torch.Tensor,
    projected: torch.Tensor,
    count: int,
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
    ``count``: the set of eigenvectors the columns come from (``spectrum.basis``), which says where ||D||_F comes from.
    """
    spectrum = p.spectrum
    unit = torch.finfo(projected.dtype).eps / 2
    level = unit * (p.norm_of_D(count) + lam * p.start_norm)
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


Kept = Callable[[int], int] | str | None  # what a filter keeps: a count from n_cols, a rank rule's name, any


def wants_partial(kept: Kept, n_cols: int, size: int) -> bool:
    """Whether a filter keeping ``kept`` (a count from the layer's n_cols, a rank rule or None: see
    :func:`spectral_merge`) asks for a partial spectrum of a C of ``size`` x ``size``
    (:func:`~specmerge.linalg.eigensolver.pays`)."""
    return eigensolver.pays("rule" if isinstance(kept, str) else kept(n_cols) if callable(kept) else kept, size)


def leading_count(kept: Kept, spectrum: Spectrum) -> int | None:
    """The K of the leading directions a filter keeping ``kept`` keeps on ``spectrum``, None for any: what
    :func:`spectral_merge` passes to :func:`solve` (a spectral cache stores the columns of these counts)."""
    if kept is None:
        return None
    return choose_rank(kept, spectrum) if isinstance(kept, str) else kept(spectrum.n_cols)


class LayerProjections(Protocol):
    """One layer's projections for any start, as :func:`spectral_merge` asks for them: the fresh ones of a stack of
    task vectors (:class:`FreshLayer`) or stored ones (a spectral cache, :mod:`specmerge.tuning.spectral_cache`)."""

    n_experts: int  # experts with a non-zero task vector (0: the merge is zero)
    n_total: int  # experts in the stack, those with a zero task vector included

    def projection(
        self, tau_init: TauInit, *, accurate: bool = False, partial: bool = False, leading: int | None = None
    ) -> Projection: ...

    def wants_partial(self, kept: Kept) -> bool: ...

    def zeros(self) -> torch.Tensor: ...


class FreshLayer:
    """The projections of a stack of task vectors (N x d_out x d_in, or cores with ``full_shape``), formed when first
    asked for: the start, the normal equation and its spectrum (shared within :func:`shared_decompositions`), one
    right-hand side per start shared by its spectra (:class:`~specmerge.linalg.projection.RightHandSide`: B formed at
    most once, and only if a count on the B route asks); the SVD spectrum only when asked for (``accurate``), a
    partial one (:func:`~specmerge.linalg.spectrum.decompose`) for a filter that keeps leading directions
    (``partial``)."""

    def __init__(self, task_vectors: torch.Tensor, full_shape: tuple[int, int] | None = None) -> None:
        self.task_vectors, self.full_shape = task_vectors, full_shape
        self._starts: dict[str, RightHandSide] = {}
        self._projections: dict[tuple[str, str], Projection] = {}
        self._spectra: dict[str, Spectrum] = {}  # by kind: a merge that asks again (accurate after partial) reuses

    @functools.cached_property
    def _equation(self) -> NormalEquation:
        return shared_equation(self.task_vectors)

    @property
    def equation(self) -> NormalEquation:
        """The layer's normal equation (formed when first asked for)."""
        return self._equation

    def give(self, kind: str, spectrum: Spectrum) -> None:
        """Use ``spectrum`` as this layer's ``kind`` ("full" or "partial") spectrum: decomposed elsewhere, as
        :func:`~specmerge.linalg.spectrum.decompose` would (a batch of layers: ``decompose_batch``)."""
        self._spectra[kind] = spectrum

    @property
    def n_experts(self) -> int:
        return self._equation.n_experts

    @property
    def n_total(self) -> int:
        return self.task_vectors.shape[0]

    def zeros(self) -> torch.Tensor:
        return torch.zeros_like(self.task_vectors[0])

    def wants_partial(self, kept: Kept) -> bool:
        d_in = self.task_vectors.shape[2]
        return wants_partial(kept, d_in if self.full_shape is None else self.full_shape[1], d_in)

    def projection(
        self, tau_init: TauInit, *, accurate: bool = False, partial: bool = False, leading: int | None = None
    ) -> Projection:
        eq = self._equation
        if not eq.n_experts:
            raise ValueError("no expert has a non-zero task vector: there is no spectrum (check n_experts first)")
        kind = "partial" if partial else "full"
        spectrum = self._spectrum(kind)
        if accurate and not spectrum.accurate:
            if ritz_pays(leading, spectrum):  # a top-K filter: its K directions refined, no second decomposition
                base, kind = spectrum, f"{kind}-ritz-{leading}"
                if kind not in self._spectra:
                    key = (id(self.task_vectors), self.task_vectors._version, self.full_shape, kind)
                    self._spectra[kind] = _shared(key, self.task_vectors, lambda: ritz_refined(eq, base, leading))
                spectrum = self._spectra[kind]
            else:
                kind, spectrum = "accurate", self._spectrum("accurate")
        if (tau_init, kind) not in self._projections:
            if tau_init not in self._starts:  # B = D - tau_init C at most once per start, whichever spectrum asks
                self._starts[tau_init] = RightHandSide(eq, initial_point(self.task_vectors, tau_init))
            self._projections[tau_init, kind] = fresh_projection(self._starts[tau_init], spectrum)
        return self._projections[tau_init, kind]

    def _spectrum(self, kind: str) -> Spectrum:
        """The ``kind`` spectrum (full, partial or accurate), decomposed once per layer (and shared within
        :func:`shared_decompositions`)."""
        if kind not in self._spectra:
            self._spectra[kind] = shared_spectrum(self.task_vectors, self._equation, self.full_shape, kind)
        return self._spectra[kind]


def needs_accurate(spectrum: Spectrum, filt: Filter) -> bool:
    """Whether ``filt`` would invert, without bound, eigenvalues that this (eigh) spectrum does not resolve
    (pseudoinverse, small Tikhonov alpha, a top-K cut below the floor): the merge then takes an accurate spectrum,
    the leading K refined by Rayleigh-Ritz through M for a top-K filter (:func:`~specmerge.linalg.ritz.ritz_pays`),
    else the SVD of M, which resolves them all."""
    return not spectrum.accurate and bool(_gains_and_dropped(spectrum, filt)[1].any())


def spectral_merge(
    task_vectors: torch.Tensor | LayerProjections,
    make_filter: Callable[[Spectrum], tuple[Filter, int | None]],
    tau_init: TauInit,
    scale: float,
    full_shape: tuple[int, int] | None = None,
    *,
    kept: Kept = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The one code path of every closed-form spectral method: ``(scale * tau_hat, diagnostics)``.

    ``make_filter(spectrum) -> (Filter, kept_rank or None)`` lets a rank rule look at the spectrum.
    The diagnostics are the spectrum's (:func:`spectrum_diagnostics`). With ``full_shape`` the task
    vectors are cores of larger layers (see :func:`~specmerge.linalg.spectrum.decompose`), and so is
    the result. No non-zero expert: zeros, unscaled. ``task_vectors`` may also be a layer's stored projections
    (:class:`LayerProjections`): the same filter step then runs on them, with no decomposition.

    ``kept`` says, before the decomposition, which directions the filter can keep: its leading K (a function of the
    layer's d_in, e.g. SWUDI's ceil(r d_in)), a rank rule's name (the leading K that rule reads off the eigenvalues)
    or None (any direction). A top-K filter then gets a partial spectrum where that pays (:func:`wants_partial`): every
    eigenvalue, and only the eigenvectors it keeps.
    """
    layer = FreshLayer(task_vectors, full_shape) if isinstance(task_vectors, torch.Tensor) else task_vectors
    if not layer.n_experts:
        return layer.zeros(), {"n_experts": 0, "kept_rank": 0}
    partial = layer.wants_partial(kept)
    p = layer.projection(tau_init, partial=partial)
    filt, k = make_filter(p.spectrum)
    if needs_accurate(p.spectrum, filt):  # the rank rule, if any, keeps the K it chose on the first spectrum
        p = layer.projection(tau_init, accurate=True, partial=partial, leading=k)
    gains = filt(p.spectrum.eigenvalues)
    tau_hat = solve(p, filt, k)
    diagnostics = spectrum_diagnostics(layer.n_experts, p.spectrum, k, gains)
    if p.spectrum.refined:  # the kept directions refined by Rayleigh-Ritz (a cut below eigh's floor)
        diagnostics["refined"] = True
    return scale * tau_hat, diagnostics


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
    """WUDI's normal equation of a stack and the (full) spectrum of its C (None when no expert is non-zero).

    Shared within :func:`shared_decompositions`; ``full_shape`` as in :func:`~specmerge.linalg.spectrum.decompose`.
    """
    eq = shared_equation(task_vectors)
    return eq, shared_spectrum(task_vectors, eq, full_shape, "full") if eq.n_experts else None


def shared_equation(task_vectors: torch.Tensor) -> NormalEquation:
    """:func:`~specmerge.linalg.quadratic.normal_equation` of the stack, shared within :func:`shared_decompositions`."""
    return _shared((id(task_vectors), task_vectors._version), task_vectors, lambda: normal_equation(task_vectors))


def shared_spectrum(
    task_vectors: torch.Tensor, eq: NormalEquation, full_shape: tuple[int, int] | None, kind: str
) -> Spectrum:
    """The ``kind`` spectrum of ``eq`` ("full", "partial" or "accurate": :func:`~specmerge.linalg.spectrum.decompose`),
    shared within :func:`shared_decompositions`: each kind is its own entry, so a sweep gets the bits of separate
    calls."""
    key = (id(task_vectors), task_vectors._version, full_shape, kind)
    return _shared(
        key, task_vectors, lambda: decompose(eq, full_shape, accurate=kind == "accurate", partial=kind == "partial")
    )


def _shared(key: tuple, task_vectors: torch.Tensor, make: Callable[[], Any]) -> Any:
    cache = _SHARED.get()
    if cache is not None and key in cache:
        return cache[key][1]
    value = make()
    if cache is not None:
        cache[key] = (task_vectors, value)  # the tensor is held so that its id stays unique
    return value


def spectrum_diagnostics(n_experts: int, spectrum: Spectrum, kept: int | None, gains: torch.Tensor) -> dict:
    """Per-layer figures: kept rank K, eigenvalue summary, energy kept, filter gain summary."""
    lam = spectrum.eigenvalues.double()
    total = float(lam.sum())
    k = spectrum.rank if kept is None else min(kept, spectrum.eigenvalues.numel())
    return {
        "n_experts": n_experts,
        "kept_rank": k,
        "numerical_rank": spectrum.rank,
        "spectrum_size": spectrum.eigenvalues.numel(),
        "lambda_max": float(lam[0]),
        "lambda_kept_min": float(lam[k - 1]) if k > 0 else None,
        "lambda_sum": total,
        "energy_kept": float(lam[:k].sum()) / total if total > 0 else 0.0,
        "mean_gain": float(gains[: spectrum.rank].double().mean()) if spectrum.rank else 0.0,
    }
