"""The WUDI normal equation tau C = D and the unified spectral filtering estimator.

Paper Sec. 3.2 and 4.1: for task vectors tau_i (d_out x d_in) with n_i = ||tau_i||_F^2,
A_i = tau_i^T tau_i / n_i, C = sum A_i, D = sum tau_i A_i, and for a filter h,
tau_hat = tau_init + (D - tau_init C) Q diag(h_k / lambda_k) Q^T (Eq. 8, Alg. 1).
SWUDI, SWUDI-A, the plain closed form D C^+ and the generic filter family are all one call of
:func:`filtered_solve` with a different filter.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal

import torch

from specmerge.linalg import rank_rules
from specmerge.linalg.filters import Exponential, Filter, Landweber, PseudoInverse, Tikhonov, TopK
from specmerge.methods.registry import (
    Count,
    LayerResult,
    NonNegative,
    NonNegativeOrInf,
    Positive,
    UnitInterval,
    register,
)

TauInit = Literal["sum", "mean", "zero"]
RankRule = Literal["psqrt", "gavish_donoho", "participation"]

WUDI_CITATION = "Cheng et al., Whoever Started the Interference Should End It (WUDI), ICML 2025"
PAPER_CITATION = "Closed-Form Spectral Merging (SWUDI / SWUDI-A), specmerge paper Sec. 4"


def expert_norms_sq(task_vectors: torch.Tensor) -> torch.Tensor:
    """n_i = ||tau_i||_F^2 for every expert, one dot product each (no squared copy of the stack)."""
    flat = task_vectors.reshape(task_vectors.shape[0], -1)
    return torch.stack([torch.dot(row, row) for row in flat]) if len(flat) else flat.new_zeros(0)


def nonzero_experts(task_vectors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts whose delta is not all zero, and their squared Frobenius norms n_i.

    Returns the input itself (no copy) when every expert is non-zero.
    """
    norms_sq = expert_norms_sq(task_vectors)
    keep = norms_sq > 0
    if bool(keep.all()):
        return task_vectors, norms_sq
    return task_vectors[keep], norms_sq[keep]


def initial_point(task_vectors: torch.Tensor, tau_init: TauInit) -> torch.Tensor | None:
    """tau_init: sum or mean over all N experts, or None for zero."""
    if tau_init == "sum":
        return task_vectors.sum(dim=0)
    if tau_init == "mean":
        return task_vectors.mean(dim=0)
    if tau_init == "zero":
        return None
    raise ValueError(f"tau_init must be 'sum', 'mean' or 'zero', got {tau_init!r}")


@dataclass(frozen=True)
class NormalEquation:
    """C and D of the WUDI loss for one layer (paper Eq. 4), built from the non-zero experts.

    ``M`` is the stacked normalised matrix [tau_1/sqrt(n_1); ...] of shape (N d_out) x d_in, so
    C = M^T M. C itself is formed only when asked for: the spectrum may come from M M^T instead.
    """

    tau: torch.Tensor  # (N_kept, d_out, d_in)
    norms_sq: torch.Tensor  # (N_kept,)
    D: torch.Tensor  # (d_out, d_in)

    @property
    def n_experts(self) -> int:
        return self.tau.shape[0]

    @property
    def d_out(self) -> int:
        return self.tau.shape[1]

    @property
    def d_in(self) -> int:
        return self.tau.shape[2]

    @functools.cached_property
    def M(self) -> torch.Tensor:
        return (self.tau / self.norms_sq.sqrt()[:, None, None]).reshape(-1, self.d_in)

    @functools.cached_property
    def C(self) -> torch.Tensor:
        # sum_i tau_i^T tau_i / n_i, one expert at a time: no (N d_out) x d_in copy of the stack
        C = self.tau.new_zeros(self.d_in, self.d_in)
        for tau_i, n_i in zip(self.tau, self.norms_sq, strict=True):
            C.addmm_(tau_i.T, tau_i, alpha=1 / float(n_i))
        return C

    def times_C(self, X: torch.Tensor) -> torch.Tensor:
        """X C, through whichever of C (d_in^2 per row of X) or M (2 N d_out d_in) is cheaper."""
        if 2 * self.n_experts * self.d_out < self.d_in and "C" not in self.__dict__:
            return (X @ self.M.T) @ self.M
        return X @ self.C

    def loss(self, tau: torch.Tensor) -> torch.Tensor:
        """The WUDI loss (paper Eq. 2), written directly."""
        return proxy_loss(tau, self.tau, self.tau, self.norms_sq)


