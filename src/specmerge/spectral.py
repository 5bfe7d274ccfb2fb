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

from specmerge import rank_rules
from specmerge.filters import Exponential, Filter, Landweber, PseudoInverse, Tikhonov, TopK
from specmerge.registry import Count, LayerResult, NonNegative, Positive, UnitInterval, register

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

    ``eigenvalues`` holds the min(n_rows, n_cols) squared singular values of M in descending order,
    those at or below ``tol`` set to exactly zero; ``eigenvectors`` holds only the ``rank`` columns
    of Q whose eigenvalue is above ``tol`` (the rest never receive gain).

    ``tol`` = n_cols eps lambda_1 (the usual numerical-rank cut) decides which directions are inverted.
    The rank rules instead see ``resolved``: the eigenvalues cut at sqrt(n_cols) eps lambda_1, about 3x
    the error the symmetric eigensolver actually makes. In float32 on a 768 x 3072 layer the first cut
    (3.7e-4 lambda_1) drops 270 real eigenvalues that float64 keeps and moves the psqrt rank from 606 to
    588; with the second the two precisions choose the same K (BENCHMARKS.md, issue 6).
    """

    eigenvalues: torch.Tensor
    eigenvectors: torch.Tensor
    n_rows: int
    n_cols: int
    tol: float
    resolved: torch.Tensor | None = None

    @property
    def rule_eigenvalues(self) -> torch.Tensor:
        """The eigenvalues the rank rules use (``resolved`` when known, else ``eigenvalues``)."""
        return self.eigenvalues if self.resolved is None else self.resolved

    @property
    def rank(self) -> int:
        return self.eigenvectors.shape[1]


def decompose(eq: NormalEquation, full_shape: tuple[int, int] | None = None) -> Spectrum:
    """Symmetric eigendecomposition of C, through the smaller of C (d_in^2) and M M^T ((N d_out)^2).

    Eigenvalues at or below d_in * eps * lambda_1 are treated as zero. ``full_shape`` = (d_out, d_in)
    of the real layer when ``eq`` holds small cores T_i with tau_i = P T_i R^T (P, R orthonormal, e.g.
    LoRA experts): C then has the same non-zero eigenvalues, padded here with the zeros the real
    min(N d_out, d_in) spectrum has, and d_in, N d_out are the real ones for rank rules and the tolerance.
    """
    n_rows, n_cols = eq.n_experts * eq.d_out, eq.d_in
    eps = torch.finfo(eq.D.dtype).eps
    if full_shape is not None:
        return _embed(decompose(eq), eq.n_experts * full_shape[0], full_shape[1], eps)
    if n_rows < n_cols:
        # C and M M^T share their non-zero eigenvalues; q_k = M^T u_k / sigma_k.
        M = eq.M
        lam, U = torch.linalg.eigh(M @ M.T)
        lam, U = lam.flip(0), U.flip(1)
        resolved = _resolved(lam, n_cols, eps)
        lam, tol, rank = _zero_small(lam, n_cols, eps)
        Q = (M.T @ U[:, :rank]) / lam[:rank].sqrt()
    else:
        lam, Q = torch.linalg.eigh(eq.C)
        lam, Q = lam.flip(0), Q.flip(1)
        resolved = _resolved(lam, n_cols, eps)
        lam, tol, rank = _zero_small(lam, n_cols, eps)
        Q = Q[:, :rank]
    return Spectrum(lam, Q, n_rows, n_cols, tol, resolved)


def _zero_small(lam: torch.Tensor, n_cols: int, eps: float) -> tuple[torch.Tensor, float, int]:
    """Descending eigenvalues with those at or below n_cols * eps * lambda_1 set to 0; the tolerance; the rank."""
    tol = n_cols * eps * float(lam[0].clamp(min=0)) if lam.numel() else 0.0
    lam = torch.where(lam > tol, lam, torch.zeros_like(lam))
    return lam, tol, int((lam > 0).sum())


def _resolved(lam: torch.Tensor, n_cols: int, eps: float) -> torch.Tensor:
    """Descending eigenvalues with those at or below sqrt(n_cols) * eps * lambda_1 set to 0 (see Spectrum)."""
    floor = math.sqrt(n_cols) * eps * float(lam[0].clamp(min=0)) if lam.numel() else 0.0
    return torch.where(lam > floor, lam, torch.zeros_like(lam))


def _embed(core: Spectrum, n_rows: int, n_cols: int, eps: float) -> Spectrum:
    """The spectrum of the real layer from that of its core: zeros appended, tolerances of the real d_in."""
    pad = max(0, min(n_rows, n_cols) - core.eigenvalues.numel())
    resolved = _resolved(core.rule_eigenvalues, n_cols, eps)
    lam, tol, rank = _zero_small(core.eigenvalues, n_cols, eps)
    padded, resolved = (torch.cat([x, x.new_zeros(pad)]) for x in (lam, resolved))
    return Spectrum(padded, core.eigenvectors[:, :rank], n_rows, n_cols, tol, resolved)


def filtered_solve(
    eq: NormalEquation, spectrum: Spectrum, gains: torch.Tensor, tau_init: torch.Tensor | None
) -> torch.Tensor:
    """tau_init + (D - tau_init C) Q diag(h / lambda) Q^T (paper Eq. 8) for filter gains h.

    Directions with zero gain or zero eigenvalue are skipped, and (tau_init C) Q is computed as
    (tau_init Q) diag(lambda), so a top-K filter costs O(d_out d_in K) after the decomposition.
    """
    rank = spectrum.rank
    lam = spectrum.eigenvalues[:rank]
    inverse_gain = gains[:rank] / lam
    active = inverse_gain != 0
    Q = spectrum.eigenvectors[:, active]
    projected = eq.D @ Q
    if tau_init is not None:
        projected = projected - (tau_init @ Q) * lam[active]
    update = (projected * inverse_gain[active]) @ Q.T
    return update if tau_init is None else tau_init + update


def choose_rank(rule: RankRule, spectrum: Spectrum) -> int:
    """K from a named rank rule applied to the spectrum of C."""
    lam = spectrum.rule_eigenvalues
    if rule == "psqrt":
        return rank_rules.psqrt_rank(lam)
    if rule == "gavish_donoho":
        return rank_rules.gavish_donoho_rank(lam, spectrum.n_rows, spectrum.n_cols)
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
    gains = filt(spectrum.eigenvalues)
    tau_hat = filtered_solve(eq, spectrum, gains, start)
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
    t: NonNegative = 1300.0,
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
