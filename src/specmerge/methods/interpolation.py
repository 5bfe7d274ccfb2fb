"""Merges that interpolate between weights: SLERP (base and one expert) and Model Stock (the experts' average
pulled toward the base by their angle).

Both compute their coefficients from inner products in float64 (a handful of scalars per tensor) and apply
them in the compute dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from specmerge.methods.operations import Operations, Shape, numel, passes
from specmerge.methods.registry import LayerResult, register

SLERP_CITATION = "Shoemake, Animating Rotation with Quaternion Curves, SIGGRAPH 1985 (as mergekit's slerp)"
MODEL_STOCK_CITATION = "Jang et al., Model Stock: All we need is just a few fine-tuned models, ECCV 2024"
DOT_THRESHOLD = 0.9995  # |cos| above which the two weights are taken as collinear and interpolated linearly
NORM_FLOOR = 1e-8  # a weight of smaller norm is not normalized (its direction is undefined)


def slerp_cost(shape: Shape, itemsize: int, params: dict) -> Operations:
    """W_1 = W_0 + tau formed, three inner products, the combination."""
    return passes(8, numel(shape[1:]), itemsize) + Operations(workspace=2 * numel(shape[1:]) * itemsize)


def model_stock_cost(shape: Shape, itemsize: int, params: dict) -> Operations:
    """The N(N+1)/2 inner products of the task vectors and the mean."""
    n = shape[0]
    return passes(n * (n + 1) + n + 2, numel(shape[1:]), itemsize) + Operations(workspace=numel(shape[1:]) * itemsize)


def slerp_coefficients(w0: torch.Tensor, w1: torch.Tensor, t: float) -> tuple[float, float]:
    """(a, b) with slerp(t; w0, w1) = a w0 + b w1: the angle theta between w0 and w1 (each normalized by its norm,
    unless below :data:`NORM_FLOOR`), a = sin((1 - t) theta) / sin(theta), b = sin(t theta) / sin(theta); the
    linear (1 - t, t) when |cos theta| > :data:`DOT_THRESHOLD` (collinear or opposite: no unique arc)."""
    gram = vector_gram([w0.reshape(-1), w1.reshape(-1)])
    nx, ny = math.sqrt(float(gram[0, 0])), math.sqrt(float(gram[1, 1]))
    dot = float(gram[0, 1]) / ((nx if nx > NORM_FLOOR else 1.0) * (ny if ny > NORM_FLOOR else 1.0))
    dot = max(-1.0, min(1.0, dot))
    if abs(dot) > DOT_THRESHOLD:
        return 1.0 - t, t
    theta = math.acos(dot)
    return math.sin((1 - t) * theta) / math.sin(theta), math.sin(t * theta) / math.sin(theta)


def _one_expert(params: dict, n: int | None) -> None:
    if n is not None and n != 1:
        raise ValueError(
            f"it interpolates between two models, the base and one expert, but {n} experts were given: give one "
            "(the base is the other end, t = 0)"
        )


@register(
    "slerp",
    citation=SLERP_CITATION,
    title="SLERP",
    needs_matrix=False,
    cost=slerp_cost,
    check=_one_expert,
    featured=False,  # a two-model merge: not in the demo's, speed or inspect lists of N-expert merges
    settings=(),
)
def slerp(task_vectors: torch.Tensor, *, t: float = 0.5, base: torch.Tensor) -> LayerResult:
    """SLERP: spherical interpolation between the base W_0 (t = 0) and one expert W_1 (t = 1), tensor by tensor.

    merged = a W_0 + b W_1 with the angle theta between the flattened weights: a = sin((1 - t) theta) / sin theta,
    b = sin(t theta) / sin theta; where they are (anti)collinear (|cos theta| > 0.9995), the linear (1 - t) W_0 +
    t W_1. Like mergekit's slerp, the base is one of the two models (not their common ancestor): give the
    first model as base and the second as the one expert; t may vary by layer (a list) and by tensor (overrides).

    Args:
        t: position on the arc from the base (0) to the expert (1); outside [0, 1] it extrapolates.
    """
    w1 = base + task_vectors[0]
    a, b = slerp_coefficients(base, w1, t)
    delta = w1.mul_(b).add_(base, alpha=a - 1.0)  # a W_0 + b W_1 - W_0
    return LayerResult(delta, {"n_experts": 1, "slerp_weights": [a, b]})


def vector_gram(vectors: Sequence[torch.Tensor], block: int = 2**18) -> torch.Tensor:
    """x_i . x_j of 1-D tensors of one length (N x N, float64), ``block`` entries of each converted at a time."""
    gram = torch.zeros(len(vectors), len(vectors), dtype=torch.float64, device=vectors[0].device)
    for start in range(0, vectors[0].numel(), block):
        part = torch.stack([v[start : start + block] for v in vectors]).double()
        gram += part @ part.T
    return gram


def row_grams(rows: torch.Tensor, block: int = 2**18) -> torch.Tensor:
    """The Gram matrices tau_i . tau_j of each row (N x rows x cols -> rows x N x N), in float64, formed from blocks
    of about ``block`` entries per expert converted at a time (not a float64 copy of the stack)."""
    n, count, cols = rows.shape
    if count == 1:
        return vector_gram(list(rows[:, 0]), block)[None]
    gram = torch.zeros(count, n, n, dtype=torch.float64, device=rows.device)
    step = max(1, block // max(cols, 1))
    for start in range(0, count, step):
        part = rows[:, start : start + step].double()  # n x b x cols
        gram[start : start + step] = torch.einsum("ibx,jbx->bij", part, part)
    return gram


def _two_or_more(params: dict, n: int | None) -> None:
    if n is not None and n < 2:
        raise ValueError(f"it needs at least two experts (it measures the angle between their task vectors); got {n}")


@register(
    "model_stock",
    citation=MODEL_STOCK_CITATION,
    title="Model Stock",
    needs_matrix=False,
    cost=model_stock_cost,
    check=_two_or_more,
    settings=(),  # not in the accuracy benchmark yet (no scale to sweep)
)
def model_stock(task_vectors: torch.Tensor, *, filter_wise: bool = False) -> LayerResult:
    """Model Stock: the experts' average pulled toward the base by the angle between their task vectors.

    cos theta is the mean cosine over pairs (i < j) of task vectors (a pair with a zero task vector counts 0);
    t = N cos theta / (1 + (N - 1) cos theta) and merged = W_0 + t mean_i tau_i, i.e. t W_avg + (1 - t) W_0
    (Jang et al., eq. 3 with N experts). Where 1 + (N - 1) cos theta is 0 (|.| < 1e-6) t is 0: the base.

    Args:
        filter_wise: one angle (and t) per row, the first axis, instead of one per tensor (a 1-D tensor is
            one row).
    """
    n = task_vectors.shape[0]
    rows = task_vectors.reshape(n, task_vectors.shape[1] if filter_wise and task_vectors.dim() > 2 else 1, -1)
    gram = row_grams(rows)  # rows x n x n, float64
    norms = gram.diagonal(dim1=1, dim2=2).sqrt()
    cos = torch.zeros(rows.shape[1], dtype=torch.float64, device=rows.device)
    for i in range(n):
        for j in range(i + 1, n):
            product = norms[:, i] * norms[:, j]
            pair = gram[:, i, j] / torch.where(product > 0, product, 1.0)
            cos += torch.where(product > 0, pair.clamp(-1, 1), 0.0)
    cos /= n * (n - 1) / 2
    denominator = 1 + (n - 1) * cos
    singular = denominator.abs() < 1e-6
    t = torch.where(singular, 0.0, n * cos / torch.where(singular, 1.0, denominator))
    mean = task_vectors.mean(dim=0)
    delta = mean.reshape(rows.shape[1], -1).mul_(t.to(mean.dtype).unsqueeze(1)).reshape(mean.shape)
    return LayerResult(delta, {"n_experts": n, "model_stock_t": float(t.mean()), "cos_theta": float(cos.mean())})
