"""Spectral diagnostics of the WUDI normal equation tau C = D, per layer and per model (paper Sec. 6.2, App. B-C).

Pure functions, tensors in and numbers out: statistics of the eigenvalues of C (effective ranks,
conditioning ratios, the kept rank of every rank rule), the share of the WUDI proxy reduction that a
filter keeps, the filters h_k themselves, and the optimizer-as-filter diagnostic (the empirical
per-direction filter of iterative WUDI, fitted by the exponential and Landweber filters). The
summary over layers reproduces the rows of the paper's per-architecture table (App. C, Table XVII).
Nothing here reads files; :mod:`specmerge.diagnostics.inspect` streams a model through these functions.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from scipy import optimize

from specmerge.linalg import rank_rules
from specmerge.linalg.filters import Exponential, Filter, Landweber, PseudoInverse, Tikhonov, TopK
from specmerge.methods.iterative import Optimizer, descend, quadratic_gradient
from specmerge.methods.spectral import NormalEquation, Spectrum, choose_rank

# ---------------------------------------------------------------------------------------------
# Statistics of one spectrum


def participation_ratio(values: torch.Tensor) -> float:
    """(sum v)^2 / sum v^2 of non-negative values (negatives clamped to 0): K for K equal values; 0 if all zero."""
    v = values.detach().double().clamp(min=0)
    square = float((v * v).sum())
    return 0.0 if square == 0 else float(v.sum()) ** 2 / square


def entropy_effective_rank(eigenvalues: torch.Tensor) -> float:
    """Roy-Vetterli effective rank exp(H(p)), p_k = sigma_k / sum sigma, sigma = sqrt(lambda); 0 if all zero."""
    sigma = eigenvalues.detach().double().clamp(min=0).sqrt()
    total = float(sigma.sum())
    if total == 0:
        return 0.0
    p = sigma[sigma > 0] / total
    return math.exp(float(-(p * p.log()).sum()))


def effective_ranks(eigenvalues: torch.Tensor) -> dict[str, float]:
    """Effective ranks of C's spectrum, unrounded.

    ``participation``: (sum lambda)^2 / sum lambda^2, the r_eff of the paper's table (App. C);
    ``psqrt``: (sum sigma)^2 / sum sigma^2, the psqrt rule before its ceiling (paper Eq. 12);
    ``entropy``: exp of the entropy of sigma / sum sigma (Roy and Vetterli 2007).
    All three equal K for a flat spectrum on K directions.
    """
    return {
        "participation": participation_ratio(eigenvalues),
        "psqrt": participation_ratio(eigenvalues.detach().double().clamp(min=0).sqrt()),
        "entropy": entropy_effective_rank(eigenvalues),
    }


def full_spectrum(eigenvalues: torch.Tensor, d_in: int) -> torch.Tensor:
    """All d_in eigenvalues of C in descending order (float64): the structural zeros appended when N d_out < d_in."""
    lam = eigenvalues.detach().double().clamp(min=0)[:d_in]
    return torch.cat([lam, lam.new_zeros(d_in - lam.numel())])


def spectrum_ratios(eigenvalues: torch.Tensor, d_in: int) -> dict[str, float]:
    """lambda_max, lambda_med, lambda_90 and the table's ratios, over all d_in eigenvalues of C (App. C).

    lambda_90 = lambda_ceil(0.9 d_in) in descending order; the median is the usual one (mean of the two
    middle values for even d_in). Eigenvalues at or below the solver's tolerance are exact zeros here, so
    a rank-deficient C (LoRA experts) gives lambda_max / lambda_med = inf and lambda_90 / lambda_max = 0.
    """
    lam = full_spectrum(eigenvalues, d_in)
    lam_max = float(lam[0]) if d_in else 0.0
    median = float(lam.median()) if d_in % 2 else float(lam[d_in // 2 - 1 : d_in // 2 + 1].mean())
    lam_90 = float(lam[math.ceil(0.9 * d_in) - 1]) if d_in else 0.0
    return {
        "lambda_max": lam_max,
        "lambda_median": median,
        "lambda_90": lam_90,
        "max_over_median": _ratio(lam_max, median),
        "l90_over_max": _ratio(lam_90, lam_max),
    }


def _ratio(a: float, b: float) -> float:
    if b > 0:
        return a / b
    return math.nan if a == 0 else math.inf


def kept_ranks(spectrum: Spectrum, rank_ratio: float) -> dict[str, int]:
    """K of every rank rule on this spectrum: ``fixed`` = ceil(r d_in) (SWUDI), psqrt, Gavish-Donoho, participation."""
    return {
        "fixed": rank_rules.fixed_ratio_rank(rank_ratio, spectrum.n_cols),
        "psqrt": choose_rank("psqrt", spectrum),
        "gavish_donoho": choose_rank("gavish_donoho", spectrum),
        "participation": choose_rank("participation", spectrum),
    }


# ---------------------------------------------------------------------------------------------
# WUDI proxy reduction per eigendirection


def residual_projections(eq: NormalEquation, spectrum: Spectrum, tau_init: torch.Tensor | None) -> torch.Tensor:
    """B Q for B = D - tau_init C and the eigenvectors Q with non-zero eigenvalue (d_out x rank), paper App. B.3."""
    return _projected(eq.D, tau_init, spectrum.eigenvectors, spectrum.eigenvalues[: spectrum.rank])


def _projected(D: torch.Tensor, tau_init: torch.Tensor | None, Q: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """(D - tau_init C) Q computed as D Q - (tau_init Q) diag(lambda), C never formed."""
    projected = D @ Q
    return projected if tau_init is None else projected - (tau_init @ Q) * lam


def direction_reductions(eq: NormalEquation, spectrum: Spectrum, tau_init: torch.Tensor | None) -> torch.Tensor:
    """r_k = ||B q_k||^2 / lambda_k: how much the WUDI proxy drops when direction k is fully inverted.

    With tau = tau_init + B Q diag(h / lambda) Q^T (paper Eq. 8) the proxy drops by sum_k (2 h_k - h_k^2) r_k,
    so the pseudoinverse (h = 1) achieves the whole reduction sum_k r_k.
    """
    lam = spectrum.eigenvalues[: spectrum.rank].double()
    return residual_projections(eq, spectrum, tau_init).double().pow(2).sum(dim=0) / lam


def reduction_share(reductions: torch.Tensor, gains: torch.Tensor) -> float:
    """Share of the pseudoinverse's proxy reduction kept by filter gains h: sum (2h - h^2) r / sum r."""
    h = gains[: reductions.numel()].double()
    total = float(reductions.sum())
    return float(((2 * h - h * h) * reductions).sum()) / total if total > 0 else math.nan