def proxy_loss(tau: torch.Tensor, targets: torch.Tensor, proxies: torch.Tensor, norms_sq: torch.Tensor) -> torch.Tensor:
    """sum_i ||(tau - t_i) p_i^T||_F^2 / n_i; targets = proxies = tau_i is the WUDI loss (paper Eq. 2)."""
    residual = (tau - targets) @ proxies.transpose(1, 2)
    return (residual.pow(2).sum(dim=(1, 2)) / norms_sq).sum()


def normal_equation(task_vectors: torch.Tensor) -> NormalEquation:
    """Build D = sum tau_i A_i for the non-zero experts of an (N, d_out, d_in) stack.

    Each term is formed in the cheaper order, one expert at a time so the workspace is one small
    Gram: (tau_i tau_i^T) tau_i / n_i when d_out < d_in, else tau_i A_i, in which case the A_i are
    summed into C on the way (C is then needed anyway: N d_out >= d_in selects the C route).
    """
    if task_vectors.dim() != 3:
        raise ValueError(f"expected a stack N x d_out x d_in, got shape {tuple(task_vectors.shape)}")
    tau, norms_sq = nonzero_experts(task_vectors)
    d_out, d_in = task_vectors.shape[1:]
    D = task_vectors.new_zeros(d_out, d_in)
    C = task_vectors.new_zeros(d_in, d_in) if d_out >= d_in else None
    for tau_i, n_i in zip(tau, norms_sq, strict=True):
        if C is None:
            D += (tau_i @ tau_i.T) @ tau_i / n_i
        else:
            A_i = tau_i.T @ tau_i / n_i
            C += A_i
            D += tau_i @ A_i
    eq = NormalEquation(tau, norms_sq, D)
    if C is not None:
        eq.__dict__["C"] = C  # fill the cached property: same value as M^T M, already paid for
    return eq


@dataclass(frozen=True)
class Spectrum:
    """Eigendecomposition of C = M^T M.

    ``eigenvalues`` holds the min(n_rows, n_cols) squared singular values of M in descending order, those
    the decomposition does not resolve (at or below ``floor``, see :func:`resolution_floor`) set to exactly
    zero. It is the one view of the spectrum: the rank rules, the numerical ``rank`` and the diagnostics
    read it, so float32 and float64 choose the same K (a cut at the usual n_cols eps lambda_1 dropped 270
    real eigenvalues of a 768 x 3072 layer in float32 and moved the psqrt rank from 606 to 588:
    BENCHMARKS.md, issue 6).

    ``vectors`` holds eigenvectors (columns, same order): the N d_out of the row space of M from the SVD route,
    all d_in from eigh(C); ``eigenvectors`` are the ``rank`` resolved ones. ``computed`` holds the eigenvalue
    of every column as computed (clipped at 0, C being positive semi-definite; None means ``eigenvalues``):
    :func:`inverse_gains` still inverts an unresolved direction when the filter's gain does not depend on
    where in [0, floor] its eigenvalue really lies (SWUDI's h / lambda <= t), at its computed eigenvalue.
    ``accurate``: from the SVD of M (small eigenvalues accurate to eps sigma_1 sigma_k) rather than from
    eigh(C) (to eps lambda_1).
    """

    eigenvalues: torch.Tensor
    vectors: torch.Tensor
    n_rows: int
    n_cols: int
    floor: float = 0.0
    computed: torch.Tensor | None = None
    accurate: bool = False

    @functools.cached_property
    def rank(self) -> int:
        """The number of resolved (non-zero) eigenvalues: the numerical rank of C."""
        return int((self.eigenvalues > 0).sum())

    @property
    def eigenvectors(self) -> torch.Tensor:
        """The eigenvectors of the ``rank`` resolved eigenvalues (n_cols x rank)."""
        return self.vectors[:, : self.rank]

    @property
    def computed_eigenvalues(self) -> torch.Tensor:
        return self.eigenvalues if self.computed is None else self.computed


