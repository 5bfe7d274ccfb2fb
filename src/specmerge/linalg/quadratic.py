"""The quadratic loss of WUDI-type merges and its normal equation tau C = D (paper Sec. 3).

For task vectors tau_i (d_out x d_in) with n_i = ||tau_i||_F^2 and a proxy p_i (d_in columns) for
each, the loss sum_i ||(tau - tau_i) p_i^T||_F^2 / n_i has the normal equation tau C = D with
C = sum_i p_i^T p_i / n_i and D = sum_i tau_i p_i^T p_i / n_i. WUDI's proxies are the task vectors
themselves (:func:`normal_equation`); OptMerge's are rank-k truncated SVDs (:func:`proxy_equation`).
Both are one :class:`NormalEquation`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch

from specmerge.linalg.gram import gram_sum

TauInit = Literal["sum", "mean", "zero"]


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


def proxy_loss(tau: torch.Tensor, targets: torch.Tensor, proxies: torch.Tensor, norms_sq: torch.Tensor) -> torch.Tensor:
    """sum_i ||(tau - t_i) p_i^T||_F^2 / n_i; targets = proxies = tau_i is the WUDI loss (paper Eq. 2)."""
    residual = (tau - targets) @ proxies.transpose(1, 2)
    return (residual.pow(2).sum(dim=(1, 2)) / norms_sq).sum()


@dataclass(frozen=True)
class NormalEquation:
    """C and D of one layer's quadratic loss (paper Eq. 4), built from the non-zero experts.

    ``proxies`` is None for WUDI's loss (the proxy of tau_i is tau_i itself); for OptMerge's it holds
    R_i = S_k V_k^T (k x d_in) of the rank-k proxies P_i = U_k S_k V_k^T: P_i^T P_i = R_i^T R_i and
    ||X P_i^T||_F = ||X R_i^T||_F since U_k has orthonormal columns. ``M`` stacks the proxies over
    sqrt(n_i), so C = M^T M: (N d_out) x d_in for WUDI, only N k rows for low-rank proxies. C itself
    is formed only when asked for: products X C and the spectrum may go through M instead. So is WUDI's D when
    d_out < d_in (:func:`normal_equation`): a top-K filter may need only D Q (:meth:`D_times`).
    """

    tau: torch.Tensor  # (N_kept, d_out, d_in), the targets tau_i
    norms_sq: torch.Tensor  # (N_kept,), n_i = ||tau_i||_F^2
    proxies: torch.Tensor | None = None  # (N_kept, k, d_in) low-rank proxy factors R_i, or None: tau_i itself

    @property
    def n_experts(self) -> int:
        return self.tau.shape[0]

    @property
    def d_out(self) -> int:
        return self.tau.shape[1]

    @property
    def d_in(self) -> int:
        return self.tau.shape[2]

    @property
    def proxy_rank(self) -> int | None:
        """k of low-rank proxies, None for WUDI's."""
        return None if self.proxies is None else self.proxies.shape[1]

    @property
    def rows(self) -> torch.Tensor:
        """The matrices whose Grams C sums: the proxies R_i, or tau_i itself for WUDI's loss."""
        return self.tau if self.proxies is None else self.proxies

    @functools.cached_property
    def M(self) -> torch.Tensor:
        return (self.rows / self.norms_sq.sqrt()[:, None, None]).reshape(-1, self.d_in)

    def gram(self, dtype: torch.dtype) -> torch.Tensor:
        """sum_i X_i^T X_i / n_i over :attr:`rows` in ``dtype``, one expert at a time (no (N d_out) x d_in copy of
        the stack; each X_i cast on its own), by symmetric updates where they pay (:func:`gram_sum`)."""
        parts = ((x.to(dtype), 1 / float(n)) for x, n in zip(self.rows, self.norms_sq, strict=True))
        return gram_sum(parts, self.d_in, self.rows.new_zeros(0, dtype=dtype))

    @functools.cached_property
    def C(self) -> torch.Tensor:
        if self.proxies is not None:
            return self.M.T @ self.M
        return self.gram(self.tau.dtype)

    @functools.cached_property
    def D(self) -> torch.Tensor:
        """(d_out, d_in): sum_i tau_i A_i for WUDI's loss, each term as :func:`normal_equation` forms it (the same
        bits); the equations of low-rank proxies come with theirs."""
        if self.proxies is not None:
            raise RuntimeError("a proxy equation is built with its D")
        D = self.tau.new_zeros(self.d_out, self.d_in)
        for tau_i, n_i in zip(self.tau, self.norms_sq, strict=True):
            D += _d_term(tau_i, n_i)
        return D

    @property
    def has_D(self) -> bool:
        return "D" in self.__dict__

    def D_times(self, X: torch.Tensor) -> torch.Tensor:
        """D X (X: d_in x k): with D where :func:`normal_equation` forms it (d_out >= d_in), else as
        sum_i tau_i (tau_i^T (tau_i X)) / n_i, expert by expert (6 N d_out d_in k flops and no d_out x d_in
        temporary, against 3 N d_out^2 d_in for D itself). Which one is a function of the shape alone, so the same
        X gives the same bits whatever else was formed."""
        if self.d_out >= self.d_in or self.proxies is not None:
            return self.D @ X
        out = X.new_zeros(self.d_out, X.shape[1])
        for tau_i, n_i in zip(self.tau, self.norms_sq, strict=True):
            out.addmm_(tau_i, tau_i.T @ (tau_i @ X), alpha=1 / float(n_i))
        return out

    @property
    def has_C(self) -> bool:
        """Whether C is formed already (then products with it cost nothing more to set up)."""
        return "C" in self.__dict__

    def times_C(self, X: torch.Tensor) -> torch.Tensor:
        """X C, through whichever of C (d_in^2 per row of X) or M (2 N d_out d_in) is cheaper.

        Low-rank proxies always go through their small M.
        """
        if self.proxies is not None or (2 * self.n_experts * self.d_out < self.d_in and not self.has_C):
            return (X @ self.M.T) @ self.M
        return X @ self.C

    def times_C_once(self, X: torch.Tensor) -> torch.Tensor:
        """X C for one X: with C when it is formed already, else as (X M^T) M (C would cost n_rows d_in^2 first)."""
        return X @ self.C if self.has_C else (X @ self.M.T) @ self.M

    def loss(self, tau: torch.Tensor) -> torch.Tensor:
        """The loss sum_i ||(tau - tau_i) p_i^T||_F^2 / n_i, written directly (paper Eq. 2 for WUDI)."""
        return proxy_loss(tau, self.tau, self.tau if self.proxies is None else self.proxies, self.norms_sq)