def cut_share(reductions: torch.Tensor, k: int) -> float:
    """Share of the proxy reduction kept by the hard cut h = 1[k <= K] (the rank rules' cuts)."""
    return reduction_share(reductions, TopK(k)(reductions))


def layer_statistics(
    eq: NormalEquation,
    spectrum: Spectrum,
    tau_init: torch.Tensor | None,
    *,
    expert_norms: torch.Tensor,
    base_norm: float,
    rank_ratio: float,
) -> dict[str, Any]:
    """Every per-layer figure of ``specmerge inspect`` for one layer's normal equation and spectrum.

    ``expert_norms`` are ||tau_i||_F of all N experts (zeros included), ``base_norm`` is ||W_0||_F.
    The spectrum may be that of LoRA cores (``spectral.decompose(eq, full_shape)``): its n_cols and
    n_rows are the real layer's, and every figure equals the dense layer's.
    """
    d_in = spectrum.n_cols
    ranks = kept_ranks(spectrum, rank_ratio)
    reductions = direction_reductions(eq, spectrum, tau_init)
    eff = effective_ranks(spectrum.eigenvalues)
    row: dict[str, Any] = {
        "n_nonzero": eq.n_experts,
        "rel_norms": [float(n) / base_norm if base_norm > 0 else math.nan for n in expert_norms],
        "numerical_rank": spectrum.rank,
        "trace_C": float(spectrum.eigenvalues.double().sum()),
        # conditioning on the range of C: finite where max / median is inf (rank-deficient C, LoRA experts)
        "condition_on_range": float(spectrum.eigenvalues[0] / spectrum.eigenvalues[spectrum.rank - 1]),
        **spectrum_ratios(spectrum.eigenvalues, d_in),
        "r_eff_participation": eff["participation"],
        "r_eff_psqrt": eff["psqrt"],
        "r_eff_entropy": eff["entropy"],
    }
    for rule, k in ranks.items():
        row[f"K_{rule}"] = k
        row[f"K_{rule}_ratio"] = k / d_in
        row[f"share_{rule}"] = cut_share(reductions, k)
    row["proxy_reduction"] = float(reductions.sum())
    return row


# ---------------------------------------------------------------------------------------------
# Filter shapes


def filter_family(
    eigenvalues: torch.Tensor, *, t: float, rank_ratio: float, alpha: float, adaptive_rank: int
) -> dict[str, torch.Tensor]:
    """h_k of the pseudoinverse, Tikhonov(alpha), exponential(t), SWUDI (r, t) and SWUDI-A (K) on one spectrum.

    Directions with lambda_k = 0 get gain 0, as in the solver (they are never inverted).
    """
    lam = eigenvalues.detach().double()
    fixed = rank_rules.fixed_ratio_rank(rank_ratio, lam.numel())
    family: dict[str, Filter] = {
        "pseudoinverse": PseudoInverse(),
        f"Tikhonov (alpha={alpha:g})": Tikhonov(alpha),
        f"exponential (t={t:g})": Exponential(t),
        f"SWUDI (r={rank_ratio:g}, t={t:g})": TopK(fixed) * Exponential(t),
        f"SWUDI-A (K={adaptive_rank})": TopK(adaptive_rank),
    }
    return {name: torch.where(lam > 0, f(lam), torch.zeros_like(lam)) for name, f in family.items()}