def decompose(eq: NormalEquation, full_shape: tuple[int, int] | None = None, *, accurate: bool = False) -> Spectrum:
    """Symmetric eigendecomposition of C, through the smaller of C (d_in^2) and the row space of M ((N d_out)^2).

    N d_out >= d_in: eigh(C), eigenvalues accurate to about eps lambda_1. N d_out < d_in, or ``accurate``:
    the SVD of M through a Householder QR (:func:`_singular_pairs`), so that the non-zero eigenpairs of C are
    (sigma^2, right singular vectors): orthonormal to working precision, small eigenvalues accurate to
    eps sigma_1 sigma_k. On wide layers that is one N d_out-sized SVD instead of a d_in-sized eigh: CPU time
    0.37x of eigh(C) at N d_out = d_in / 2, 0.6x at 5/8, 1.1-1.25x at 3/4 (kept there too: eigh(C) leaves the
    bottom of a spiked spectrum unresolved, and psqrt's sum then differs from float64's). The route it
    replaces, eigenvectors M^T u / sigma from those of M M^T, lost orthogonality as
    eps lambda_1 / (sigma_j sigma_k): 1e-2 in float32 with few experts. On tall layers the SVD costs about
    twice eigh(C) and forms M: :func:`spectral_merge` asks for it only for filters that must invert
    eigenvalues eigh(C) does not resolve.

    ``full_shape`` = (d_out, d_in) of the real layer when ``eq`` holds small cores T_i with tau_i = P T_i R^T
    (P, R orthonormal, e.g. LoRA experts): C then has the same non-zero eigenvalues, padded here with the
    zeros the real min(N d_out, d_in) spectrum has, and d_in, N d_out are the real ones for rank rules and
    the resolution floor.
    """
    n_rows, n_cols = eq.n_experts * eq.d_out, eq.d_in
    if full_shape is not None:
        return _embed(decompose(eq, accurate=accurate), eq.n_experts * full_shape[0], full_shape[1])
    if accurate or n_rows < n_cols:
        sigma, Q = _singular_pairs(eq.M)
        return _spectrum(sigma * sigma, Q, n_rows, n_cols, accurate=True)
    lam, Q = torch.linalg.eigh(eq.C)
    return _spectrum(lam.flip(0), Q.flip(1), n_rows, n_cols, accurate=False)


