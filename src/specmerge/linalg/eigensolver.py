"""A partial symmetric eigensolver: every eigenvalue, only the leading eigenvectors (issue 23).

A top-K spectral merge reads all d eigenvalues of C (the rank rules) but only K eigenvectors (SWUDI-A keeps
3-16 % of them on real layers), while ``torch.linalg.eigh`` computes all d. Here one Householder reduction
C = H T H^T to a symmetric tridiagonal T (LAPACK ``?sytrd``, in C's dtype, BLAS-3 for half its flops) is shared by:

- every eigenvalue of T, by the root-free QL/QR iteration (``dsterf``, O(d^2), in float64);
- the k leading eigenvectors of T, by MRRR (``dstemr``, O(d k), in float64: orthogonal to float64 working
  accuracy, so the only float32 error left in a kept vector is that of the reduction and the back-transform);
- their back-transform H z by the reflectors (``ormqr``, 4 d^2 k flops).

Past a crossover in k / d (:func:`mrrr_pays`) the leading k come from all d eigenvectors of T instead, by divide
and conquer (``dstevd``) and one back-transform: what eigh itself does after its reduction, at eigh's cost.
Whether to reduce at all (:func:`pays`): below PARTIAL_MIN_SIZE, or when the k kept is known and past the
crossover, eigh is as fast or faster. Measured on 2 cores (BENCHMARKS.md, issue 23): the reduction costs
0.36-0.45 of eigh for d >= 1024, the k vectors by MRRR about (0.7-1.3) k / d of it.

The eigenvalues are those of T as computed in float64, cast to C's dtype: backward stable in ||C||_2, like eigh's.
:meth:`Reduction.leading_vectors` is a function of (the reduction, k): the same k gives the same bits, so a
setting re-synthesized from a stored reduction equals a fresh merge. CPU only (LAPACK through SciPy); OpenBLAS's
threads are held to torch's count for the call, so a merge's thread budget holds.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

PARTIAL_MIN_SIZE = 1024  # below, eigh is as fast as the reduction with a few vectors (SciPy's call overheads)


CROSSOVER_REFERENCE = 1024  # the d at which the measured crossover below starts (0.25)


def crossover(d: int) -> float:
    """The k / d up to which MRRR's k vectors cost less than all d by divide and conquer after the reduction:
    measured 0.25 at d = 1024-1536, 0.4 at 2048, 0.5 at 3072, 0.7 at 8192 (2 cores, float32), which
    0.25 + 0.15 log2(d / 1024), capped at 0.7, follows (0.25 below 1024, where only a lowered PARTIAL_MIN_SIZE
    asks: the tests' small layers)."""
    if d < PARTIAL_MIN_SIZE:
        return 0.0
    return min(0.7, 0.25 + 0.15 * math.log2(max(d, CROSSOVER_REFERENCE) / CROSSOVER_REFERENCE))


def mrrr_pays(k: int, d: int) -> bool:
    """Whether the leading k of d eigenvectors are computed alone (MRRR) rather than all d (divide and conquer)."""
    return k <= crossover(d) * d


def vectors_computed(k: int, d: int) -> int:
    """How many eigenvectors a partial spectrum computes for the leading k of d: k by MRRR, or all d."""
    return k if mrrr_pays(k, d) else d


# Shares of eigh(C)'s time, measured on 2 cores in float32 (bench/partial_eigensolver.py, BENCHMARKS.md): the
# reduction with every eigenvalue 0.36-0.45 for d >= 1024; the k vectors by MRRR and their back-transform about
# 1.2 k / d for d up to 4096 (0.7 at 8192); all d of them by divide and conquer 0.6.
REDUCTION_SHARE, VECTORS_SHARE, ALL_VECTORS_SHARE = 0.42, 1.2, 0.62


def cost_share(k: int, d: int) -> float:
    """The time of the reduction and the k leading vectors as a share of eigh's on the same d x d matrix (for the
    cost model: :func:`specmerge.pipeline.estimate.cost.price`)."""
    vectors = VECTORS_SHARE * k / d if mrrr_pays(k, d) else ALL_VECTORS_SHARE
    return REDUCTION_SHARE + min(vectors, ALL_VECTORS_SHARE)


def pays(kept: int | Literal["rule"] | None, d: int) -> bool:
    """Whether reducing a d x d C beats eigh for a filter keeping ``kept`` leading directions: a count known
    before the decomposition (SWUDI's ceil(r d)), "rule" (a rank rule picks it from the eigenvalues: on real
    layers 3-16 % of d, at most about eigh's cost when it is large) or None (every direction: eigh)."""
    if kept is None or d < PARTIAL_MIN_SIZE:
        return False
    return kept == "rule" or mrrr_pays(kept, d)


def solves(C: torch.Tensor) -> bool:
    """Whether this solver takes C: a float32 or float64 CPU matrix of at least PARTIAL_MIN_SIZE (the GPU keeps
    torch's eigh)."""
    return C.device.type == "cpu" and C.dtype in (torch.float32, torch.float64) and C.shape[0] >= PARTIAL_MIN_SIZE


@functools.cache
def _controller():  # inspecting the loaded libraries takes milliseconds: once per process
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


_LIMIT_LOCK = threading.Lock()
_limit_users = 0
_limiter = None


@contextlib.contextmanager
def blas_threads() -> Iterator[None]:
    """SciPy's BLAS limited to torch's thread count (a worker of a parallel merge runs with 1) for the block.

    The limit is process-wide (OpenBLAS has one thread count): the first of concurrent callers sets it and the last
    to leave restores it, so workers running at once never restore it under each other's calls."""
    global _limit_users, _limiter
    with _LIMIT_LOCK:
        if _limit_users == 0:
            _limiter = _controller().limit(limits=torch.get_num_threads(), user_api="blas")
        _limit_users += 1
    try:
        yield
    finally:
        with _LIMIT_LOCK:
            _limit_users -= 1
            if _limit_users == 0:
                _limiter.restore_original_limits()
                _limiter = None


@dataclass(frozen=True)
class Reduction:
    """C = H T H^T: T by its ``diagonal`` and ``off_diagonal`` (float64), H by the Householder ``reflectors``
    (d x d, C's dtype, as ?sytrd leaves them below the sub-diagonal: column i holds v_i, H = H_1 ... H_{d-1},
    H_i = I - tau_i v_i v_i^T) and their ``tau``; ``eigenvalues``: every eigenvalue of T, descending, float64."""

    reflectors: torch.Tensor
    tau: torch.Tensor
    diagonal: torch.Tensor
    off_diagonal: torch.Tensor
    eigenvalues: torch.Tensor

    @property
    def size(self) -> int:
        return self.diagonal.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.reflectors.dtype

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that define the reduction (what a spectral cache stores; :meth:`from_tensors` reads them)."""
        return {
            "reflectors": self.reflectors,
            "tau": self.tau,
            "diagonal": self.diagonal,
            "off_diagonal": self.off_diagonal,
            "tridiagonal_eigenvalues": self.eigenvalues,
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> Reduction:
        return cls(
            tensors["reflectors"],
            tensors["tau"],
            tensors["diagonal"],
            tensors["off_diagonal"],
            tensors["tridiagonal_eigenvalues"],
        )

    def leading_vectors(self, k: int) -> torch.Tensor:
        """The eigenvectors of the k largest eigenvalues (d x k, C's dtype, columns in descending eigenvalue order)."""
        return _leading_vectors(self, k)


def reduce(C: torch.Tensor) -> Reduction:
    """The tridiagonal reduction of a symmetric float32 or float64 CPU matrix (its lower triangle is read) and
    every eigenvalue. C is not modified."""
    if C.dim() != 2 or C.shape[0] != C.shape[1]:
        raise ValueError(f"expected a square matrix, got shape {tuple(C.shape)}")
    if C.dtype not in (torch.float32, torch.float64) or C.device.type != "cpu":
        raise TypeError(f"the partial eigensolver takes float32 or float64 CPU matrices, got {C.dtype} on {C.device}")
    d = C.shape[0]
    if d <= 1:  # ?sytrd needs no reflector; T is C
        diagonal = C.detach().reshape(-1).double().clone()
        empty = C.new_zeros(0)
        return Reduction(C.detach().clone(), empty, diagonal, diagonal.new_zeros(0), diagonal.clone())
    from scipy.linalg import lapack

    single = C.dtype == torch.float32
    sytrd, sytrd_lwork = (lapack.ssytrd, lapack.ssytrd_lwork) if single else (lapack.dsytrd, lapack.dsytrd_lwork)
    # C.numpy().T is C in Fortran order (C is symmetric): ?sytrd gets its own copy (overwrite_a=0)
    a = C.detach().numpy().T
    work, info = sytrd_lwork(d, lower=1)
    _check("sytrd_lwork", info)
    with blas_threads():
        reflectors, diagonal, off_diagonal, tau, info = sytrd(a, lower=1, lwork=int(work), overwrite_a=0)
    _check("sytrd", info)
    diagonal, off_diagonal = diagonal.astype(np.float64), off_diagonal.astype(np.float64)
    values, info = lapack.dsterf(diagonal, off_diagonal)
    _check("dsterf", info)
    return Reduction(
        torch.from_numpy(np.ascontiguousarray(reflectors.T)).T,  # the same Fortran-order array, as a torch view
        torch.from_numpy(tau),
        torch.from_numpy(diagonal),
        torch.from_numpy(off_diagonal),
        torch.from_numpy(np.ascontiguousarray(values[::-1])),
    )


def _check(routine: str, info: int) -> None:
    if info != 0:
        raise RuntimeError(f"LAPACK {routine} failed (info = {info}): the matrix holds NaN or inf, or is not symmetric")


def _leading_vectors(reduction: Reduction, k: int) -> torch.Tensor:
    d = reduction.size
    if not 0 <= k <= d:
        raise ValueError(f"asked for {k} eigenvectors of a {d} x {d} matrix")
    if k == 0:
        return reduction.reflectors.new_zeros(d, 0)
    if d == 1:
        return reduction.reflectors.new_ones(1, 1)
    diagonal, off_diagonal = reduction.diagonal.numpy(), reduction.off_diagonal.numpy()
    if mrrr_pays(k, d):
        Z = _tridiagonal_vectors(diagonal, off_diagonal, k)
    else:
        Z = _all_vectors(diagonal, off_diagonal)[:, :k].copy()
    Z = torch.from_numpy(Z).to(reduction.dtype)
    # H = diag(1, H') with H' the Q of a QR whose reflectors are the sub-diagonal block: H z = (z_0, H' z_1:)
    reflectors = reduction.reflectors
    Z[1:] = torch.ormqr(reflectors[1:, :-1], reduction.tau, Z[1:], left=True, transpose=False)
    return Z


def _tridiagonal_vectors(diagonal: np.ndarray, off_diagonal: np.ndarray, k: int) -> np.ndarray:
    """The k leading eigenvectors of T (d x k, float64, descending) by MRRR; by divide and conquer should MRRR fail
    (it may, rarely, on tight clusters: LAPACK's dlarrv)."""
    from scipy.linalg import lapack

    d = diagonal.size
    padded = np.concatenate([off_diagonal, [0.0]])  # dstemr's e has d entries, the last one workspace
    with blas_threads():
        m, _, Z, info = lapack.dstemr(diagonal, padded, 2, 0.0, 0.0, d - k + 1, d, compute_v=1)
    if info != 0 or m != k:
        return _all_vectors(diagonal, off_diagonal)[:, :k].copy()
    return Z[:, k - 1 :: -1].copy()  # a fresh C-order array with positive strides


def _all_vectors(diagonal: np.ndarray, off_diagonal: np.ndarray) -> np.ndarray:
    """Every eigenvector of T (d x d, float64, descending eigenvalues) by divide and conquer."""
    from scipy.linalg import lapack

    with blas_threads():
        _, Z, info = lapack.dstevd(diagonal, off_diagonal, compute_v=1)
    _check("dstevd", info)
    return Z[:, ::-1]


@functools.cache
def available() -> bool:
    """Whether SciPy's LAPACK and threadpoolctl import (the solver's only dependencies beyond torch)."""
    try:
        import threadpoolctl  # noqa: F401
        from scipy.linalg import lapack  # noqa: F401
    except ImportError:
        return False
    return True