# ---------------------------------------------------------------------------------------------
# Optimizer as filter (paper Sec. 3.2.3, App. B.4 and C.2)


@dataclass(frozen=True)
class FilterProblem:
    """One layer's WUDI quadratic in dense coordinates, with the eigenbasis of C on its non-zero eigenvalues.

    ``times_C(X)`` is X C; it satisfies :class:`specmerge.methods.iterative.Quadratic`, so
    :func:`specmerge.methods.iterative.quadratic_gradient` gives the optimizer's gradient 2 (tau C - D).
    """

    D: torch.Tensor  # d_out x d_in
    tau_init: torch.Tensor  # d_out x d_in, the start of descent (and of the filter)
    Q: torch.Tensor  # d_in x rank
    eigenvalues: torch.Tensor  # rank, descending, all > 0
    times_C: Callable[[torch.Tensor], torch.Tensor]

    def residual_projections(self) -> torch.Tensor:
        """B Q with B = D - tau_init C: the closed-form residual of direction k is B q_k / lambda_k."""
        return _projected(self.D, self.tau_init, self.Q, self.eigenvalues)


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
    """Run WUDI descent (:func:`~specmerge.methods.iterative.descend`,
    gradient 2 (tau C - D)) and fit its filter at checkpoints.

    A step of size a on the WUDI loss is a Landweber step eta = 2a on the normal equation
    (``specmerge.methods.iterative``), so the Landweber fit uses eta = 2 lr and, for plain gradient descent,
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


# ---------------------------------------------------------------------------------------------
# Layer types and the per-model summary


def layer_type(name: str) -> str:
    """The name without its block index: ``encoder.layer.3.attention.self.query.weight`` -> ``attention.self.query``."""
    parts = name.removesuffix(".weight").split(".")
    numeric = [i for i, p in enumerate(parts) if p.isdigit()]
    return ".".join(parts[numeric[-1] + 1 :]) if numeric and numeric[-1] + 1 < len(parts) else ".".join(parts)


def layer_depth(name: str) -> int | None:
    """The last block index in a tensor name (``model.layers.7.mlp.up_proj.weight`` -> 7), or None."""
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    return int(found[-1]) if found else None


def coefficient_of_variation(values: Iterable[float]) -> float:
    """Population standard deviation over mean (nan for no values or a zero mean)."""
    v = [float(x) for x in values]
    mean = sum(v) / len(v) if v else 0.0
    return statistics.pstdev(v) / mean if v and mean else math.nan


def _median(values: Iterable[float]) -> float:
    v = [float(x) for x in values if not math.isnan(float(x))]
    return statistics.median(v) if v else math.nan


def _mean(values: Iterable[float]) -> float:
    v = [float(x) for x in values]
    return sum(v) / len(v) if v else math.nan


def summarize_layers(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The paper's per-architecture statistics (App. C, Table XVII) over per-layer rows, plus the cuts' proxy shares.

    Rows are those of :func:`specmerge.diagnostics.inspect` (keys ``d_in``, ``rel_norms``, ``r_eff_participation``,
    ``max_over_median``, ``l90_over_max``, ``lambda_max``, ``K_<rule>``, ``share_<rule>``); layers whose
    experts are all zero are left out. The mean update magnitude runs over the (expert, layer) pairs with a
    non-zero delta (a LoRA adapter that does not touch a layer does not count as a zero update).
    """
    live = [r for r in rows if r.get("n_nonzero", 0) > 0]
    magnitudes = [m for r in live for m in r["rel_norms"] if m > 0]
    psqrt = [r["K_psqrt"] for r in live]
    summary: dict[str, Any] = {
        "n_layers": len(live),
        "mean_update_magnitude": _mean(magnitudes),
        "effective_rank_ratio": _mean(r["r_eff_participation"] / r["d_in"] for r in live),
        "median_max_over_median": _median(r["max_over_median"] for r in live),
        "median_l90_over_max": _median(r["l90_over_max"] for r in live),
        "median_condition_on_range": _median(r["condition_on_range"] for r in live),
        "cv_lambda_max": coefficient_of_variation(r["lambda_max"] for r in live),
        "psqrt_mean_K_ratio": _mean(r["K_psqrt"] / r["d_in"] for r in live),
        "psqrt_K_min": min(psqrt) if psqrt else None,
        "psqrt_K_median": statistics.median(psqrt) if psqrt else None,
        "psqrt_K_max": max(psqrt) if psqrt else None,
    }
    for rule in RULES:
        summary[f"{rule}_mean_K_ratio"] = _mean(r[f"K_{rule}"] / r["d_in"] for r in live)
        summary[f"{rule}_median_share"] = _median(r[f"share_{rule}"] for r in live)
    return summary


RULES = ("fixed", "psqrt", "gavish_donoho", "participation")