def _check_stack(task_vectors: torch.Tensor) -> None:
    if task_vectors.dim() != 3:
        raise ValueError(f"expected a stack N x d_out x d_in, got shape {tuple(task_vectors.shape)}")


def normal_equation(task_vectors: torch.Tensor) -> NormalEquation:
    """WUDI's C and D = sum tau_i A_i (A_i = tau_i^T tau_i / n_i) for the non-zero experts of an (N, d_out, d_in) stack.

    Each term of D is formed in the cheaper order, one expert at a time so the workspace is one small
    Gram: (tau_i tau_i^T) tau_i / n_i when d_out < d_in, else tau_i A_i, in which case the A_i are
    summed into C on the way (C is then needed anyway: N d_out >= d_in selects the C route). When
    d_out < d_in, D is formed only when first asked for (a top-K filter may need only D Q).
    """
    _check_stack(task_vectors)
    tau, norms_sq = nonzero_experts(task_vectors)
    eq = NormalEquation(tau, norms_sq)
    d_out, d_in = task_vectors.shape[1:]
    if d_out >= d_in:
        C, D = task_vectors.new_zeros(d_in, d_in), task_vectors.new_zeros(d_out, d_in)
        for tau_i, n_i in zip(tau, norms_sq, strict=True):
            A_i = _gram(tau_i, n_i)
            C += A_i
            D += tau_i @ A_i
        eq.__dict__.update(C=C, D=D)  # fill the cached properties: the same values, already paid for
    return eq


def _gram(tau_i: torch.Tensor, n_i: torch.Tensor) -> torch.Tensor:
    """A_i = tau_i^T tau_i / n_i."""
    return gram_sum([(tau_i, 1 / float(n_i))], tau_i.shape[1], tau_i)


def _d_term(tau_i: torch.Tensor, n_i: torch.Tensor) -> torch.Tensor:
    """tau_i tau_i^T tau_i / n_i in the cheaper order (as :func:`normal_equation` forms it)."""
    if tau_i.shape[0] < tau_i.shape[1]:
        return gram_sum([(tau_i.T, 1.0)], tau_i.shape[0], tau_i) @ tau_i / n_i
    return tau_i @ _gram(tau_i, n_i)


def proxy_rank(d_out: int, d_in: int, n_experts: int, rank: int | None = None) -> int:
    """OptMerge's truncation rank: ``rank`` capped at min(d_out, d_in), or max(1, min(d_out, d_in) // N)."""
    if rank is None:
        return max(1, min(d_out, d_in) // max(n_experts, 1))
    if rank < 1:
        raise ValueError(f"proxy rank must be at least 1, got {rank}")
    return min(rank, d_out, d_in)


def proxy_equation(task_vectors: torch.Tensor, rank: int | None = None, *, centre: bool) -> NormalEquation:
    """C_P and D_P with P_i the rank-k truncated SVD of tau_i - mean_j tau_j (``centre``) or of tau_i.

    The mean runs over all N experts; experts with an all-zero delta are then left out of the loss.
    """
    _check_stack(task_vectors)
    n, d_out, d_in = task_vectors.shape
    k = proxy_rank(d_out, d_in, n, rank)
    source = task_vectors - task_vectors.mean(dim=0) if centre else task_vectors
    norms = expert_norms_sq(task_vectors)
    keep = norms > 0
    tau, norms_sq = task_vectors[keep], norms[keep]
    _, S, Vh = torch.linalg.svd(source[keep], full_matrices=False)
    factors = S[:, :k, None] * Vh[:, :k]
    scaled = factors / norms_sq.sqrt()[:, None, None]
    # D_P = sum_i (tau_i R_i^T / sqrt(n_i)) (R_i / sqrt(n_i)): one (d_out x N k) by (N k x d_in) product
    left = tau @ scaled.transpose(1, 2)
    D = left.permute(1, 0, 2).reshape(d_out, -1) @ scaled.reshape(-1, d_in)
    eq = NormalEquation(tau, norms_sq, factors)
    eq.__dict__["D"] = D
    return eq
