"""The spectrum of C in the normal equation tau C = D, as a merge uses it (paper Sec. 4.1).

:func:`decompose` gives the eigenpairs of C through the cheaper and more accurate of eigh(C) and the SVD
of M (C = M^T M), with the eigenvalues it does not resolve marked (:func:`resolution_floor`); the rank
rules read the resolved ones (:func:`choose_rank`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from specmerge.linalg import eigensolver, rank_rules
from specmerge.linalg.eigensolver import Reduction
from specmerge.linalg.quadratic import NormalEquation

RankRule = Literal["psqrt", "gavish_donoho", "participation"]


@dataclass(frozen=True)
class Spectrum:
    """Eigendecomposition of C = M^T M.

    ``eigenvalues`` holds the min(n_rows, n_cols) squared singular values of M in descending order, those
    the decomposition does not resolve (at or below ``floor``, see :func:`resolution_floor`) set to exactly
    zero. It is the one view of the spectrum: the rank rules, the numerical ``rank`` and the diagnostics
    read it, so float32 and float64 choose the same K (a cut at the usual n_cols eps lambda_1 dropped 270
    real eigenvalues of a 768 x 3072 layer in float32 and moved the psqrt rank from 606 to 588:
    BENCHMARKS.md, issue 6).

    ``vectors`` holds eigenvectors (columns, same order): the N d_out of the row space of M from the SVD route
    (min(N d_out, d_in) from the GPU's float64 eigh), all d_in from eigh(C). A partial spectrum (``reduction``,
    :mod:`specmerge.linalg.eigensolver`) holds none: it has every eigenvalue and computes the leading k eigenvectors
    when first asked for (:meth:`leading`), so a top-K merge pays for K of them, not d_in. ``eigenvectors`` are the
    ``rank`` resolved ones. ``computed`` holds the eigenvalue of every column as computed (clipped at 0, C being
    positive semi-definite; None means ``eigenvalues``): :func:`~specmerge.linalg.solve.inverse_gains` still inverts
    an unresolved direction when the filter's gain does not depend on where in [0, floor] its eigenvalue really lies
    (SWUDI's h / lambda <= t), at its computed eigenvalue. ``accurate``: from the SVD of M (small eigenvalues
    accurate to eps sigma_1 sigma_k) or the GPU's float64 eigh (to eps_64 lambda_1), rather than from eigh(C) or the
    reduction of C (to eps lambda_1).
    """

    eigenvalues: torch.Tensor
    vectors: torch.Tensor | None
    n_rows: int
    n_cols: int
    floor: float = 0.0
    computed: torch.Tensor | None = None
    accurate: bool = False
    reduction: Reduction | None = None
    error: float | None = None  # the round-off measured on the computed eigenvalues (None: not measured)
    refined: bool = False  # vectors: the leading k only, made accurate by Rayleigh-Ritz (ritz_refined)
    _leading: dict[int, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    @functools.cached_property
    def rule_eigenvalues(self) -> torch.Tensor:
        """The eigenvalues the rank rules read: as computed, zeroed at or below the round-off this decomposition
        showed (``rule_floor``) rather than the a-priori ``floor``.

        The floor bounds the error of any eigenvalue, and what the filter inverts must be above it. A rank rule only
        counts and sums eigenvalues: zeroing the part of a noise bulk that lies below the floor but well above the
        round-off moved float32's psqrt K from float64's 499 to 491 on fc2-shaped experts (issue 23), and a plain
        float32 eigh implementation that reads every computed eigenvalue gets 499.
        """
        if self.computed is None or self.accurate:
            return self.eigenvalues
        head = self.computed[: self.eigenvalues.numel()]
        return torch.where(head > self.rule_floor, head, torch.zeros_like(head))

    @property
    def rule_floor(self) -> float:
        """min(floor, 2 x the round-off measured on this decomposition, at least eps lambda_1): the computed
        eigenvalues of a positive semi-definite C that come out negative show how large the error is (C's null
        space on rank-deficient layers: about half of them), and none do where every eigenvalue is resolved. The
        floor itself where nothing was measured (a spectrum built by hand) or for the SVD route."""
        return self.floor if self.accurate or self.error is None else min(self.floor, 2 * self.error)

    @functools.cached_property
    def rank(self) -> int:
        """The number of resolved (non-zero) eigenvalues: the numerical rank of C."""
        return int((self.eigenvalues > 0).sum())

    @property
    def n_vectors(self) -> int:
        """How many directions have an eigenvector (computed, or to compute from the reduction)."""
        return self.reduction.size if self.vectors is None else self.vectors.shape[1]

    @property
    def vector_length(self) -> int:
        """The length of an eigenvector: n_cols of the matrix decomposed (of the cores, for LoRA experts)."""
        return self.reduction.size if self.vectors is None else self.vectors.shape[0]

    @property
    def partial(self) -> bool:
        """Whether the eigenvectors come from a reduction, the leading k at a time (:meth:`basis`)."""
        return self.vectors is None

    def basis(self, k: int) -> tuple[int, torch.Tensor]:
        """The computed eigenvectors that hold the leading k, and their count: ``vectors`` (all of them) for a full
        spectrum; from a reduction, the leading k by MRRR while that is the cheaper way, else all of them
        (:func:`~specmerge.linalg.eigensolver.mrrr_pays`). The same k gives the same bits, and a partial spectrum
        keeps the last LEADING_KEPT sets it computed."""
        if self.vectors is not None:
            return self.vectors.shape[1], self.vectors
        count = self.basis_count(k)
        if count not in self._leading:
            self._leading[count] = self.reduction.leading_vectors(count)
            for old in list(self._leading)[:-LEADING_KEPT]:
                del self._leading[old]
        return count, self._leading[count]

    def basis_count(self, k: int) -> int:
        """How many eigenvectors :meth:`basis` computes for the leading k (k itself by MRRR, or all of them)."""
        if self.vectors is not None:
            return self.vectors.shape[1]
        return eigensolver.vectors_computed(k, self.reduction.size)

    def kept_bases(self) -> list[int]:
        """The counts of the sets of eigenvectors a partial spectrum holds now (see :meth:`basis`)."""
        return list(self._leading)

    def leading(self, k: int) -> torch.Tensor:
        """The eigenvectors of the k leading directions (vector_length x k)."""
        return self.basis(k)[1][:, :k]

    def columns(self, index: torch.Tensor, leading: int | None = None) -> torch.Tensor:
        """The eigenvectors of the directions ``index`` (ascending), from :meth:`basis` for the ``leading`` leading
        directions (default index[-1] + 1): the same vectors :class:`~specmerge.linalg.projection.Projection`
        projects on."""
        return self.basis(prefix(index) if leading is None else leading)[1][:, index]

    @property
    def eigenvectors(self) -> torch.Tensor:
        """The eigenvectors of the ``rank`` resolved eigenvalues (vector_length x rank)."""
        return self.leading(self.rank)

    @property
    def computed_eigenvalues(self) -> torch.Tensor:
        return self.eigenvalues if self.computed is None else self.computed


LEADING_KEPT = 2  # sets of eigenvectors a partial spectrum keeps (each vector_length x count)


def float64_spectra(device: torch.device) -> bool:
    """Whether a float32 layer on ``device`` is decomposed in float64 (:func:`decompose`): on a CUDA GPU that runs
    float64 at half the float32 rate or better, the data-centre parts of compute capability 6.0, 7.0, 8.0, 9.0 and
    10.0 (P100, V100, A100, H100 / H200, B200); others run it at 1/32 to 1/64 of the rate.

    Measured on an H200 (BENCHMARKS "The GPU: decompositions in float64"): eigh of a float64 C costs what float32
    does up to d = 8192 (0.54 s against 0.66 s) and 1.44x at 18944; SWUDI-A lies 40x closer to its float64
    merge (1.2e-5 against 4.9e-4 on a 768 x 3072 fc2 layer; the CPU's float32 gives 1.6e-5); and on wide layers
    it replaces the SVD route, whose cuSOLVER SVD took 35.7 s where eigh(C) takes 3.6 s (Qwen2-7B's down_proj).
    """
    if device.type != "cuda":
        return False
    major, minor = torch.cuda.get_device_capability(device)
    return major >= 6 and minor == 0


def prefix(index: torch.Tensor) -> int:
    """How many leading directions hold the directions ``index`` (ascending): index[-1] + 1, 0 for none."""
    return int(index[-1]) + 1 if index.numel() else 0


def decompose(
    eq: NormalEquation, full_shape: tuple[int, int] | None = None, *, accurate: bool = False, partial: bool = False
) -> Spectrum:
    """Symmetric eigendecomposition of C, through the smaller of C (d_in^2) and the row space of M ((N d_out)^2).

    N d_out >= d_in: eigh(C), eigenvalues accurate to about eps lambda_1. N d_out < d_in, or ``accurate``:
    the SVD of M through a Householder QR (:func:`singular_pairs`), so that the non-zero eigenpairs of C are
    (sigma^2, right singular vectors): orthonormal to working precision, small eigenvalues accurate to
    eps sigma_1 sigma_k. On wide layers that is one N d_out-sized SVD instead of a d_in-sized eigh: CPU time
    0.37x of eigh(C) at N d_out = d_in / 2, 0.6x at 5/8, 1.1-1.25x at 3/4 (kept there too: eigh(C) leaves the
    bottom of a spiked spectrum unresolved, and psqrt's sum then differs from float64's). The route it
    replaces, eigenvectors M^T u / sigma from those of M M^T, lost orthogonality as
    eps lambda_1 / (sigma_j sigma_k): 1e-2 in float32 with few experts. On tall layers the SVD costs about
    twice eigh(C) and forms M: :func:`specmerge.linalg.solve.spectral_merge` asks for it only for filters
    that must invert eigenvalues eigh(C) does not resolve.

    ``full_shape`` = (d_out, d_in) of the real layer when ``eq`` holds small cores T_i with tau_i = P T_i R^T
    (P, R orthonormal, e.g. LoRA experts): C then has the same non-zero eigenvalues, padded here with the
    zeros the real min(N d_out, d_in) spectrum has, and d_in, N d_out are the real ones for rank rules and
    the resolution floor.

    On a GPU with fast float64 (:func:`float64_spectra`), a float32 layer takes neither: C is formed and decomposed in
    float64 (:func:`_float64_spectrum`, accurate), whatever the shape.

    ``partial`` (the caller keeps only leading directions, and it pays: :func:`~specmerge.linalg.eigensolver.pays`):
    on the eigh(C) route, C is reduced once (:func:`~specmerge.linalg.eigensolver.reduce`) with every eigenvalue,
    and eigenvectors are computed only as the solve asks for them (a partial :class:`Spectrum`).
    """
    n_rows, n_cols = eq.n_experts * eq.d_out, eq.d_in
    if full_shape is not None:
        core = decompose(eq, accurate=accurate, partial=partial)
        return _embed(core, eq.n_experts * full_shape[0], full_shape[1])
    matrix = eigh_input(eq, accurate=accurate, partial=partial)
    if matrix is not None:
        return from_eigh(eq, *torch.linalg.eigh(matrix))
    if accurate or n_rows < n_cols:
        sigma, Q = singular_pairs(eq.M)
        return _spectrum(sigma * sigma, Q, n_rows, n_cols, accurate=True)
    reduction = eigensolver.reduce(eq.C)
    return _spectrum(reduction.eigenvalues.to(eq.C.dtype), None, n_rows, n_cols, False, reduction)


def eigh_input(eq: NormalEquation, *, accurate: bool = False, partial: bool = False) -> torch.Tensor | None:
    """The symmetric matrix :func:`decompose` hands to ``torch.linalg.eigh`` for this request (a layer's own stack,
    not LoRA cores), or None where it takes another route: C in float64 on a GPU with fast float64
    (:func:`float64_spectra`), else C itself unless the SVD of M (``accurate``, or N d_out < d_in) or the reduction
    (``partial`` where :func:`~specmerge.linalg.eigensolver.solves`) is taken. :func:`decompose_batch` stacks these
    for several layers of one shape."""
    if eq.tau.dtype == torch.float32 and float64_spectra(eq.tau.device):
        return eq.gram(torch.float64)
    if accurate or eq.n_experts * eq.d_out < eq.d_in or (partial and eigensolver.solves(eq.C)):
        return None
    return eq.C


def from_eigh(eq: NormalEquation, lam: torch.Tensor, Q: torch.Tensor) -> Spectrum:
    """:func:`decompose`'s spectrum from ``torch.linalg.eigh(eigh_input(eq))`` (ascending, as eigh returns them): C's
    own (eigenvalues to about eps lambda_1), or float64's leading min(N d_out, d_in) pairs cast back to the layer's
    dtype (:func:`_float64_spectrum`)."""
    n_rows, n_cols = eq.n_experts * eq.d_out, eq.d_in
    if lam.dtype != eq.tau.dtype:
        return _float64_spectrum(eq, n_rows, n_cols, lam, Q)
    return _spectrum(lam.flip(0), Q.flip(1), n_rows, n_cols, accurate=False)


def decompose_batch(
    equations: Sequence[NormalEquation], *, partial: Sequence[bool] | None = None
) -> list[Spectrum] | None:
    """:func:`decompose` of several layers' equations (one shape, dtype and device) through one batched eigh, the
    same spectra as one call per layer (``torch.linalg.eigh`` on a stack decomposes each matrix as alone); None where
    some layer takes another route than eigh (:func:`eigh_input`). ``partial``: what each layer's filter asks for.
    Memory: the stacked matrices, their eigenvectors and eigh's workspace for every layer at once."""
    wanted = [False] * len(equations) if partial is None else list(partial)
    matrices = [eigh_input(eq, partial=p) for eq, p in zip(equations, wanted, strict=True)]
    if not matrices or any(m is None for m in matrices) or len({(m.shape, m.dtype) for m in matrices}) > 1:
        return None
    stacked = torch.stack(matrices)
    del matrices
    lam, Q = torch.linalg.eigh(stacked)
    del stacked
    return [from_eigh(eq, lam[i], Q[i]) for i, eq in enumerate(equations)]


def singular_pairs(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


def _float64_spectrum(
    eq: NormalEquation, n_rows: int, n_cols: int, lam: torch.Tensor | None = None, Q: torch.Tensor | None = None
) -> Spectrum:
    """eigh of C formed in float64, the leading min(n_rows, n_cols) pairs cast back to the layer's dtype.

    C = sum_i X_i^T X_i / n_i over the experts (or their proxies) X_i, each cast to float64 in turn: one expert's
    float64 copy at a time, never M's. Its eigenvalues are accurate to about eps_64 lambda_1, below the float32
    SVD's eps_32 sigma_1 sigma_k for every sigma_k above 1e-9 sigma_1, and its vectors orthonormal to float32's
    rounding: it is marked ``accurate``, and serves the filters that ask for the SVD route too (one decomposition,
    tall and wide layers alike).
    """
    if lam is None or Q is None:
        lam, Q = torch.linalg.eigh(eq.gram(torch.float64))
    m = min(n_rows, n_cols)
    lam, Q = lam.flip(0)[:m].to(eq.tau.dtype), Q.flip(1)[:, :m].to(eq.tau.dtype)
    return _spectrum(lam, Q, n_rows, n_cols, accurate=True)


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


def _spectrum(
    computed: torch.Tensor,
    vectors: torch.Tensor | None,
    n_rows: int,
    n_cols: int,
    accurate: bool,
    reduction: Reduction | None = None,
    error: float | None = None,
) -> Spectrum:
    """The Spectrum of descending computed eigenvalues (one per column of ``vectors``, or fewer).

    ``error``: the round-off of the computed eigenvalues (see :attr:`Spectrum.rule_floor`), measured here on them
    as they come from the solver (negatives included) unless given.

    ``eigenvalues`` are the first min(n_rows, n_cols), zero-padded to that many, with the unresolved ones
    zeroed; ``computed`` keeps them all, clipped at 0. When eigh(C) gives more (N d_out < d_in), the rest
    belong to C's null space in exact arithmetic, but in working precision the bottom of a spectrum that
    reaches the round-off mixes with them: the solve keeps them, like the paper's algorithm, and
    :func:`~specmerge.linalg.solve.filtered_solve` skips those whose right-hand side is round-off.
    """
    m = min(n_rows, n_cols)
    lowest = float(computed.min()) if computed.numel() else 0.0
    computed = computed.clamp(min=0)
    if computed.numel() < m:
        computed = torch.cat([computed, computed.new_zeros(m - computed.numel())])
    floor = resolution_floor(computed, n_cols, accurate)
    head = computed[:m]
    resolved = torch.where(head > floor, head, torch.zeros_like(head))
    top = float(computed[0]) if computed.numel() else 0.0
    error = max(torch.finfo(computed.dtype).eps * top, -lowest) if error is None else error
    return Spectrum(resolved, vectors, n_rows, n_cols, floor, computed, accurate, reduction, error)


def _embed(core: Spectrum, n_rows: int, n_cols: int) -> Spectrum:
    """The spectrum of the real layer from that of its core: zeros appended, the floor of the real d_in."""
    return _spectrum(core.computed_eigenvalues, core.vectors, n_rows, n_cols, core.accurate, core.reduction, core.error)


def directions(spectrum: Spectrum) -> tuple[torch.Tensor, torch.Tensor]:
    """The computed eigenvalue of each direction with an eigenvector (``n_vectors``), and whether it is resolved."""
    lam = spectrum.computed_eigenvalues[: spectrum.n_vectors]
    if spectrum.computed is None:  # a Spectrum built by hand: its eigenvalues are the resolved view
        return lam, lam > 0
    return lam, lam > spectrum.floor


def choose_rank(rule: RankRule, spectrum: Spectrum) -> int:
    """K from a named rank rule applied to the spectrum of C (its :attr:`~Spectrum.rule_eigenvalues`)."""
    lam = spectrum.rule_eigenvalues
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
