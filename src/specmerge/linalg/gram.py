"""Sums of Gram matrices sum_i alpha_i X_i^T X_i, the C of the normal equation, at half the flops of the product.

C is symmetric, so a symmetric rank-k update (BLAS ``?syrk``) forms its lower triangle alone: half the flops of
``X^T @ X`` (measured 1.5x faster on a 768 x 3072 layer with N = 8, BENCHMARKS.md, issue 23); the upper triangle is
then copied from it in blocks (no d x d temporary). CPU float32 and float64 through SciPy's BLAS, with its threads
held to torch's count; elsewhere (GPU, other dtypes) torch's product.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

SYMMETRIZE_BLOCK = 512  # rows of the upper triangle copied at a time


def gram_sum(parts: Iterable[tuple[torch.Tensor, float]], d: int, like: torch.Tensor) -> torch.Tensor:
    """sum alpha X^T X over ``parts`` (X: rows x d, alpha a float), d x d, with ``like``'s dtype and device.

    X may be contiguous or the transpose of a contiguous tensor (tau^T for tau tau^T): neither is copied."""
    if like.device.type != "cpu" or like.dtype not in (torch.float32, torch.float64):
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
