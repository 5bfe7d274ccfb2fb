"""The paper's spectral merges (Sec. 4): SWUDI, SWUDI-A and the generic filter family.

Each is one call of :func:`~specmerge.linalg.solve.spectral_merge` with a filter h on the spectrum of C:
tau_hat = tau_init + (D - tau_init C) Q diag(h_k / lambda_k) Q^T (paper Eq. 8). All are exact on the cores
of LoRA experts (``factored``): they are told the real layer shape for ceil(r d_in), the rank rules and the
resolution floor. The plain closed form D C^+ is ``closed_form`` in :mod:`specmerge.methods.wudi`.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

from specmerge.linalg import rank_rules
from specmerge.linalg.filters import Exponential, Filter, Landweber, PseudoInverse, Tikhonov, TopK
from specmerge.linalg.quadratic import TauInit
from specmerge.linalg.solve import Kept, spectral_merge
from specmerge.linalg.spectrum import RankRule, Spectrum, choose_rank
from specmerge.methods.operations import RANK_RULE_ASSUMPTION, Operations, Shape, rank_rule_kept, spectral_merge_ops
from specmerge.methods.params import Count, NonNegative, NonNegativeOrInf, Positive, UnitInterval
from specmerge.methods.registry import LayerResult, Setting, register
from specmerge.methods.wudi import PAPER_CITATION

# The accuracy benchmark's grids, trimmed from the paper's (BENCHMARKS.md): SWUDI r x t, the exponential filter's t.
BENCH_RANK_RATIOS = (0.55, 0.65, 0.75, 0.85)
BENCH_TIMES = (300.0, 800.0, 1300.0, 1800.0)


def swudi_cost(shape: Shape, itemsize: int, params: dict) -> Operations:
    """One spectral merge keeping K = ceil(r d_in) directions."""
    kept = rank_rules.fixed_ratio_rank(params["rank_ratio"], shape[-1])
    return spectral_merge_ops(shape, itemsize, kept, params["tau_init"])


def swudi_a_cost(shape: Shape, itemsize: int, params: dict) -> Operations:
    """One spectral merge keeping the K of a rank rule (data-dependent: half the rank bound assumed)."""
    return spectral_merge_ops(shape, itemsize, rank_rule_kept(shape), params["tau_init"], RANK_RULE_ASSUMPTION)


def spectral_filter_cost(shape: Shape, itemsize: int, params: dict) -> Operations:
    """One spectral merge: every direction (``rank`` all), K = ceil(r d_in), or a rank rule's K (assumed)."""
    rank, tau_init = params["rank"], params["tau_init"]
    if rank == "all":
        return spectral_merge_ops(shape, itemsize, None, tau_init)
    if rank == "ratio":
        return spectral_merge_ops(
            shape, itemsize, rank_rules.fixed_ratio_rank(params["rank_ratio"], shape[-1]), tau_init
        )
    return spectral_merge_ops(shape, itemsize, rank_rule_kept(shape), tau_init, RANK_RULE_ASSUMPTION)


def kept_directions(method: str, params: dict) -> Kept:
    """Which directions a spectral method's filter can keep, known before the decomposition (see
    :func:`~specmerge.linalg.solve.spectral_merge`): SWUDI's leading ceil(r d_in), a rank rule's leading K, or any.
    ``params`` are the method's validated parameters; the spectral cache asks too, to store the spectra they use."""
    rank = {"swudi": "ratio", "swudi_a": params.get("rule")}.get(method, params.get("rank", "all"))
    if rank == "all":
        return None
    if rank == "ratio":
        return functools.partial(rank_rules.fixed_ratio_rank, params["rank_ratio"])
    return rank


@register(
    "swudi",
    citation=PAPER_CITATION,
    title="SWUDI",
    factored=True,
    settings=[Setting("swudi", "SWUDI (r, t on val)", grid={"rank_ratio": BENCH_RANK_RATIOS, "t": BENCH_TIMES})],
    cost=swudi_cost,
    spectral=True,
)
def swudi(
    task_vectors: torch.Tensor,
    *,
    rank_ratio: UnitInterval = 0.65,
    t: NonNegativeOrInf = 1300.0,
    tau_init: TauInit = "sum",
    scale: float = 1.0,
    full_shape: tuple[int, int] | None = None,
) -> LayerResult:
    """SWUDI: top-ceil(r d_in) truncation times the exponential filter 1 - exp(-t lambda) (paper Eq. 11).

    Args:
        rank_ratio: r in [0, 1]; keeps K = ceil(r * d_in) leading eigendirections (paper grid 0.55-0.85).
        t: gradient-flow time of the exponential filter (paper grid 300-1800; CLIP 1300); inf for none.
        tau_init: point the filter starts from: sum or mean of the task vectors, or zero (D C_h^+).
        scale: s in merged = W_0 + s * tau_hat.
    """

    def make_filter(spectrum: Spectrum) -> tuple[Filter, int]:
        k = rank_rules.fixed_ratio_rank(rank_ratio, spectrum.n_cols)
        return TopK(k) * Exponential(t), k

    kept = kept_directions("swudi", {"rank_ratio": rank_ratio})
    return LayerResult(*spectral_merge(task_vectors, make_filter, tau_init, scale, full_shape, kept=kept))


