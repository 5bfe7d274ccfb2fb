"""mergekit's methods beyond the task-arithmetic family, as mergekit defines them: means on the sphere of N models,
Multi-SLERP (a barycentre of the experts' task vectors by one tangent-space step) and the Karcher mean (of the experts'
weights, by Riemannian gradient steps) and NuSLERP (slerp of two task vectors); NearSwap (the base, except where an
expert is within t of it); Arcee Fusion (an expert's entries where they matter most); and SCE (select by variance,
calculate weights, erase by sign).

Each flattened tensor is a point: its direction on the unit sphere, its length put back at the end as the
(weighted) mean of the inputs' lengths. The arithmetic is in the compute dtype, as mergekit's is in the tensors'
(float32 for half inputs); the reductions are ``torch.linalg.vector_norm`` and dot products of whole tensors. The
outputs agree with mergekit 0.1.5's to float32 round-off (tests/test_mergekit_corpus.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specmerge.linalg.topk import fraction_count, keep_mask, top_k_rule
from specmerge.methods.operations import CostFunction, Operations, Shape, numel, passes
from specmerge.methods.params import UnitInterval
from specmerge.methods.registry import LayerResult, register

MULTISLERP_CITATION = "Goddard, Multi-SLERP (2025), as mergekit's multislerp"
KARCHER_CITATION = "Karcher, Riemannian center of mass and mollifier smoothing, 1977 (as mergekit's karcher)"
NEARSWAP_CITATION = "alchemonaut, NearSwap (QuartetAnemoi-70B, 2024), as mergekit's nearswap"
NUSLERP_CITATION = "mergekit's nuslerp (Goddard, 2024): slerp of two task vectors at their weights' ratio"
ARCEE_FUSION_CITATION = "Arcee AI, Arcee Fusion (2025), as mergekit's arcee_fusion"
SCE_CITATION = "Wan et al., FuseChat: Knowledge Fusion of Chat Models (SCE), 2024, as mergekit's sce"


def _per_expert_passes(factor: float) -> CostFunction:
    def cost(shape: Shape, itemsize: int, params: dict) -> Operations:
        n, elements = shape[0], numel(shape[1:])
        return passes(factor * (n + 2), elements, itemsize) + Operations(workspace=(n + 2) * elements * itemsize)

    return cost


def _two_or_more(params: dict, n: int | None) -> None:
    if n is not None and n < 2:
        raise ValueError(f"it is a mean of several experts; got {n}")


def _one(params: dict, n: int | None) -> None:
    if n is not None and n != 1:
        raise ValueError(f"it swaps in one expert's weights near the base's, but {n} experts were given: give one")


def _mergekit_method(name: str, citation: str, title: str, passes_per_expert: float, check, **more):
    """The registration these share: elementwise over whole tensors, not in the demo's or the benchmark's lists."""
    cost = _per_expert_passes(passes_per_expert)
    return register(name, citation=citation, title=title, needs_matrix=False, cost=cost, check=check, featured=False,
                    settings=(), **more)  # fmt: skip


def _points(params: dict, n: int | None) -> None:
    needed = 1 if params["base_free"] else 2
    if n is not None and n < needed:
        raise ValueError(f"it is a mean of several points; got {n} expert(s){' and the base' if needed == 1 else ''}")


def with_base_point(
    task_vectors: torch.Tensor, base: torch.Tensor, base_weight: float, weights: Sequence[float] | None
) -> tuple[torch.Tensor, list[float]]:
    """The models' own weights as points, the base first: [W_0, W_0 + tau_1, ...], and their weights
    [base_weight, w_1, ...] (mergekit's spherical means without a base_model, of the models listed)."""
    points = torch.cat([base.unsqueeze(0), task_vectors + base])
    return points, [base_weight, *([1.0] * task_vectors.shape[0] if weights is None else [float(w) for w in weights])]


@_mergekit_method("multislerp", MULTISLERP_CITATION, "Multi-SLERP", 4, _points, weights="any")
def multislerp(
    task_vectors: torch.Tensor,
    *,
    normalize_weights: bool = True,
    eps: float = 1e-8,
    base_free: bool = False,
    base_weight: float = 1.0,
    weights: Sequence[float] | None = None,
    base: torch.Tensor,
) -> LayerResult:
    """Multi-SLERP: the weighted barycentre of the task vectors on the sphere, by one step in the tangent space.

    Each tau_i (flattened) is u_i = tau_i / (||tau_i|| + eps) on the unit sphere; m is the normalized weighted mean
    of the u_i; the weighted mean of their projections on m's tangent space, v, is mapped back by the exponential
    map, m cos ||v|| + v sin ||v|| / ||v||, and scaled by the weighted mean of the ||tau_i||. Two experts whose
    weighted directions cancel are averaged linearly; more are refused (no barycentre). With ``base_free`` the
    points are the models' own weights, the base's (weight ``base_weight``) among them, and the barycentre is the
    merged weight itself (mergekit's multislerp without a base_model).

    Args:
        normalize_weights: divide the expert weights (default all 1) by their sum.
        eps: added to the norms it divides by.
        base_free: the barycentre of the weights W_0, W_1, ... themselves, not of the task vectors.
        base_weight: the base's weight among the points (base_free).
    """
    if base_free:
        points, w = with_base_point(task_vectors, base, base_weight, weights)
        point, diagnostics = _barycentre(points, w, normalize_weights, eps)
        return LayerResult(point - base, diagnostics)
    point, diagnostics = _barycentre(task_vectors, weights, normalize_weights, eps)
    return LayerResult(point, diagnostics)


def _barycentre(
    stack: torch.Tensor, weights: Sequence[float] | None, normalize_weights: bool, eps: float
) -> tuple[torch.Tensor, dict]:
    n = stack.shape[0]
    flat = stack.reshape(n, -1)
    w = torch.ones(n, dtype=flat.dtype, device=flat.device) if weights is None else flat.new_tensor(list(weights))
    if normalize_weights:
        w = w / w.sum()
    norms = torch.linalg.vector_norm(flat, dim=1, keepdim=True)
    units = flat / (norms + eps)
    mean = (units * w[:, None]).sum(dim=0)
    mean_norm = torch.linalg.vector_norm(mean)
    if mean_norm < eps:
        if n == 2:
            return (flat[0] * w[0] + flat[1] * w[1]).reshape(stack.shape[1:]), {"n_experts": n}
        raise ValueError("the experts' weighted directions cancel out: no barycentre on the sphere; change the weights")
    mean = mean / mean_norm
    tangents = units - (units * mean).sum(dim=1, keepdim=True) * mean
    step = (tangents * w[:, None]).sum(dim=0)
    length = torch.linalg.vector_norm(step) + eps
    point = mean * torch.cos(length) + step * (torch.sin(length) / length)
    merged = point * (norms[:, 0] * w).sum()
    return merged.reshape(stack.shape[1:]), {"n_experts": n, "tangent_step": float(length)}


@_mergekit_method("karcher", KARCHER_CITATION, "Karcher mean", 30, _two_or_more)
def karcher(
    task_vectors: torch.Tensor,
    *,
    max_iter: int = 10,
    tol: float = 1e-5,
    include_base: bool = False,
    base: torch.Tensor,
) -> LayerResult:
    """Karcher mean: the point of the unit sphere nearest, in summed squared arc length, to the experts' weights
    (W_i = W_0 + tau_i, flattened and normalized), found by Riemannian gradient steps from their normalized mean,
    scaled by the mean of their norms. The base is not one of the points unless ``include_base`` (mergekit's karcher
    averages the models listed, and the base_model too when one is named).

    An expert of norm <= tol takes no part in the direction (its norm still counts in the length); a step of
    norm < tol, or ``max_iter`` steps, ends the iteration; a point within an angle tol of the mean adds nothing.

    Args:
        max_iter: at most this many gradient steps.
        tol: the norm, step and angle below which the iteration treats a quantity as zero.
        include_base: the base W_0 is one of the points, first (then the mean of N + 1 weights).
    """
    if include_base:
        task_vectors = torch.cat([torch.zeros_like(task_vectors[:1]), task_vectors])
    n = task_vectors.shape[0]
    points = (task_vectors + base).reshape(n, -1)
    norms = [torch.linalg.vector_norm(p) for p in points]
    units = [p / r if float(r) != 0.0 else torch.zeros_like(p) for p, r in zip(points, norms, strict=True)]
    alive = [k for k, r in enumerate(norms) if float(r) > tol]
    if not alive:
        return LayerResult(-base.clone(), {"n_experts": n, "karcher_steps": 0})  # every weight is 0: so is the mean
    share = 1.0 / len(alive)
    mean = sum(share * units[k] for k in alive)
    mean_norm = torch.linalg.vector_norm(mean)
    mean = units[alive[0]].clone() if float(mean_norm) < tol else mean / mean_norm
    steps = 0
    for steps in range(1, max_iter + 1):  # noqa: B007 (the count is reported)
        tangent = torch.zeros_like(mean)
        for k in alive:
            dot = torch.clamp(torch.dot(mean, units[k]), -1.0, 1.0)
            theta = torch.arccos(dot)
            if float(theta) < tol:
                continue
            tangent += share * (theta / torch.sin(theta)) * (units[k] - dot * mean)
        length = torch.linalg.vector_norm(tangent)
        if float(length) < tol:
            break
        mean = torch.cos(length) * mean + torch.sin(length) * (tangent / length)
        mean_norm = torch.linalg.vector_norm(mean)
        if float(mean_norm) > tol:
            mean = mean / mean_norm
    merged = sum(r / n for r in norms) * mean
    return LayerResult((merged.reshape(base.shape) - base), {"n_experts": n, "karcher_steps": steps})


@_mergekit_method("nearswap", NEARSWAP_CITATION, "NearSwap", 3, _one)
def nearswap(task_vectors: torch.Tensor, *, t: float = 0.001) -> LayerResult:
    """NearSwap: each entry moves from the base toward the one expert by w = clamp(t / |tau|, 0, 1): all the way
    where the two are within t (|tau| <= t), less the further apart they are (|tau| below 1e-6 counts as 1e-6).

    Args:
        t: the distance within which the expert's entry replaces the base's.
    """
    tau = task_vectors[0]
    weight = (t / tau.abs().clamp(min=1e-6)).clamp(min=0, max=1)
    return LayerResult(weight * tau, {"n_experts": 1, "swapped_fraction": float((weight == 1).float().mean())})


@_mergekit_method("sce", SCE_CITATION, "SCE", 6, _two_or_more)
def sce(task_vectors: torch.Tensor, *, select_topk: UnitInterval = 1.0) -> LayerResult:
    """SCE (select, calculate, erase) as mergekit merges it: keep the entries where the experts vary most, weigh each
    expert by its mean squared entry, keep each entry's agreeing signs, take the weighted mean.

    Select: of the entries whose variance over the experts (population) is non-zero, the floor(select_topk * count)
    of largest variance are kept in every task vector, the others zeroed (ties at the threshold in storage order).
    Calculate: w_i = mean(tau_i^2) / sum_j mean(tau_j^2) (equal weights where that sum is below 1e-6). Erase: per
    entry, the sign of the sum over experts is elected (+ where it is 0) and the entries of other sign, zeros
    included, drop out. merged = W_0 + sum_i w_i tau_i / max(sum_i w_i, 1e-6) over the agreeing experts.

    Args:
        select_topk: share of the varying entries kept (1 keeps every entry).
    """
    n = task_vectors.shape[0]
    flat = task_vectors.reshape(n, -1)
    kept = flat.shape[1]
    if select_topk < 1:
        variance = flat.var(dim=0, unbiased=False)
        k = fraction_count(select_topk, int(torch.count_nonzero(variance)), round_up=False)
        keep = keep_mask(variance, top_k_rule(variance, k)) if k else torch.zeros_like(variance, dtype=torch.bool)
        flat = flat * keep
        kept = int(k)
    energy = flat.square().mean(dim=1)
    total = float(energy.sum())
    weights = torch.full_like(energy, 1.0 / n) if abs(total) < 1e-6 else energy / total
    majority = torch.where(flat.sum(dim=0) >= 0, 1.0, -1.0).to(flat.dtype)
    agree = (torch.sign(flat) == majority).to(flat.dtype) * weights[:, None]
    merged = (flat * agree).sum(dim=0) / agree.sum(dim=0).clamp(min=1e-6)
    diagnostics = {"n_experts": n, "selected_fraction": kept / max(flat.shape[1], 1), "sce_weights": weights.tolist()}
    return LayerResult(merged.reshape(task_vectors.shape[1:]), diagnostics)


def _two(params: dict, n: int | None) -> None:
    needed = 1 if params["base_free"] else 2
    if n is not None and n != needed:
        what = "the base and one expert" if needed == 1 else "two experts' task vectors"
        raise ValueError(f"it interpolates between {what}, but {n} experts were given: give {needed}")


@_mergekit_method("nuslerp", NUSLERP_CITATION, "NuSLERP", 6, _two, weights="any")
def nuslerp(
    task_vectors: torch.Tensor,
    *,
    row_wise: bool = False,
    flatten: bool = True,
    base_weight: float = 1.0,
    base_free: bool = False,
    weights: Sequence[float] | None = None,
    base: torch.Tensor,
) -> LayerResult:
    """NuSLERP (mergekit's, with a base): slerp between the two experts' task vectors at t = w_1 / (w_0 + w_1)
    (0.5 where the weights sum to about 0; default weights 1, 1).

    On the flattened task vectors (``flatten``), or else vector by vector along the last axis (rows of a 2-D
    weight), or with ``row_wise`` along the first axis (its columns): u = tau_0 / |tau_0|, v = tau_1 / |tau_1|,
    theta = arccos(u . v), merged = (sin((1 - t) theta) tau_0 + sin(t theta) tau_1) / sin theta; where
    1 - cos^2 theta <= 1e-16 (collinear), the linear (1 - t) tau_0 + t tau_1. With ``base_free`` the two ends are
    the base's own weights W_0 (weight ``base_weight``) and one expert's W_1 (mergekit's nuslerp without a
    base_model, of two models).

    Args:
        row_wise: interpolate the vectors along the first axis (mergekit's nuslerp_row_wise), when not flattened.
        flatten: interpolate each tensor as one vector (mergekit's nuslerp_flatten).
        base_weight: the base's weight w_0 (base_free).
        base_free: interpolate between the weights W_0 and W_1 themselves, not between two task vectors.
    """
    if base_free:
        ends, w = with_base_point(task_vectors, base, base_weight, weights)
        merged, t = _pair(ends[0], ends[1], w, row_wise, flatten)
        return LayerResult(merged - base, {"n_experts": 1, "t": t})
    merged, t = _pair(task_vectors[0], task_vectors[1], weights, row_wise, flatten)
    return LayerResult(merged, {"n_experts": 2, "t": t})


def _pair(
    a: torch.Tensor, b: torch.Tensor, weights: Sequence[float] | None, row_wise: bool, flatten: bool
) -> tuple[torch.Tensor, float]:
    shape = a.shape
    w = [1.0, 1.0] if weights is None else [float(x) for x in weights]
    t = 0.5 if abs(sum(w)) < 1e-6 else w[1] / sum(w)
    if flatten:
        a, b = a.reshape(-1), b.reshape(-1)
    elif row_wise:
        a, b = a.transpose(0, -1), b.transpose(0, -1)
    unit_a = a / torch.linalg.vector_norm(a, dim=-1, keepdim=True).clamp(min=1e-7)
    unit_b = b / torch.linalg.vector_norm(b, dim=-1, keepdim=True).clamp(min=1e-7)
    cos = (unit_a * unit_b).sum(dim=-1, keepdim=True).clamp(-1, 1)
    collinear = (1 - cos.square()) <= 1e-16
    theta = torch.acos(torch.where(collinear, 0.0, cos))
    arc = (torch.sin((1 - t) * theta) * a + torch.sin(t * theta) * b) / torch.sin(theta)
    merged = torch.where(collinear, (1 - t) * a + t * b, arc)
    if row_wise and not flatten:
        merged = merged.transpose(0, -1)
    return merged.reshape(shape), t


@_mergekit_method("arcee_fusion", ARCEE_FUSION_CITATION, "Arcee Fusion", 8, _one)
def arcee_fusion(task_vectors: torch.Tensor, *, base: torch.Tensor) -> LayerResult:
    """Arcee Fusion (mergekit's): take the expert's entries where they matter most, the base's elsewhere.

    Importance = |tau| times the KL divergence, row by row along the last axis, of softmax(W_1) from softmax(W_0)
    (each + 1e-8); the entries whose importance is at least median + 1.5 (q3 - q1) move to the expert's value. The
    quartiles are order statistics of the sorted importances at floor(q (n - 1)), computed over all of them
    (mergekit samples a million at random in tensors larger than that; here they are exact and reproducible).
    """
    tau = task_vectors[0]
    expert = base + tau
    p = torch.softmax(expert, dim=-1) + 1e-8
    q = torch.softmax(base, dim=-1) + 1e-8
    importance = tau.abs() * (p * torch.log(p / q)).sum(dim=-1, keepdim=True)
    ordered = torch.sort(importance.reshape(-1)).values
    last = ordered.numel() - 1
    q1, median, q3 = (ordered[int(f * last)] for f in (0.25, 0.5, 0.75))
    keep = importance >= median + 1.5 * (q3 - q1)
    return LayerResult(tau * keep, {"n_experts": 1, "fused_fraction": float(keep.float().mean())})
