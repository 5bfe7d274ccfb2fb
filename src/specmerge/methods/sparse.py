"""Sparsifying merges: TIES and DARE (+ task arithmetic or + TIES); Model Breadcrumbs is :mod:`.breadcrumbs`.

Each drops entries of every task vector (by magnitude or at random) before combining them; all are
elementwise (any tensor shape). The building blocks (TIES sign election and disjoint mean, the DARE
mask) are small public functions so they can be tested and reused on their own; the top-k selection
is :mod:`specmerge.linalg.topk`. The density (drop rate) may differ per expert, and ``convention: mergekit``
computes mergekit's arithmetic of the same method (:mod:`.gta`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

import torch
from pydantic import Field

from specmerge.linalg.topk import KEEP_ALL, keep_mask, top_k_count, top_k_rule
from specmerge.methods import gta
from specmerge.methods.draws import dare_mask, mask_keys
from specmerge.methods.gta import Convention, per_expert_values
from specmerge.methods.linear import weight_sum, weighted_sum
from specmerge.methods.operations import Operations, Shape, numel, passes
from specmerge.methods.params import per_expert
from specmerge.methods.registry import LayerResult, Setting, register, register_variant

Density = Annotated[float, Field(gt=0, le=1)]
DropRate = Annotated[float, Field(ge=0, lt=1)]
Densities = per_expert(Density)
DropRates = per_expert(DropRate)

TIES_CITATION = "Yadav et al., TIES-Merging: Resolving Interference When Merging Models, NeurIPS 2023"
DARE_CITATION = "Yu et al., Language Models are Super Mario (DARE), ICML 2024"

TIES_CHUNK = 2**16  # entries per expert per chunk: the N x chunk working set of a TIES merge stays in cache


# ---------------------------------------------------------------------------------------------
# Costs (:mod:`specmerge.methods.operations`): passes over the N x numel stack, counted from the code below


def ties_cost(shape: Shape, itemsize: int, params: dict) -> Operations:
    """Per expert a top-k selection (keys formed: 6 passes) and, chunk by chunk, the trim, election and disjoint
    mean (about 21 passes); the merged tensor."""
    n, x = shape[0], numel(shape[1:])
    return passes(27 * n + 6, x, itemsize) + Operations(select=n * x, workspace=x * (itemsize + 4))


def dare_cost(shape: Shape, itemsize: int, params: dict) -> Operations:
    """Per expert a random mask (drawn in float32, compared) and the rescaled copy into a second stack; then the
    sum, or the election and disjoint mean (``combine``)."""
    n, x = shape[0], numel(shape[1:])
    combine = 2 * n + 2 if params.get("combine") == "sum" else 15 * n + 6
    ops = passes(2 * n + combine, x, itemsize) + Operations(workspace=n * x * itemsize)
    if params.get("drop_rate"):
        ops = ops + passes(10 * n, x, itemsize) + Operations(random=n * x, workspace=n * x * itemsize + 5 * x)
    return ops


# ---------------------------------------------------------------------------------------------
# TIES


def elect_sign(task_vectors: torch.Tensor, weights: Sequence[float] | None = None) -> torch.Tensor:
    """The elected sign per entry: sign of the (weighted: sum_i w_i tau_i) sum over experts (0 where it is 0)."""
    return torch.sign(task_vectors.sum(dim=0) if weights is None else weighted_sum(task_vectors, weights))


def disjoint_mean(
    task_vectors: torch.Tensor, sign: torch.Tensor, weights: Sequence[float] | None = None, normalize: bool = True
) -> torch.Tensor:
    """Per entry, the mean over the experts whose entry is non-zero with the elected sign; 0 where none.

    With positive ``weights`` the weighted mean over the same experts: sum_i w_i tau_i / sum_i w_i, both over the
    agreeing experts (what TIES computes on weighted task vectors w_i tau_i, normalized by their weights).
    Without ``normalize`` the (weighted) sum over the agreeing experts, not divided.
    """
    total = torch.zeros_like(sign)
    count = torch.zeros_like(sign)
    zero = sign.new_zeros(())
    for i, tau_i in enumerate(task_vectors):  # one expert at a time: no N x tensor temporaries
        agree = (tau_i * sign) > 0  # the same non-zero sign (sign is -1, 0 or +1)
        w_i = 1.0 if weights is None else weights[i]  # alpha 1 adds exactly as without it
        total.add_(torch.where(agree, tau_i, zero), alpha=w_i)
        count.add_(agree, alpha=w_i)
    if not normalize:
        return total
    return total.div_(torch.where(count > 0, count, 1))  # no agreeing expert: 0 / 1


@register(
    "ties",
    citation=TIES_CITATION,
    title="TIES",
    needs_matrix=False,
    settings=[Setting("ties", "TIES (top 20 %)")],
    cost=ties_cost,
    weights="positive",
    check=lambda params, n: gta.check_rescale(params),
)
def ties(
    task_vectors: torch.Tensor,
    *,
    density: Densities = 0.2,
    scale: float = 1.0,
    normalize: bool = True,
    rescale: bool = False,
    convention: Convention = "paper",
    weights: Sequence[float] | None = None,
) -> LayerResult:
    """TIES-Merging: trim each task vector to its largest entries, elect a sign per entry, average the agreeing.

    The trim is per expert and per tensor (the public code also offers a whole-model trim; per tensor
    is what streaming allows); of equal magnitudes at the threshold, those first in storage order are
    kept, so the trim is the same on every machine. The merge is the disjoint mean, not the sum. Where
    the trimmed values sum to exactly zero no sign is elected and the entry stays at W_0 (the original
    code breaks such ties with the model-wide majority sign, mergekit with +). With expert weights w_i the
    sign is elected from sum_i w_i trim(tau_i) and the mean is weighted (:func:`disjoint_mean`), as mergekit does.

    Args:
        density: fraction of entries kept per expert and tensor, k = ceil(density * numel), in (0, 1]; one value,
            or one per expert.
        scale: lambda in merged = W_0 + lambda * disjoint_mean (1.0 as in Yadav et al.).
        normalize: divide the agreeing entries' (weighted) sum by their (summed) weights: the disjoint mean;
            false: their sum.
        rescale: scale each trimmed task vector back to its L1 norm (convention mergekit only).
        convention: paper, or mergekit: mergekit's arithmetic (k = max(1, floor(density * numel)), + elected
            where the sum is 0; specmerge.methods.gta).
    """
    n = task_vectors.shape[0]
    densities = per_expert_values(density, n)
    if convention == "mergekit":
        how = gta.Sparsify("magnitude", densities, rescale)
        merged_gta = gta.merge(task_vectors, how, weights=weights, elect=True, normalize=normalize, scale=scale)
        return LayerResult(merged_gta, {"n_experts": n})
    flat = task_vectors.reshape(n, -1)
    counts = [top_k_count(d, flat.shape[1]) for d in densities]
    rules = [top_k_rule(tau_i, k) if k < flat.shape[1] else KEEP_ALL for tau_i, k in zip(flat, counts, strict=True)]
    merged = torch.empty(flat.shape[1], dtype=flat.dtype, device=flat.device)
    chunk = max(1, TIES_CHUNK if flat.device.type == "cpu" else flat.shape[1])  # GPUs: one chunk, no syncs
    trimmed = torch.empty((flat.shape[0], min(chunk, flat.shape[1])), dtype=flat.dtype, device=flat.device)
    zero, ties_at_zero = flat.new_zeros(()), torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.shape[1], chunk):  # the trim, the election and the mean, chunk by chunk
        stop = min(start + chunk, flat.shape[1])
        block = trimmed[:, : stop - start]
        for i, rule in enumerate(rules):
            tau = flat[i, start:stop]
            torch.where(keep_mask(tau, rule, start), tau, zero, out=block[i])
        sign = elect_sign(block, weights)
        ties_at_zero += torch.count_nonzero(sign == 0)
        merged[start:stop] = disjoint_mean(block, sign, weights, normalize)
    diagnostics = {"n_experts": task_vectors.shape[0]}
    if merged.numel():
        diagnostics["sign_tie_fraction"] = int(ties_at_zero) / merged.numel()
    return LayerResult(merged.mul_(scale).reshape(task_vectors.shape[1:]), diagnostics)


# ---------------------------------------------------------------------------------------------
# DARE


def dare(
    task_vectors: torch.Tensor,
    drop_rate: float | Sequence[float],
    seed: int,
    tensor_name: str,
    expert_keys: Sequence[str] | None = None,
    *,
    rescale: bool = True,
) -> torch.Tensor:
    """Drop each entry of each tau_i with probability drop_rate in [0, 1) (one, or one per expert), rescale the kept
    ones by 1 / (1 - drop_rate) (unless not ``rescale``).

    ``expert_keys`` names the experts in stack order; by default each expert's task vector names itself
    (:func:`content_key`). Either way the mask of an expert depends on its key, not on its position in the stack,
    so a merge is a function of the weights, the recipe and ``seed`` (copies of the experts in renamed folders
    give the same masks).
    """
    keys = mask_keys(task_vectors, expert_keys, tensor_name)
    rates = per_expert_values(drop_rate, len(keys))
    out = torch.zeros_like(task_vectors)
    for i, key in enumerate(keys):
        if rates[i] == 0:
            out[i] = task_vectors[i]
            continue
        factor = 1.0 / (1.0 - rates[i]) if rescale else 1.0
        keep = dare_mask(task_vectors.shape[1:], rates[i], seed, tensor_name, key, task_vectors.device)
        out[i] = torch.where(keep, task_vectors[i] * factor, out[i])
    return out


@register(
    "dare_task_arithmetic",
    citation=DARE_CITATION,
    title="DARE-TA",
    needs_matrix=False,
    seeded=True,
    fixed={"combine": "sum"},
    settings=[Setting("dare_task_arithmetic", "DARE-TA (p = 0.5)")],
    cost=dare_cost,
    weights="any",
)
def dare_task_arithmetic(
    task_vectors: torch.Tensor,
    *,
    combine: Literal["sum", "disjoint_mean"],
    drop_rate: DropRates = 0.5,
    seed: int = 0,
    scale: float = 0.3,
    rescale: bool = True,
    normalize: bool = False,
    convention: Convention = "paper",
    tensor_name: str = "",
    expert_keys: Sequence[str] | None = None,
    weights: Sequence[float] | None = None,
) -> LayerResult:
    """DARE + task arithmetic: randomly drop and rescale each task vector, then sum (weighted: sum_i w_i DARE(tau_i)).

    ``combine`` is the declared difference of the variant DARE-TIES: ``disjoint_mean`` elects signs and
    takes TIES's disjoint mean of the dropped task vectors instead of their sum (the random drop replaces
    the TIES magnitude trim, as in mergekit's dare_ties). The random mask is a function of (seed, tensor
    name, expert key), so a merge is reproducible whatever the order in which tensors are processed.

    Args:
        drop_rate: probability p of dropping an entry, in [0, 1); kept entries are divided by 1 - p; one value, or
            one per expert.
        seed: seed of the random masks; the same seed gives the same merge.
        scale: lambda in merged = W_0 + lambda * sum_i DARE(tau_i) (DARE-TIES: lambda * disjoint_mean).
        rescale: divide the kept entries by 1 - p (mergekit convention: scale each to its L1 norm); false: keep
            them as they are.
        normalize: divide the (agreeing) entries' weighted sum by the sum of the (agreeing) weights: DARE-TIES's
            disjoint mean, a weighted mean for DARE-TA; false: the sum.
        convention: paper, or mergekit: mergekit's arithmetic (density 1 - p, L1 rescale, + elected where the sum
            is 0; specmerge.methods.gta).
    """
    if convention == "mergekit":
        densities = tuple(1 - p for p in per_expert_values(drop_rate, task_vectors.shape[0]))
        how = gta.Sparsify("random", densities, rescale, seed=seed, tensor_name=tensor_name)
        elect = combine == "disjoint_mean"
        kept = gta.merge_drawn(
            task_vectors, how, expert_keys, weights=weights, elect=elect, normalize=normalize, scale=scale
        )
        return LayerResult(kept, {"n_experts": task_vectors.shape[0]})
    dropped = dare(task_vectors, drop_rate, seed, tensor_name, expert_keys, rescale=rescale)
    return combine_dropped(dropped, combine, scale, weights, {"drop_rate": drop_rate}, normalize)


def combine_dropped(
    dropped: torch.Tensor,
    combine: str,
    scale: float,
    weights: Sequence[float] | None,
    diagnostics: dict,
    normalize: bool = False,
) -> LayerResult:
    """lambda * the (weighted) sum of sparsified task vectors, or (``disjoint_mean``) lambda * their (weighted)
    disjoint sum under the elected signs; divided by the (agreeing) weights' sum when ``normalize``."""
    diagnostics = {"n_experts": dropped.shape[0], **diagnostics}
    if combine == "sum":
        total = dropped.sum(dim=0) if weights is None else weighted_sum(dropped, weights)
        if normalize:
            total /= dropped.shape[0] if weights is None else weight_sum(weights, None)
        return LayerResult(scale * total, diagnostics)
    sign = elect_sign(dropped, weights)
    merged = disjoint_mean(dropped, sign, weights, normalize)
    if sign.numel():
        diagnostics["sign_tie_fraction"] = float((sign == 0).double().mean())
    return LayerResult(scale * merged, diagnostics)


dare_linear = register_variant(
    "dare_linear",
    dare_task_arithmetic,
    title="DARE-linear",
    summary="DARE + task arithmetic under mergekit's name (dare_linear): the sum of the dropped, rescaled task "
    "vectors, lambda 1 by default.",
    defaults={"scale": 1.0},
    featured=False,
    settings=(),
)

dare_ties = register_variant(
    "dare_ties",
    dare_task_arithmetic,
    title="DARE-TIES",
    summary="DARE + TIES: randomly drop and rescale each task vector, then elect signs and take the disjoint mean.",
    fixed={"combine": "disjoint_mean"},
    defaults={"scale": 1.0, "normalize": True},
    settings=[Setting("dare_ties", "DARE-TIES (p = 0.5)")],
    weights="positive",
)
