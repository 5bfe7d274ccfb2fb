"""Model Breadcrumbs, and mergekit's Breadcrumbs-TIES: keep a band of each task vector's magnitudes, then combine.

The band drops each task vector's largest entries (outliers) and its smallest, keeping those between. Breadcrumbs
sums the banded task vectors (weighted), as task arithmetic does; Breadcrumbs-TIES (mergekit's ``breadcrumbs_ties``)
elects a sign per entry and combines the agreeing entries, as TIES does. ``convention: mergekit`` computes
mergekit's band and arithmetic (:mod:`.gta`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specmerge.linalg.topk import KEEP_ALL, fraction_count, keep_mask, top_k_count, top_k_rule
from specmerge.methods import gta
from specmerge.methods.gta import Convention, per_expert_values
from specmerge.methods.operations import Operations, Shape, numel, passes
from specmerge.methods.params import per_expert
from specmerge.methods.registry import LayerResult, register, register_variant
from specmerge.methods.sparse import Densities, DropRate, combine_dropped

BREADCRUMBS_CITATION = (
    "Davari & Belilovsky, Model Breadcrumbs: Scaling Multi-Task Model Merging with Sparse Masks, ECCV 2024"
)
Betas = per_expert(DropRate)


def breadcrumbs_cost(shape: Shape, itemsize: int, params: dict) -> Operations:
    """Per expert two top-k selections and the band's masks (about 16 passes), the masked stack and its sum (or the
    election and disjoint mean)."""
    n, x = shape[0], numel(shape[1:])
    combine = 15 * n + 6 if params.get("elect") else n + 2
    return passes(16 * n + combine, x, itemsize) + Operations(select=2 * n * x, workspace=n * x * (itemsize + 1))


def band_mask(tau: torch.Tensor, density: float, beta: float) -> torch.Tensor:
    """The paper's band of a flat task vector: drop the floor(beta n) largest magnitudes, keep the next
    ceil(density n) (at most n - floor(beta n)); equal magnitudes at an edge ranked in storage order."""
    n = tau.numel()
    top = fraction_count(beta, n, round_up=False)
    kept = min(top_k_count(density, n), n - top)
    keep = keep_mask(tau, KEEP_ALL if top + kept == n else top_k_rule(tau, top + kept))
    if top:
        keep &= ~keep_mask(tau, top_k_rule(tau, top))
    return keep


@register(
    "breadcrumbs",
    citation=BREADCRUMBS_CITATION,
    title="Model Breadcrumbs",
    needs_matrix=False,
    fixed={"elect": False},
    cost=breadcrumbs_cost,
    weights="any",
    check=lambda params, n: gta.check_rescale(params),
)
def breadcrumbs(
    task_vectors: torch.Tensor,
    *,
    elect: bool,
    density: Densities = 0.9,
    beta: Betas = 0.01,
    scale: float = 0.3,
    normalize: bool = False,
    rescale: bool = False,
    convention: Convention = "paper",
    weights: Sequence[float] | None = None,
) -> LayerResult:
    """Model Breadcrumbs: keep a band of each task vector's magnitudes (no outliers, no small entries), then sum.

    Per expert and tensor, the m = floor(beta * numel) entries of largest |tau_i| are dropped, the
    next k = ceil(density * numel) are kept (at most numel - m), and the smallest rest is dropped; the
    masked task vectors are summed (weighted: sum_i w_i band(tau_i)) and scaled, as in task arithmetic. Of
    equal magnitudes at either edge of the band, those first in storage order rank higher, so the band is the
    same on every machine. ``elect`` is the declared difference of breadcrumbs_ties: signs elected and the
    agreeing entries combined, as in TIES.

    Args:
        density: fraction of entries kept per expert and tensor, k = ceil(density * numel), in (0, 1]; one value,
            or one per expert.
        beta: fraction of largest-magnitude entries dropped first, m = floor(beta * numel), in [0, 1) (mergekit's
            gamma); one value, or one per expert.
        scale: lambda in merged = W_0 + lambda * sum_i band(tau_i) (0.3 as for task arithmetic).
        normalize: divide the (agreeing) entries' weighted sum by the sum of the (agreeing) weights; false: the sum.
        rescale: scale each banded task vector back to its L1 norm (convention mergekit only).
        convention: paper, or mergekit: mergekit's band (floor(density n) kept below the floor(gamma n) largest,
            fewer outliers dropped when both do not fit) and arithmetic (specmerge.methods.gta).
    """
    n = task_vectors.shape[0]
    densities, betas = per_expert_values(density, n), per_expert_values(beta, n)
    if convention == "mergekit":
        how = gta.Sparsify("band", densities, rescale, gamma=betas)
        merged = gta.merge(task_vectors, how, weights=weights, elect=elect, normalize=normalize, scale=scale)
        return LayerResult(merged, {"n_experts": n})
    flat = task_vectors.reshape(n, -1)
    band = torch.stack([band_mask(tau_i, densities[i], betas[i]) for i, tau_i in enumerate(flat)])
    masked = torch.where(band, flat, flat.new_zeros(())).reshape(task_vectors.shape)
    top = fraction_count(betas[0], flat.shape[1], round_up=False)
    diagnostics = {"kept_per_expert": int(band[0].sum()), "dropped_largest": top}
    return combine_dropped(masked, "disjoint_mean" if elect else "sum", scale, weights, diagnostics, normalize)


breadcrumbs_ties = register_variant(
    "breadcrumbs_ties",
    breadcrumbs,
    title="Breadcrumbs-TIES",
    summary="Model Breadcrumbs with TIES's sign election (mergekit's breadcrumbs_ties): band each task vector, elect "
    "a sign per entry, combine the agreeing entries (their sum; normalize: their weighted mean).",
    fixed={"elect": True},
    featured=False,
    settings=(),
    weights="positive",
)