def _singular_pairs(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Singular values of M (descending) and its right singular vectors for them, via Householder QR.

    Wide M: M^T = Q_0 R, R = U S V^T, so M = V S (Q_0 U)^T. Tall M: M = Q_0 R, R = U S V^T, so M = (Q_0 U) S V^T.
    """
    if M.shape[0] < M.shape[1]:
        basis, R = torch.linalg.qr(M.T)
        U, S, _ = torch.linalg.svd(R)
        return S, basis @ U
    R = torch.linalg.qr(M, mode="r")[1]
    _, S, Vh = torch.linalg.svd(R)
    return S, Vh.T


def resolution_floor(eigenvalues: torch.Tensor, n_cols: int, accurate: bool) -> float:
    """The eigenvalue at or below which a decomposition does not resolve C's eigenvalues.

    Both are sqrt(n_cols) eps times the norm of the matrix decomposed, a few times the error each makes:
    eigh of C (or of R R^T) is backward stable in ||C||_2 = lambda_1, so sqrt(n_cols) eps lambda_1; the SVD
    of M in ||M||_F = sqrt(trace C), so sigma_k below sqrt(n_cols) eps ||M||_F, i.e. lambda_k below
    n_cols eps^2 sum(lambda). ``eigenvalues`` are the computed ones, descending, clipped at 0.
    """
    if eigenvalues.numel() == 0:
        return 0.0
    eps = torch.finfo(eigenvalues.dtype).eps
    if accurate:
        return n_cols * eps * eps * float(eigenvalues.sum())
    return math.sqrt(n_cols) * eps * float(eigenvalues[0])


def _spectrum(computed: torch.Tensor, vectors: torch.Tensor, n_rows: int, n_cols: int, accurate: bool) -> Spectrum:
    """The Spectrum of descending computed eigenvalues (one per column of ``vectors``, or fewer).

    ``eigenvalues`` are the first min(n_rows, n_cols), zero-padded to that many, with the unresolved ones
    zeroed; ``computed`` keeps them all, clipped at 0. When eigh(C) gives more (N d_out < d_in), the rest
    belong to C's null space in exact arithmetic, but in working precision the bottom of a spectrum that
    reaches the round-off mixes with them: the solve keeps them, like the paper's algorithm, and
    :func:`filtered_solve` skips those whose right-hand side is round-off.
    """
    m = min(n_rows, n_cols)
    computed = computed.clamp(min=0)
    if computed.numel() < m:
        computed = torch.cat([computed, computed.new_zeros(m - computed.numel())])
    floor = resolution_floor(computed, n_cols, accurate)
    head = computed[:m]
    resolved = torch.where(head > floor, head, torch.zeros_like(head))
    return Spectrum(resolved, vectors, n_rows, n_cols, floor, computed, accurate)


def _embed(core: Spectrum, n_rows: int, n_cols: int) -> Spectrum:
    """The spectrum of the real layer from that of its core: zeros appended, the floor of the real d_in."""
    return _spectrum(core.computed_eigenvalues, core.vectors, n_rows, n_cols, core.accurate)


def _directions(spectrum: Spectrum) -> tuple[torch.Tensor, torch.Tensor]:
    """The computed eigenvalue of each column of ``spectrum.vectors``, and whether it is resolved."""
    lam = spectrum.computed_eigenvalues[: spectrum.vectors.shape[1]]
    if spectrum.computed is None:  # a Spectrum built by hand: its eigenvalues are the resolved view
        return lam, lam > 0
    return lam, lam > spectrum.floor


def _gains_and_dropped(spectrum: Spectrum, filt: Filter) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse gains of the directions with an eigenvector, and which unresolved ones they leave out (see below)."""
    lam, resolved = _directions(spectrum)
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
    lam, _ = _directions(spectrum)
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
    residual = eq.D if tau_init is None else eq.D - _times_C_once(eq, tau_init)
    projected = residual @ Q
    if isinstance(gains, Filter):
        informative = projected.norm(dim=0) > _rounding_level(eq, spectrum, tau_init, lam, inverse, projected)
        if not bool(informative.all()):
            Q, projected, inverse = Q[:, informative], projected[:, informative], inverse[informative]
    update = (projected * inverse) @ Q.T
    return update if tau_init is None else tau_init + update


def _times_C_once(eq: NormalEquation, X: torch.Tensor) -> torch.Tensor:
    """X C for a single X: with C when it is formed already, else as (X M^T) M (C would cost n_rows d_in^2 first)."""
    return X @ eq.C if "C" in eq.__dict__ else (X @ eq.M.T) @ eq.M


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


def choose_rank(rule: RankRule, spectrum: Spectrum) -> int:
    """K from a named rank rule applied to the spectrum of C."""
    lam = spectrum.eigenvalues
    if rule == "psqrt":
        return rank_rules.psqrt_rank(lam)
    if rule == "gavish_donoho":
        # the noise level is the median of the values as computed: zeroing the unresolved ones would drag it
        # to 0 where the bottom of a noise bulk lies below the floor; only resolved values count as above it
        noise = spectrum.computed_eigenvalues[: lam.numel()]
        return rank_rules.gavish_donoho_rank(lam, spectrum.n_rows, spectrum.n_cols, median_of=noise)
    if rule == "participation":
        return rank_rules.participation_rank(lam)
    raise ValueError(f"unknown rank rule {rule!r}: use psqrt, gavish_donoho or participation")


def spectral_merge(
    task_vectors: torch.Tensor,
    make_filter: Callable[[Spectrum], tuple[Filter, int | None]],
    tau_init: TauInit,
    scale: float,
    full_shape: tuple[int, int] | None = None,
) -> LayerResult:
    """The one code path of every closed-form spectral method.

    ``make_filter(spectrum) -> (Filter, kept_rank or None)`` lets a rank rule look at the spectrum.
    Returns ``scale * tau_hat`` with the spectrum's diagnostics. With ``full_shape`` the task vectors
    are cores of larger layers (see :func:`decompose`), and so is the result.
    """
    start = initial_point(task_vectors, tau_init)
    eq, spectrum = _equation_and_spectrum(task_vectors, full_shape)
    if spectrum is None:
        return LayerResult(torch.zeros_like(task_vectors[0]), {"n_experts": 0, "kept_rank": 0})
    filt, kept = make_filter(spectrum)
    if not spectrum.accurate and bool(_gains_and_dropped(spectrum, filt)[1].any()):
        # the filter inverts eigenvalues eigh(C) does not resolve without bound (pseudoinverse, small
        # Tikhonov alpha): decompose again through the SVD of M, which resolves them (the rank rule,
        # if any, keeps the K it chose on the first spectrum)
        spectrum = _accurate_spectrum(task_vectors, eq, full_shape)
    gains = filt(spectrum.eigenvalues)
    tau_hat = filtered_solve(eq, spectrum, filt, start)
    return LayerResult(scale * tau_hat, spectrum_diagnostics(eq, spectrum, kept, gains))


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


def _equation_and_spectrum(
    task_vectors: torch.Tensor, full_shape: tuple[int, int] | None
) -> tuple[NormalEquation, Spectrum | None]:
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
    """decompose(eq, accurate=True), shared like :func:`_equation_and_spectrum` within shared_decompositions()."""
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


@register("swudi", citation=PAPER_CITATION)
def swudi(
    task_vectors: torch.Tensor,
    *,
    rank_ratio: UnitInterval = 0.65,
    t: NonNegativeOrInf = 1300.0,
    tau_init: TauInit = "sum",
    scale: float = 1.0,
    full_shape: tuple[int, int] | None = None,
) -> LayerResult:
    """SWUDI: top-ceil(r d_in) truncation times the exponential filter 1 - exp(-t lambda) (paper Eq. 11).

    Args:
        rank_ratio: r in [0, 1]; keeps K = ceil(r * d_in) leading eigendirections (paper grid 0.55-0.85).
        t: gradient-flow time of the exponential filter (paper grid 300-1800; CLIP 1300); inf for none.
        tau_init: point the filter starts from: sum or mean of the task vectors, or zero (D C_h^+).
        scale: s in merged = W_0 + s * tau_hat.
    """

    def make_filter(spectrum: Spectrum) -> tuple[Filter, int]:
        k = rank_rules.fixed_ratio_rank(rank_ratio, spectrum.n_cols)
        return TopK(k) * Exponential(t), k

    return spectral_merge(task_vectors, make_filter, tau_init, scale, full_shape)


@register("swudi_a", citation=PAPER_CITATION)
def swudi_a(
    task_vectors: torch.Tensor,
    *,
    rule: RankRule = "psqrt",
    tau_init: TauInit = "sum",
    scale: float = 1.0,
    full_shape: tuple[int, int] | None = None,
) -> LayerResult:
    """SWUDI-A: hard top-K truncation with K chosen per layer by a rank rule (paper Sec. 4.2).

    Args:
        rule: psqrt (CLIP, Flan-T5, MLLMs), gavish_donoho (full fine-tuned LLMs; may keep K = 0), or participation.
        tau_init: point the filter starts from: sum or mean of the task vectors, or zero (D C_h^+).
        scale: s in merged = W_0 + s * tau_hat.
    """

    def make_filter(spectrum: Spectrum) -> tuple[Filter, int]:
        k = choose_rank(rule, spectrum)
        return TopK(k), k

    result = spectral_merge(task_vectors, make_filter, tau_init, scale, full_shape)
    result.diagnostics["rule"] = rule
    return result


@register("closed_form", citation=PAPER_CITATION)
def closed_form(
    task_vectors: torch.Tensor,
    *,
    tau_init: TauInit = "zero",
    scale: float = 1.0,
    full_shape: tuple[int, int] | None = None,
) -> LayerResult:
    """Exact minimiser of the WUDI loss: D C^+ (paper Eq. 6), or tau_init + (D - tau_init C) C^+.

    Args:
        tau_init: zero gives the minimum-norm solution D C^+; sum or mean keep that start on the null space of C.
        scale: s in merged = W_0 + s * tau_hat.
    """
    return spectral_merge(task_vectors, lambda s: (PseudoInverse(), None), tau_init, scale, full_shape)


@register("spectral_filter", citation=PAPER_CITATION)
def spectral_filter(
    task_vectors: torch.Tensor,
    *,
    filter: Literal["pinv", "exponential", "landweber", "tikhonov"] = "exponential",
    t: NonNegative = 300.0,
    eta: Positive = 0.1,
    steps: Count = 300,
    alpha: Positive = 1e-3,
    rank: Literal["all", "ratio", "psqrt", "gavish_donoho", "participation"] = "all",
    rank_ratio: UnitInterval = 1.0,
    tau_init: TauInit = "sum",
    scale: float = 1.0,
    full_shape: tuple[int, int] | None = None,
) -> LayerResult:
    """Any member of the filter family, optionally times a top-K mask, for studies and sweeps.

    Args:
        filter: soft filter: pinv (h = 1), exponential (1 - exp(-t lambda)),
            landweber (1 - (1 - eta lambda)^steps), tikhonov (lambda / (lambda + alpha)).
        t: time of the exponential filter.
        eta: Landweber step size; stable for eta < 2 / lambda_max (lambda_max <= N).
        steps: number of Landweber steps.
        alpha: Tikhonov ridge.
        rank: hard mask: all directions, a fixed ratio of d_in, or a rank rule.
        rank_ratio: r for rank = ratio: K = ceil(r * d_in).
        tau_init: point the filter starts from: sum or mean of the task vectors, or zero (D C_h^+).
        scale: s in merged = W_0 + s * tau_hat.
    """
    soft: Filter = {
        "pinv": PseudoInverse(),
        "exponential": Exponential(t),
        "landweber": Landweber(eta, steps),
        "tikhonov": Tikhonov(alpha),
    }[filter]

    def make_filter(spectrum: Spectrum) -> tuple[Filter, int | None]:
        if rank == "all":
            return soft, None
        k = rank_rules.fixed_ratio_rank(rank_ratio, spectrum.n_cols) if rank == "ratio" else choose_rank(rank, spectrum)
        return TopK(k) * soft, k

    return spectral_merge(task_vectors, make_filter, tau_init, scale, full_shape)
