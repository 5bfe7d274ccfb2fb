"""DELLA: drop each task vector's entries at random with a keep probability that grows with their magnitude.

MagPrune (Deep et al.): within each row of tau_i, entries are ranked by |tau_i|; the entry of normalized
rank u in [0, 1] (0 the smallest, 1 the largest) is kept with probability p(u) = density - epsilon + 2 epsilon u
and, kept, divided by p(u), so that every entry is unbiased. Then, as in TIES, signs are elected and the
agreeing entries averaged (``della``), or the sparsified task vectors are summed (``della_linear``). The random
draws are DARE's (:func:`specmerge.methods.draws.uniform_draws`): a function of (seed, tensor name, the expert's
task vector), the same on every device and in every order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

import torch
from pydantic import Field

from specmerge.methods import gta
from specmerge.methods.draws import mask_keys, uniform_draws
from specmerge.methods.gta import Convention, per_expert_values
from specmerge.methods.operations import Operations, Shape, numel, passes
from specmerge.methods.params import per_expert
from specmerge.methods.registry import LayerResult, register, register_variant
from specmerge.methods.sparse import Densities, combine_dropped

DELLA_CITATION = (
    "Deep et al., DELLA-Merging: Reducing Interference in Model Merging through Magnitude-Based Sampling, 2024"
)
Epsilons = per_expert(Annotated[float, Field(ge=0, lt=1)])


def della_cost(shape: Shape, itemsize: int, params: dict) -> Operations:
    """Per expert a row-wise sort (the ranks), the probabilities, a random draw and the rescaled copy; then the
    sum, or the election and disjoint mean."""
    n, x = shape[0], numel(shape[1:])
    combine = 2 * n + 2 if params.get("combine") == "sum" else 15 * n + 6
    return passes(14 * n + combine, x, itemsize) + Operations(random=n * x, select=n * x, workspace=3 * n * x * 8)


def keep_probabilities(tau: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    """p = density - epsilon + 2 epsilon u per entry of ``tau`` (float32), u its magnitude rank in its row over (row
    length - 1) (0 the smallest; equal magnitudes ranked in storage order; u = 1/2 for a row of one). A 1-D tensor
    is one row; a tensor of more dimensions has rows along its first axis."""
    rows = tau.reshape(1, -1) if tau.dim() < 2 else tau.reshape(tau.shape[0], -1)
    length = rows.shape[1]
    if length < 2:
        return torch.full(tau.shape, density, dtype=torch.float32, device=tau.device)
    order = torch.argsort(rows.abs(), dim=1, stable=True)
    ranks = torch.empty_like(order).scatter_(1, order, torch.arange(length, device=tau.device).expand_as(order))
    u = ranks.to(torch.float32).div_(length - 1)
    return u.mul_(2 * epsilon).add_(density - epsilon).reshape(tau.shape)


def magprune(
    task_vectors: torch.Tensor,
    density: float | Sequence[float],
    epsilon: float | Sequence[float],
    seed: int,
    tensor_name: str,
    rescale: bool = True,
    expert_keys: Sequence[str] | None = None,
) -> torch.Tensor:
    """Each tau_i with entries kept at random with probability :func:`keep_probabilities` and divided by it (unless
    not ``rescale``); ``density`` and ``epsilon``: one value, or one per expert.

    The draws are float32 uniforms on the CPU from the expert's own generator (as DARE's). With epsilon 0 every
    probability is ``density`` (no ranking needed); with density 1 too, every entry is kept as it is.
    """
    keys = mask_keys(task_vectors, expert_keys, tensor_name)
    densities, epsilons = per_expert_values(density, len(keys)), per_expert_values(epsilon, len(keys))
    out = torch.zeros_like(task_vectors)
    for i, key in enumerate(keys):
        tau_i = task_vectors[i]
        if epsilons[i] == 0 and densities[i] == 1:
            out[i] = tau_i
            continue
        draw = uniform_draws(tau_i.shape, seed, tensor_name, key).to(tau_i.device)
        if epsilons[i] == 0:
            p = torch.tensor(densities[i], dtype=torch.float32, device=tau_i.device)
        else:
            p = keep_probabilities(tau_i, densities[i], epsilons[i])
        out[i] = torch.where(draw < p, tau_i / p.to(tau_i.dtype) if rescale else tau_i, out[i])
    return out


def _probabilities_in_range(params: dict, n: int | None) -> None:
    """density -/+ epsilon within (0, 1]; in mergekit's convention within (0, 1), and not checked where density is 1
    (nothing is dropped)."""
    count = max(len(v) for v in (params["density"], params["epsilon"], (0,)) if isinstance(v, tuple))
    pairs = zip(per_expert_values(params["density"], count), per_expert_values(params["epsilon"], count), strict=True)
    mergekit = params["convention"] == "mergekit"
    for density, epsilon in pairs:
        low, high = density - epsilon, density + epsilon
        if mergekit and density >= 1:
            continue
        if not (low > 0 and (high < 1 if mergekit else high <= 1)):
            interval = "(0, 1)" if mergekit else "(0, 1]"
            raise ValueError(
                f"keep probabilities density -/+ epsilon = {low:g} .. {high:g} must lie in {interval}: lower epsilon "
                "or move density"
            )


@register(
    "della",
    citation=DELLA_CITATION,
    title="DELLA",
    needs_matrix=False,
    seeded=True,
    fixed={"combine": "disjoint_mean"},
    cost=della_cost,
    weights="positive",
    check=_probabilities_in_range,
    settings=(),  # not in the accuracy benchmark yet
)
def della(
    task_vectors: torch.Tensor,
    *,
    combine: Literal["sum", "disjoint_mean"],
    density: Densities = 0.5,
    epsilon: Epsilons = 0.15,
    seed: int = 0,
    scale: float = 1.0,
    convention: Convention = "paper",
    normalize: bool = True,
    rescale: bool = True,
    tensor_name: str = "",
    expert_keys: Sequence[str] | None = None,
    weights: Sequence[float] | None = None,
) -> LayerResult:
    """DELLA: MagPrune each task vector (keep probability rising with magnitude, kept entries rescaled), then
    elect signs and average the agreeing entries (weighted by the expert weights, as TIES), times lambda.

    Args:
        density: mean keep probability per entry, in (0, 1]; keep probabilities span density -/+ epsilon; one value,
            or one per expert.
        epsilon: half-width of the keep probabilities: density - epsilon (smallest) to density + epsilon
            (largest magnitude in the row), both within (0, 1]; one value, or one per expert.
        seed: seed of the random draws; the same seed gives the same merge.
        scale: lambda in merged = W_0 + lambda * disjoint_mean (della_linear: lambda * sum).
        normalize: divide the (agreeing) entries' weighted sum by the sum of the (agreeing) weights: the disjoint
            mean; false: the sum.
        rescale: divide each kept entry by its keep probability (mergekit convention: scale each task vector to
            its L1 norm); false: keep them as they are.
        convention: paper, or mergekit: mergekit's arithmetic (L1 rescale, + elected where the sum is 0;
            specmerge.methods.gta).
    """
    if convention == "mergekit":
        n = task_vectors.shape[0]
        densities, epsilons = per_expert_values(density, n), per_expert_values(epsilon, n)
        how = gta.Sparsify("della", densities, rescale, epsilon=epsilons, seed=seed, tensor_name=tensor_name)
        elect = combine == "disjoint_mean"
        pruned = gta.merge_drawn(
            task_vectors, how, expert_keys, weights=weights, elect=elect, normalize=normalize, scale=scale
        )
        return LayerResult(pruned, {"n_experts": n})
    pruned = magprune(task_vectors, density, epsilon, seed, tensor_name, rescale, expert_keys)
    diagnostics = {"density": density, "epsilon": epsilon}
    return combine_dropped(pruned, combine, scale, weights, diagnostics, normalize)


della_linear = register_variant(
    "della_linear",
    della,
    title="DELLA-linear",
    summary="DELLA without sign election: the (weighted) sum of the MagPruned task vectors, times lambda.",
    fixed={"combine": "sum"},
    defaults={"normalize": False},
    settings=(),
    weights="any",
)
