"""Optimizer as a spectral filter (paper Sec. 3.2.3, App. B.4 and C.2): iterative WUDI's empirical filter and its fits.

Plain gradient descent on the WUDI loss is exactly a Landweber filter on the normal equation tau C = D;
Adam is close to an exponential filter. For one layer's problem (:class:`FilterProblem`, dense or from
LoRA cores) :func:`optimizer_filter_trace` runs the descent and, at checkpoints, measures the per-direction
filter h_k of the iterate and fits the exponential and Landweber filters to it (R^2 and RMSE).
Pure functions, tensors in and numbers out, like :mod:`specmerge.diagnostics.statistics`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from scipy import optimize

from specmerge.diagnostics.statistics import projected_residual
from specmerge.linalg.filters import Exponential, Landweber
from specmerge.linalg.optimize import Optimizer, descend, quadratic_gradient
from specmerge.linalg.quadratic import NormalEquation
from specmerge.linalg.spectrum import Spectrum


@dataclass(frozen=True)
class FilterProblem:
    """One layer's WUDI quadratic in dense coordinates, with the eigenbasis of C on its non-zero eigenvalues.

    ``times_C(X)`` is X C; it satisfies :class:`specmerge.linalg.optimize.Quadratic`, so
    :func:`specmerge.linalg.optimize.quadratic_gradient` gives the optimizer's gradient 2 (tau C - D).
    """

    D: torch.Tensor  # d_out x d_in
    tau_init: torch.Tensor  # d_out x d_in, the start of descent (and of the filter)
    Q: torch.Tensor  # d_in x rank
    eigenvalues: torch.Tensor  # rank, descending, all > 0
    times_C: Callable[[torch.Tensor], torch.Tensor]

    def residual_projections(self) -> torch.Tensor:
        """B Q with B = D - tau_init C: the closed-form residual of direction k is B q_k / lambda_k."""
        return projected_residual(self.D, self.tau_init, self.Q, self.eigenvalues)


def dense_problem(eq: NormalEquation, spectrum: Spectrum, tau_init: torch.Tensor | None) -> FilterProblem:
    """The filter problem of a dense layer; ``tau_init`` None is the zero start."""
    start = torch.zeros_like(eq.D) if tau_init is None else tau_init
    lam = spectrum.eigenvalues[: spectrum.rank]
    return FilterProblem(eq.D, start, spectrum.eigenvectors, lam, eq.times_C)


def factored_problem(
    P: torch.Tensor, R: torch.Tensor, core: NormalEquation, spectrum: Spectrum, core_init: torch.Tensor | None
) -> FilterProblem:
    """The filter problem of a LoRA layer, tau_i = P T_i R^T, in dense coordinates without forming C.

    D = P D_T R^T, q_k = R v_k, and X C = ((X R) C_T) R^T costs O(d_out d_in rank) instead of d_in^2.
    """
    C_core = core.C
    start = torch.zeros_like(core.D) if core_init is None else core_init
    lam = spectrum.eigenvalues[: spectrum.rank]
    return FilterProblem(
        P @ core.D @ R.T, P @ start @ R.T, R @ spectrum.eigenvectors, lam, lambda X: ((X @ R) @ C_core) @ R.T
    )


# Directions whose closed-form residual ||B q_k|| is below this share of the largest carry no filter
# information (0 / 0): they are left out of the empirical filter and its fits.
_RESIDUAL_FLOOR = 1e-12


def fit_directions(problem: FilterProblem) -> torch.Tensor:
    """Boolean mask of the directions whose empirical filter is defined (residual above the floor)."""
    weight = problem.residual_projections().pow(2).sum(dim=0)
    return weight > _RESIDUAL_FLOOR * float(weight.max()) if weight.numel() else weight > 0


def empirical_filter(problem: FilterProblem, tau: torch.Tensor) -> torch.Tensor:
    """h_k = lambda_k <(tau - tau_init) q_k, B q_k> / ||B q_k||^2, the per-direction filter of an iterate.

    Relative to the closed-form solution from the same start: the update of direction k projected on the
    pseudoinverse's update B q_k / lambda_k. For any tau of the unified estimator (paper Eq. 8) this returns
    its h_k exactly; for Adam, whose update is not parallel to B q_k, it is the least-squares coefficient.
    """
    BQ = problem.residual_projections()
    update = (tau - problem.tau_init) @ problem.Q
    return problem.eigenvalues * (update * BQ).sum(dim=0) / BQ.pow(2).sum(dim=0)


# Below this standard deviation an empirical filter is flat (saturated at 1 after many steps, or all 0):
# its spread is rounding noise, and an R^2 against it is undefined (nan); the RMSE still says how close the fit is.
_FLAT_FILTER_STD = 1e-6


def r_squared(observed: torch.Tensor, fitted: torch.Tensor) -> float:
    """Coefficient of determination 1 - SSE / SST; nan when the observed values are flat (std below 1e-6)."""
    y, f = observed.double(), fitted.double()
    sse = float((y - f).pow(2).sum())
    sst = float((y - y.mean()).pow(2).sum())
    if sst <= y.numel() * _FLAT_FILTER_STD**2:
        return math.nan
    return 1 - sse / sst


def rmse(observed: torch.Tensor, fitted: torch.Tensor) -> float:
    """Root mean squared difference."""
    return float((observed.double() - fitted.double()).pow(2).mean().sqrt())


def _fit_scalar(model: Callable[[float], torch.Tensor], observed: torch.Tensor, lo: float, hi: float) -> float:
    """The x in [lo, hi] (log-spaced search, then bounded Brent) minimising ||observed - model(x)||^2."""

    def sse(log_x: float) -> float:
        return float((observed - model(math.exp(log_x))).pow(2).sum())

    grid = torch.linspace(math.log(lo), math.log(hi), 241).tolist()
    values = [sse(g) for g in grid]
    best = min(range(len(grid)), key=values.__getitem__)
    left, right = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    if right <= left:
        return math.exp(grid[best])
    found = optimize.minimize_scalar(sse, bounds=(left, right), method="bounded", options={"xatol": 1e-10})
    return math.exp(found.x) if found.fun <= values[best] else math.exp(grid[best])


@dataclass(frozen=True)
class Fit:
    """A one-parameter filter fitted to an empirical filter: the parameter, R^2 and RMSE."""

    value: float
    r2: float
    rmse: float


def fit_exponential(eigenvalues: torch.Tensor, h: torch.Tensor) -> Fit:
    """Best t of h_k ~ 1 - exp(-t lambda_k) (least squares), with the fit's R^2 and RMSE."""
    lam = eigenvalues.double()
    t = _fit_scalar(lambda x: Exponential(x)(lam), h.double(), 1e-6 / float(lam.max()), 1e8 / float(lam.min()))
    fitted = Exponential(t)(lam)
    return Fit(t, r_squared(h, fitted), rmse(h, fitted))


