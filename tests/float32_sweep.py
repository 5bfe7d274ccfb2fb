"""Random layers, method settings and error measures shared by tests/test_float32_accuracy.py and
bench/float32_accuracy.py (issue 13, items 19-20: float32 against float64).

Every spectral method of specmerge runs on a float64 layer rounded to float32, once in float32 and once
in float64 (the same rounded numbers), and so does our re-implementation of the paper's algorithm
(``paper_reference``): the error of a code is ||tau_hat_32 - tau_hat_64|| / ||tau_hat_64||, its own
float32 result against its own float64 result.

``first_order_error`` is the size of the error any float32 code must be expected to make on a layer,
from the float64 problem alone (its eigenvalues, eigengaps, gains and right-hand side): the test's
allowance where the reference code happens to be more accurate than that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import paper_reference
from specmerge import get_method
from specmerge.linalg.solve import shared_decompositions

# The constant first-order estimates with unit constants leave out: the backward errors of eigh(C) and of the
# products that form C and D, measured at 0.2-4 eps times the matrix's norm on these shapes (tail eigenvalues
# of eigh(C) against float64: 0.2-4 eps lambda_1; D: 2-4 eps ||D||_F).
BACKWARD_ERROR = 4.0

# (d_out, d_in): tall, square, and wide with N d_out < d_in for N <= 8 (the row-space route)
SHAPES = {"tall": (96, 64), "square": (64, 64), "wide": (24, 256)}
# i.i.d. Gaussian experts ("flat"); singular values of each tau_i from 1 down to 10^-3 or 10^-5 (geometric,
# random singular vectors: "steep", "steeper"); a rank-8 row space shared by all experts plus 1 % i.i.d.
# noise, the picture of real task vectors (a few spikes over a noise bulk: "spiked")
CONDITIONING = {"flat": None, "steep": 3.0, "steeper": 5.0, "spiked": "shared rank 8 + 1 % noise"}

METHODS: list[tuple[str, dict]] = [
    ("swudi", {}),
    ("swudi", {"rank_ratio": 1.0, "t": 1300.0}),
    ("swudi_a", {"rule": "psqrt"}),
    ("swudi_a", {"rule": "gavish_donoho"}),
    ("swudi_a", {"rule": "participation"}),
    ("closed_form", {}),
    ("closed_form", {"tau_init": "sum"}),
    ("spectral_filter", {"filter": "exponential", "t": 300.0}),
    ("spectral_filter", {"filter": "landweber", "eta": 0.1, "steps": 300}),
    ("spectral_filter", {"filter": "tikhonov", "alpha": 1e-3}),
    ("spectral_filter", {"filter": "pinv", "rank": "psqrt"}),
]


def label(method: str, params: dict) -> str:
    return method + "".join(f" {k}={v:g}" if isinstance(v, float) else f" {k}={v}" for k, v in params.items())


def layer(n: int, shape: str, conditioning: str, seed: int) -> torch.Tensor:
    """N task vectors of one layer in float64, already rounded to float32 (both precisions see the same numbers)."""
    d_out, d_in = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    decades = CONDITIONING[conditioning]
    if decades is None:
        tau = torch.randn(n, d_out, d_in, generator=g, dtype=torch.float64)
    elif conditioning == "spiked":
        shared = torch.randn(8, d_in, generator=g, dtype=torch.float64)
        signal = torch.randn(n, d_out, 8, generator=g, dtype=torch.float64) @ shared  # entries of std sqrt(8)
        tau = signal + 0.01 * 8**0.5 * torch.randn(n, d_out, d_in, generator=g, dtype=torch.float64)
    else:
        m = min(d_out, d_in)
        U = torch.linalg.qr(torch.randn(n, d_out, m, generator=g, dtype=torch.float64))[0]
        V = torch.linalg.qr(torch.randn(n, d_in, m, generator=g, dtype=torch.float64))[0]
        tau = (U * torch.logspace(0, -decades, m, dtype=torch.float64)) @ V.transpose(1, 2)
    return (1e-3 * tau).float().double()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    b = b.double()
    return float((a.double() - b).norm() / b.norm())


@dataclass(frozen=True)
class Errors:
    specmerge: float
    reference: float
    allowance: float  # first_order_error of the layer and method


def errors(tau: torch.Tensor, methods: list[tuple[str, dict]]) -> list[Errors]:
    """Both codes' float32 error, and the allowance, for each method on one float64 stack of float32 numbers."""
    tau32 = tau.float()
    decomposed = {dtype: paper_reference.decomposition(tau.to(dtype)) for dtype in (torch.float32, torch.float64)}
    out = []
    with shared_decompositions():  # one decomposition per precision for all the methods
        for method, params in methods:
            ours64 = get_method(method)(tau, **params)
            ours32 = get_method(method)(tau32, **params).delta
            ref = {
                dtype: paper_reference.merge(tau.to(dtype), method, decomposed[dtype], **params)
                for dtype in (torch.float32, torch.float64)
            }
            allowance = first_order_error(tau, method, params, decomposed=decomposed[torch.float64], result=ours64)
            out.append(
                Errors(relative(ours32, ours64.delta), relative(ref[torch.float32], ref[torch.float64]), allowance)
            )
    return out