@register(
    "swudi_a",
    citation=PAPER_CITATION,
    title="SWUDI-A",
    factored=True,
    settings=[
        Setting("swudi_a_psqrt", "SWUDI-A (psqrt)", {"rule": "psqrt"}),
        Setting("swudi_a_gd", "SWUDI-A (Gavish–Donoho)", {"rule": "gavish_donoho"}),
    ],
    cost=swudi_a_cost,
    spectral=True,
)
def swudi_a(
    task_vectors: torch.Tensor,
    *,
    rule: RankRule = "psqrt",
    tau_init: TauInit = "sum",
    scale: float = 1.0,
    full_shape: tuple[int, int] | None = None,
) -> LayerResult:
    """SWUDI-A: hard top-K truncation with K chosen per layer by a rank rule (paper Sec. 4.2).

    Args:
        rule: psqrt (CLIP, Flan-T5, MLLMs), gavish_donoho (full fine-tuned LLMs; may keep K = 0), or participation.
        tau_init: point the filter starts from: sum or mean of the task vectors, or zero (D C_h^+).
        scale: s in merged = W_0 + s * tau_hat.
    """

    def make_filter(spectrum: Spectrum) -> tuple[Filter, int]:
        k = choose_rank(rule, spectrum)
        return TopK(k), k

    kept = kept_directions("swudi_a", {"rule": rule})
    result = LayerResult(*spectral_merge(task_vectors, make_filter, tau_init, scale, full_shape, kept=kept))
    result.diagnostics["rule"] = rule
    return result


@register(
    "spectral_filter",
    citation=PAPER_CITATION,
    title="Spectral filter",
    factored=True,
    featured=False,  # a family for studies and sweeps: its useful members are the methods above
    settings=[
        Setting(
            "exponential",
            "Exponential filter, no truncation (t on val)",
            {"filter": "exponential"},
            {"t": BENCH_TIMES},
        )
    ],
    cost=spectral_filter_cost,
    spectral=True,
)
def spectral_filter(
    task_vectors: torch.Tensor,
    *,
    filter: Literal["pinv", "exponential", "landweber", "tikhonov"] = "exponential",
    t: NonNegative = 300.0,
    eta: Positive = 0.1,
    steps: Count = 300,
    alpha: Positive = 1e-3,
    rank: Literal["all", "ratio", "psqrt", "gavish_donoho", "participation"] = "all",
    rank_ratio: UnitInterval = 1.0,
    tau_init: TauInit = "sum",
    scale: float = 1.0,
    full_shape: tuple[int, int] | None = None,
) -> LayerResult:
    """Any member of the filter family, optionally times a top-K mask, for studies and sweeps.

    Args:
        filter: soft filter: pinv (h = 1), exponential (1 - exp(-t lambda)),
            landweber (1 - (1 - eta lambda)^steps), tikhonov (lambda / (lambda + alpha)).
        t: time of the exponential filter.
        eta: Landweber step size; stable for eta < 2 / lambda_max (lambda_max <= N).
        steps: number of Landweber steps.
        alpha: Tikhonov ridge.
        rank: hard mask: all directions, a fixed ratio of d_in, or a rank rule.
        rank_ratio: r for rank = ratio: K = ceil(r * d_in).
        tau_init: point the filter starts from: sum or mean of the task vectors, or zero (D C_h^+).
        scale: s in merged = W_0 + s * tau_hat.
    """
    soft: Filter = {
        "pinv": PseudoInverse(),
        "exponential": Exponential(t),
        "landweber": Landweber(eta, steps),
        "tikhonov": Tikhonov(alpha),
    }[filter]

    def make_filter(spectrum: Spectrum) -> tuple[Filter, int | None]:
        if rank == "all":
            return soft, None
        k = rank_rules.fixed_ratio_rank(rank_ratio, spectrum.n_cols) if rank == "ratio" else choose_rank(rank, spectrum)
        return TopK(k) * soft, k

    kept = kept_directions("spectral_filter", {"rank": rank, "rank_ratio": rank_ratio})
    return LayerResult(*spectral_merge(task_vectors, make_filter, tau_init, scale, full_shape, kept=kept))
