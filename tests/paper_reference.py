"""Our re-implementation of the paper's closed-form algorithm, for accuracy comparisons only.

This is NOT the authors' code (we do not have it) and not part of specmerge: it is Algorithm 1 /
App. B of ``closed-form-spectral-merging.tex`` written out as plainly as possible, the way a
research script would do it, so that specmerge's float32 accuracy can be compared with what the
paper's algorithm itself achieves in the same precision (issue 13, items 19-20):

- A_i = tau_i^T tau_i / ||tau_i||_F^2, C = sum_i A_i, D = sum_i tau_i A_i, in the working dtype;
- one ``torch.linalg.eigh`` of the d_in x d_in matrix C, eigenvalues sorted descending;
- filter gains h_k / lambda_k with the Moore-Penrose convention of Sec. 4.1 (0 where lambda_k = 0) and
  no other tolerance;
- tau_hat = tau_init + (D - tau_init C) Q diag(h / lambda) Q^T (Eq. 8).

The filters are the paper's formulas: SWUDI 1[k <= ceil(r d_in)] (1 - exp(-t lambda)) (evaluated with
expm1, as careful float32 code does), SWUDI-A 1[k <= K] with K from psqrt (Eq. 12, on sqrt of the
eigenvalues clipped at 0, C being positive semi-definite), Gavish-Donoho (Eq. 13; the threshold
constant omega(beta) is taken from specmerge's exact rule, a constant that does not depend on the
precision) or the participation ratio of the eigenvalues, the pseudoinverse h = 1, Landweber
1 - (1 - eta lambda)^n, Tikhonov lambda / (lambda + alpha).
"""

from __future__ import annotations

import math

import torch

from specmerge.linalg.rank_rules import gavish_donoho_omega


def normal_equation(tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """C and D of Algorithm 1, line 2, term by term."""
    d_in = tau.shape[2]
    C = tau.new_zeros(d_in, d_in)
    D = tau.new_zeros(tau.shape[1], d_in)
    for tau_i in tau:
        A_i = tau_i.T @ tau_i / (tau_i * tau_i).sum()
        C += A_i
        D += tau_i @ A_i
    return C, D


def rank(rule: str, lam: torch.Tensor, n_rows: int, n_cols: int) -> int:
    """K of SWUDI-A's rank rules on the descending eigenvalues of C (all d_in of them)."""
    sigma = lam.clamp(min=0).sqrt()
    if rule == "psqrt":
        return math.ceil(float(sigma.sum()) ** 2 / float((sigma * sigma).sum()))
    if rule == "participation":
        lam = lam.clamp(min=0)
        return math.ceil(float(lam.sum()) ** 2 / float((lam * lam).sum()))
    if rule == "gavish_donoho":
        m = min(n_rows, n_cols)
        sigma = sigma[:m]
        return int((sigma > gavish_donoho_omega(m / max(n_rows, n_cols)) * float(sigma.median())).sum())
    raise ValueError(rule)


def decomposition(tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """C, D and the eigenpairs of C (descending) of one layer: Algorithm 1, lines 2-3."""
    C, D = normal_equation(tau)
    lam, Q = torch.linalg.eigh(C)
    return C, D, lam.flip(0), Q.flip(1)


def merge(tau: torch.Tensor, method: str, decomposed: tuple | None = None, **params) -> torch.Tensor:
    """tau_hat of one layer for the specmerge method name and parameters (the subset the comparison uses).

    ``decomposed``: :func:`decomposition` of ``tau``, when several methods run on one layer.
    """
    n, d_out, d_in = tau.shape
    C, D, lam, Q = decomposition(tau) if decomposed is None else decomposed
    index = torch.arange(d_in)
    tau_init = params.get("tau_init", "zero" if method == "closed_form" else "sum")
    start = {"sum": tau.sum(0), "mean": tau.mean(0), "zero": torch.zeros_like(tau[0])}[tau_init]
    if method == "swudi":
        k = math.ceil(params.get("rank_ratio", 0.65) * d_in)
        h = (index < k).to(lam.dtype) * -torch.expm1(-params.get("t", 1300.0) * lam)
    elif method == "swudi_a":
        h = (index < rank(params.get("rule", "psqrt"), lam, n * d_out, d_in)).to(lam.dtype)
    elif method == "closed_form":
        h = torch.ones_like(lam)
    elif method == "spectral_filter":
        kind = params.get("filter", "exponential")
        if kind == "exponential":
            h = -torch.expm1(-params.get("t", 300.0) * lam)
        elif kind == "landweber":
            h = 1 - (1 - params.get("eta", 0.1) * lam) ** params.get("steps", 300)
        elif kind == "tikhonov":
            h = lam / (lam + params.get("alpha", 1e-3))
        elif kind == "pinv":
            h = torch.ones_like(lam)
        else:
            raise ValueError(kind)
        mask = params.get("rank", "all")
        if mask != "all":
            h = h * (index < rank(mask, lam, n * d_out, d_in)).to(lam.dtype)
    else:
        raise ValueError(method)
    gains = torch.where(lam != 0, h / torch.where(lam != 0, lam, torch.ones_like(lam)), torch.zeros_like(lam))
    return start + (D - start @ C) @ (Q * gains) @ Q.T