def _inverse_gain(method: str, params: dict, lam: torch.Tensor, kept: int | None) -> torch.Tensor:
    """h / lambda of the method's filter on descending float64 eigenvalues, with its limit where lambda = 0
    (inf where unbounded); ``kept`` is the K specmerge reported for a hard cut."""
    zero = lam <= 0
    safe = torch.where(zero, torch.ones_like(lam), lam)
    kind = {"swudi": "exponential", "swudi_a": "pinv", "closed_form": "pinv"}.get(method, params.get("filter"))
    kind = kind or "exponential"
    if kind == "exponential":
        t = params.get("t", 1300.0 if method == "swudi" else 300.0)
        g = torch.where(zero, t, -torch.expm1(-t * lam) / safe)
    elif kind == "landweber":
        eta, steps = params.get("eta", 0.1), params.get("steps", 300)
        g = torch.where(zero, eta * steps, -torch.expm1(steps * torch.log1p(-eta * lam)) / safe)
    elif kind == "tikhonov":
        g = 1 / (lam.clamp(min=0) + params.get("alpha", 1e-3))
    else:
        g = torch.where(zero, math.inf, 1 / safe)
    if kept is not None:
        g = torch.where(torch.arange(lam.numel()) < kept, g, torch.zeros_like(g))
    return g


def first_order_error(
    tau: torch.Tensor,
    method: str,
    params: dict,
    eps: float = torch.finfo(torch.float32).eps,
    decomposed: tuple | None = None,
    result=None,
) -> float:
    """Relative error of tau_hat to first order when C, D and tau_init C carry errors of eps times their norm.

    On the float64 problem (eigenpairs lambda_k, q_k of C from one eigh, gains g_k = h_k / lambda_k,
    B = D - tau_init C; eigenvalues below sqrt(d_in) eps_64 lambda_1 count as 0, where unbounded gains are 0):
    - an eigenvalue moved by eps lambda_1 changes the update by eps lambda_1 |g'(lambda_k)| ||B q_k||;
    - eigenvectors k, j turn into each other by eps lambda_1 / |lambda_k - lambda_j| (Davis-Kahan), which
      changes the update by that angle times |g_k - g_j| (||B q_k||^2 + ||B q_j||^2)^(1/2): around a hard
      cut this is the eigengap term g_K eps lambda_1 / (lambda_K - lambda_K+1);
    - D and tau_init C rounded by eps of their (Frobenius) norm are amplified by the largest gain applied.
    The terms are independent and added in quadrature; the result, with the final rounding to float32
    (eps), is divided by ||tau_hat||. Only float64 linear algebra and the method's reported K are used.
    ``decomposed`` (paper_reference.decomposition of tau) and ``result`` (the method on tau) may be passed in.
    """
    result = get_method(method)(tau, **params) if result is None else result
    kept = result.diagnostics.get("kept_rank") if method in ("swudi", "swudi_a") or "rank" in params else None
    _, D, lam, Q = paper_reference.decomposition(tau) if decomposed is None else decomposed
    lam = lam.clamp(min=0)
    lam1 = float(lam[0])
    lam = torch.where(lam > math.sqrt(lam.numel()) * torch.finfo(lam.dtype).eps * lam1, lam, torch.zeros_like(lam))
    g = _inverse_gain(method, params, lam, kept)
    g = torch.where(g.isfinite(), g, torch.zeros_like(g))
    step = 1e-4 * lam
    up, down = (_inverse_gain(method, params, x, kept) for x in (lam + step, (lam - step).clamp(min=0)))
    slope = torch.where(lam > 0, (up - down) / torch.where(lam > 0, lam + step - (lam - step).clamp(min=0), 1.0), 0.0)
    slope = torch.where(slope.isfinite(), slope, torch.zeros_like(slope))
    tau_init = params.get("tau_init", "zero" if method == "closed_form" else "sum")
    start = {"sum": tau.sum(0), "mean": tau.mean(0), "zero": None}[tau_init]
    B = D @ Q - ((start @ Q) * lam if start is not None else 0)
    b2 = B.pow(2).sum(dim=0)  # ||B q_k||^2
    # eigenvalue errors
    total = float(((eps * lam1 * slope).pow(2) * b2).sum())
    # eigenvector mixing
    gap = (lam[:, None] - lam[None, :]).abs()
    dg = (g[:, None] - g[None, :]).abs()
    ratio = torch.where(gap > 0, dg / torch.where(gap > 0, gap, torch.ones_like(gap)), slope.abs()[:, None])
    total += float(((eps * lam1 * ratio).pow(2) * (b2[:, None] + b2[None, :])).triu(diagonal=1).sum())
    # rounding of D and tau_init C, amplified by the largest gain
    scale = float(D.norm()) + (lam1 * float(start.norm()) if start is not None else 0.0)
    total += (eps * scale * float(g.abs().max())) ** 2
    # and the result itself is rounded to float32
    merged = result.delta.norm()
    total += (eps * float(merged)) ** 2
    return math.sqrt(total) / float(merged)
