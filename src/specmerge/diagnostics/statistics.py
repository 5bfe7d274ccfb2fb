"""Spectral diagnostics of the WUDI normal equation tau C = D, per layer and per model (paper Sec. 6.2, App. B-C).

Pure functions, tensors in and numbers out: statistics of the eigenvalues of C (effective ranks,
conditioning ratios, the kept rank of every rank rule), the share of the WUDI proxy reduction that a
filter keeps, and the filters h_k themselves. The summary over layers reproduces the rows of the
paper's per-architecture table (App. C, Table XVII). The optimizer-as-filter diagnostic is in
:mod:`specmerge.diagnostics.optimizer_filter`. Nothing here reads files; :mod:`specmerge.diagnostics.run`
streams a model through these functions.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from specmerge.linalg import rank_rules
from specmerge.linalg.filters import Exponential, Filter, PseudoInverse, Tikhonov, TopK
from specmerge.linalg.quadratic import NormalEquation
from specmerge.linalg.spectrum import Spectrum, choose_rank

# The rank rules whose kept rank K every layer row reports (``K_<rule>``, ``share_<rule>``), and their display names.
RULES = ("fixed", "psqrt", "gavish_donoho", "participation")
RULE_LABELS = {
    "fixed": "fixed ratio r (SWUDI)",
    "psqrt": "psqrt (SWUDI-A)",
    "gavish_donoho": "Gavish-Donoho",
    "participation": "eigenvalue participation",
}

# ---------------------------------------------------------------------------------------------
# Statistics of one spectrum


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
        "participation": rank_rules.participation_ratio(eigenvalues),
        "psqrt": rank_rules.participation_ratio(eigenvalues.detach().double().clamp(min=0).sqrt()),
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
    return projected_residual(eq.D, tau_init, spectrum.eigenvectors, spectrum.eigenvalues[: spectrum.rank])


def projected_residual(
    D: torch.Tensor, tau_init: torch.Tensor | None, Q: torch.Tensor, lam: torch.Tensor
) -> torch.Tensor:
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

    Rows are the layer rows of :func:`specmerge.diagnostics.run.inspect_model` (keys ``d_in``, ``rel_norms``,
    ``r_eff_participation``, ``max_over_median``, ``l90_over_max``, ``lambda_max``, ``K_<rule>``, ``share_<rule>``,
    ``condition_on_range``); layers whose experts are all zero are left out. The mean update magnitude runs
    over the (expert, layer) pairs with a non-zero delta (a LoRA adapter that does not touch a layer does not
    count as a zero update).
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