def fit_landweber(eigenvalues: torch.Tensor, h: torch.Tensor, eta: float) -> Fit:
    """Best step count n (real) of h_k ~ 1 - (1 - eta lambda_k)^n for a fixed eta, with R^2 and RMSE.

    Needs eta lambda_max < 1 (the non-oscillating regime, where a real n is meaningful); else all nan.
    """
    lam = eigenvalues.double()
    if not eta * float(lam.max()) < 1:
        return Fit(math.nan, math.nan, math.nan)
    steps = _fit_scalar(
        lambda x: Landweber(eta, x)(lam), h.double(), 1e-6 / (eta * float(lam.max())), 1e8 / (eta * float(lam.min()))
    )
    fitted = Landweber(eta, steps)(lam)
    return Fit(steps, r_squared(h, fitted), rmse(h, fitted))


@dataclass(frozen=True)
class FilterFit:
    """The empirical filter of one optimizer after ``step`` steps and its exponential / Landweber fits."""

    optimizer: str
    step: int
    lr: float
    t_eff: float
    r2_exponential: float
    rmse_exponential: float
    n_eff: float
    r2_landweber: float
    rmse_landweber: float
    h: torch.Tensor  # the empirical filter on the fitted directions

    def row(self) -> dict[str, Any]:
        """The fit as a flat record (without the filter values)."""
        return {
            "optimizer": self.optimizer,
            "step": self.step,
            "lr": self.lr,
            "t_eff": self.t_eff,
            "r2_exponential": self.r2_exponential,
            "rmse_exponential": self.rmse_exponential,
            "n_eff": self.n_eff,
            "r2_landweber": self.r2_landweber,
            "rmse_landweber": self.rmse_landweber,
        }


def optimizer_filter_trace(
    problem: FilterProblem, *, optimizer: Optimizer, lr: float, checkpoints: Sequence[int]
) -> list[FilterFit]:
    """Run WUDI descent (:func:`~specmerge.linalg.optimize.descend`, gradient 2 (tau C - D)) and fit its filter
    at checkpoints.

    A step of size a on the WUDI loss is a Landweber step eta = 2a on the normal equation
    (:mod:`specmerge.linalg.optimize`), so the Landweber fit uses eta = 2 lr and, for plain gradient descent,
    recovers n_eff = step exactly. The exponential fit's t_eff is in the same units (t = eta n for small eta lambda).
    Once the filter has saturated (h = 1 on every direction) R^2 is undefined (nan); the RMSE remains.
    """
    mask = fit_directions(problem)
    lam = problem.eigenvalues[mask]
    wanted = sorted({int(s) for s in checkpoints if s >= 1})
    fits: list[FilterFit] = []

    def record(step: int, tau: torch.Tensor) -> None:
        if step in wanted:
            h = empirical_filter(problem, tau)[mask]
            exp, lw = fit_exponential(lam, h), fit_landweber(lam, h, 2 * lr)
            fits.append(FilterFit(optimizer, step, lr, exp.value, exp.r2, exp.rmse, lw.value, lw.r2, lw.rmse, h.cpu()))

    if wanted:
        descend(
            problem.tau_init,
            quadratic_gradient(problem),
            steps=wanted[-1],
            lr=lr,
            optimizer=optimizer,
            callback=record,
        )
    return fits
