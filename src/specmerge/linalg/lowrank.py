"""LoRA experts merged in factored form, exactly, without forming d_in x d_in matrices.

For LoRA experts tau_i = s_i B_i A_i (B_i: d_out x r_i, A_i: r_i x d_in) every task vector lives in
span(B) x span(A): with orthonormal bases P of the stacked B columns and R of the stacked A rows,
tau_i = P T_i R^T with a small core T_i = s_i (P^T B_i)(A_i R) of size at most (sum r_i)^2. Every
quantity of the WUDI normal equation maps through the bases: C = R C_T R^T, D = P D_T R^T,
tau_init = P T_init R^T, and C has the eigenvalues of C_T plus zeros (DESIGN.md, "LoRA experts
without densifying"). So a spectral method run on the cores, told the real layer shape (for
r * d_in, the Gavish-Donoho beta and median, and the zero-eigenvalue tolerance), returns the core
of exactly the dense result: tau_hat = P T_hat R^T, a factorisation of rank at most sum r_i.
A method declares that it has this property (``factored=True`` at registration); the merge itself is
``Method.merge_factored`` in ``specmerge.methods``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specmerge.linalg.precision import compute_dtype


@dataclass(frozen=True)
class LoraDelta:
    """A low-rank delta scale * B @ A (B: d_out x r, A: r x d_in)."""

    B: torch.Tensor
    A: torch.Tensor
    scale: float = 1.0

    @property
    def shape(self) -> tuple[int, int]:
        return self.B.shape[0], self.A.shape[1]

    def dense(self) -> torch.Tensor:
        return self.scale * (self.B @ self.A)

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    def rows(self, start: int, stop: int) -> LoraDelta:
        """The delta's rows ``start:stop`` (a slice of B)."""
        return LoraDelta(self.B[start:stop], self.A, self.scale)

    def to(self, device: torch.device | str, dtype: torch.dtype) -> LoraDelta:
        return LoraDelta(self.B.to(device=device, dtype=dtype), self.A.to(device=device, dtype=dtype), self.scale)

    @staticmethod
    def zero(shape: tuple[int, int], dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        """The rank-0 delta of a layer an adapter does not change."""
        return LoraDelta(
            torch.zeros(shape[0], 0, dtype=dtype, device=device), torch.zeros(0, shape[1], dtype=dtype, device=device)
        )


@dataclass(frozen=True)
class FactoredResult:
    """The merged delta as factors: delta = left @ right (left: d_out x k, right: k x d_in), k <= sum r_i."""

    left: torch.Tensor
    right: torch.Tensor
    diagnostics: dict[str, Any]

    def dense(self) -> torch.Tensor:
        return self.left @ self.right


def singular_value_floor(S: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The numerical-rank tolerance max(d_out, d_in) * eps * sigma_1 (per matrix, for batched ``S``).

    Singular values at or below it are structural zeros (a rank-deficient delta, e.g. a LoRA
    expert); their singular vectors are arbitrary, so TSV-M, Iso-C and :func:`adapter_factors` leave them out.
    """
    return max(shape) * torch.finfo(S.dtype).eps * S[..., :1]


def _orthonormal_basis(M: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning the numerical column space of M (SVD, relative tolerance)."""
    U, S, _ = torch.linalg.svd(M, full_matrices=False)
    if S.numel() == 0 or float(S[0]) == 0:
        return U[:, :0]
    tol = max(M.shape) * torch.finfo(M.dtype).eps * float(S[0])
    return U[:, : int((tol < S).sum())]


def factor_cores(
    experts: Sequence[LoraDelta], dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bases P (d_out x p), R (d_in x q) and cores T (N x p x q) with expert i = P T_i R^T exactly."""
    if not experts:
        raise ValueError("no LoRA experts given")
    shapes = {e.shape for e in experts}
    if len(shapes) != 1:
        raise ValueError(f"LoRA experts disagree on the layer shape: {sorted(shapes)}")
    Bs = [compute_dtype(e.B, dtype) for e in experts]
    As = [compute_dtype(e.A, dtype) for e in experts]
    P = _orthonormal_basis(torch.cat(Bs, dim=1))
    R = _orthonormal_basis(torch.cat(As, dim=0).T)
    cores = torch.stack([e.scale * (P.T @ B) @ (A @ R) for e, B, A in zip(experts, Bs, As, strict=True)])
    return P, R, cores


@dataclass(frozen=True)
class AdapterFactors:
    """A delta written as a LoRA pair: delta = B @ A, with its singular values split evenly between B and A."""

    B: torch.Tensor  # d_out x k
    A: torch.Tensor  # k x d_in
    discarded_energy: float  # share of ||delta||_F^2 dropped by a max rank (0 when exact)

    @property
    def rank(self) -> int:
        return self.A.shape[0]


def adapter_factors(
    delta: FactoredResult | torch.Tensor, *, max_rank: int | None = None, dtype: torch.dtype | None = None
) -> AdapterFactors:
    """The smallest exact LoRA pair of a merged delta, or its best rank-``max_rank`` approximation.

    A factored delta L R (k columns) is reduced through QR of both factors and a k x k SVD; a dense
    delta (from a method that densifies) through its SVD. Singular values at or below
    max(d_out, d_in) * eps * sigma_1 (eps of the delta's dtype) are zeros and dropped (no
    approximation); ``max_rank`` then keeps the leading ones (Eckart-Young), and the discarded
    share of the squared Frobenius norm is reported. B = U sqrt(S), A = sqrt(S) V^T. Computed in
    float64, returned in ``dtype`` (default the delta's).
    """
    if isinstance(delta, FactoredResult):
        source_dtype = delta.left.dtype
        Q1, R1 = torch.linalg.qr(delta.left.double())
        Q2, R2 = torch.linalg.qr(delta.right.double().T)
        U, S, Vh = torch.linalg.svd(R1 @ R2.T)
        U, Vh = Q1 @ U, Vh @ Q2.T
        shape = (delta.left.shape[0], delta.right.shape[1])
    else:
        source_dtype = delta.dtype
        U, S, Vh = torch.linalg.svd(delta.double(), full_matrices=False)
        shape = tuple(delta.shape)
    out_dtype = dtype or source_dtype
    in_precision = S.to(source_dtype)
    rank = int((singular_value_floor(in_precision, shape) < in_precision).sum()) if S.numel() else 0
    if max_rank is not None:
        rank = min(rank, max_rank)
    total = float((S**2).sum())
    discarded = float((S[rank:] ** 2).sum()) / total if total > 0 else 0.0
    root = S[:rank].sqrt()
    return AdapterFactors((U[:, :rank] * root).to(out_dtype), (root[:, None] * Vh[:rank]).to(out_dtype), discarded)
