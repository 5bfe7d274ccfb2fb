"""Sums of Gram matrices sum_i alpha_i X_i^T X_i, the C of the normal equation, at half the flops of the product.

C is symmetric, so a symmetric rank-k update (BLAS ``?syrk``) forms its lower triangle alone: half the flops of
``X^T @ X`` (measured 1.5x faster on a 768 x 3072 layer with N = 8, BENCHMARKS.md, issue 23); the upper triangle is
then copied from it in blocks (no d x d temporary). CPU float32 and float64 through SciPy's BLAS, with its threads
held to torch's count, from d = SYRK_MIN_SIZE; below it, and elsewhere (GPU, other dtypes), torch's product.

Why the threshold: SciPy's BLAS (OpenBLAS) and torch's (MKL under OpenMP) keep separate thread pools, and each
pool's threads spin for a while after a call. On small layers a merge alternates the two (one Gram per expert,
then a torch product with it), and the spinning pools take the cores from each other: measured on a 2-core AMD EPYC,
the normal equation of 8 experts of 768 x 768 took 0.66 s with syrk against 0.22 s with torch's products alone, of
3072 x 768 1.24 s against 0.88 s. From d = 2048 each call is long enough for the switch not to matter, and the half
flops win (768 x 3072: 1.83 s against 2.62 s; a 3072 x 8192 down_proj: 27.4 s against 44.7 s).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

SYMMETRIZE_BLOCK = 512  # rows of the upper triangle copied at a time
SYRK_MIN_SIZE = 2048  # below, torch's product: see gram_sum


def gram_sum(parts: Iterable[tuple[torch.Tensor, float]], d: int, like: torch.Tensor) -> torch.Tensor:
    """sum alpha X^T X over ``parts`` (X: rows x d, alpha a float), d x d, with ``like``'s dtype and device.

    X may be contiguous or the transpose of a contiguous tensor (tau^T for tau tau^T): neither is copied."""
    if like.device.type != "cpu" or like.dtype not in (torch.float32, torch.float64) or d < SYRK_MIN_SIZE:
        C = like.new_zeros(d, d)
        for X, alpha in parts:
            C.addmm_(X.T, X, alpha=alpha)
        return C
    from scipy.linalg import blas

    from specmerge.linalg.eigensolver import blas_threads

    syrk = blas.ssyrk if like.dtype == torch.float32 else blas.dsyrk
    lower = np.zeros((d, d), dtype=np.float32 if like.dtype == torch.float32 else np.float64, order="F")
    with blas_threads():
        for X, alpha in parts:
            # a row-major X read in Fortran order is X^T: syrk forms (X^T)(X^T)^T = X^T X (trans=0); a transposed view
            # of a row-major tensor is X itself in Fortran order: A^T A with A = X (trans=1)
            X = X.detach()
            a, trans = (X.numpy().T, 0) if X.is_contiguous() else (X.T.contiguous().numpy().T, 1)
            lower = syrk(alpha, a, trans=trans, lower=1, beta=1.0, c=lower, overwrite_c=1)
    C = torch.from_numpy(lower).T  # the Fortran-order lower triangle is the upper triangle of this view
    _mirror_upper(C)
    return C


def _mirror_upper(C: torch.Tensor) -> None:
    """Fill the strict lower triangle of C from its upper one, in place, a block of rows at a time."""
    d = C.shape[0]
    for start in range(0, d, SYMMETRIZE_BLOCK):
        stop = min(d, start + SYMMETRIZE_BLOCK)
        C[start:stop, :start] = C[:start, start:stop].T
        block = C[start:stop, start:stop]
        block.copy_(block.triu() + block.triu(1).T)
