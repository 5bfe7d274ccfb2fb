"""Linear merges: the merged delta is sum_i c_i tau_i (weight averaging, task arithmetic, mergekit's linear).

Being linear in the deltas they are declared so (``linear_coefficient``): the executor merges them row
block by row block, and LoRA experts exactly on their cores. All three take per-expert weights w_i.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specmerge.methods.operations import Operations, Shape, numel, passes
from specmerge.methods.registry import LayerResult, register

TA_CITATION = "Ilharco et al., Editing Models with Task Arithmetic, ICLR 2023"
SOUPS_CITATION = "Wortsman et al., Model Soups, ICML 2022"


def linear_cost(shape: Shape, itemsize: int, params: dict) -> Operations:
    """The stack's N passes into the mean or sum, and the scale (when not merged in chunks by the executor)."""
    return passes(shape[0] + 3, numel(shape[1:]), itemsize) + Operations(workspace=numel(shape[1:]) * itemsize)


def weighted_sum(task_vectors: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """sum_i w_i tau_i over the stack's first axis (one pass per expert, no N x temporary)."""
    total = torch.zeros_like(task_vectors[0])
    for tau_i, w_i in zip(task_vectors, weights, strict=True):
        total.add_(tau_i, alpha=w_i)
    return total


def weight_sum(weights: Sequence[float], method: str | None) -> float:
    """sum_i w_i, refused when it is 0: the weighted mean of ``method`` divides by it (None: the mean that a
    method's ``normalize: true`` asks for)."""
    total = float(sum(weights))
    if total == 0 and method is None:
        raise ValueError(
            f"normalize: true divides the weighted sum by the expert weights' sum, and {list(weights)} sum to 0: "
            "give weights that do not sum to 0, or normalize: false"
        )
    if total == 0:
        raise ValueError(f"method '{method}': the expert weights {list(weights)} sum to 0, and the mean divides by it")
    return total


@register(
    "weight_average",
    citation=SOUPS_CITATION,
    title="Weight average",
    needs_matrix=False,
    linear_coefficient=lambda params, w: [params["scale"] * x / weight_sum(w, "weight_average") for x in w],
    factored=True,
    cost=linear_cost,
    weights="any",
)
def weight_average(
    task_vectors: torch.Tensor, *, scale: float = 1.0, weights: Sequence[float] | None = None
) -> LayerResult:
    """Weight averaging: the mean of the task vectors over all N experts (weighted: sum_i w_i tau_i / sum_i w_i).

    Args:
        scale: s in merged = W_0 + s * mean_i tau_i (1 gives the plain average of the experts).
    """
    diagnostics = {"n_experts": task_vectors.shape[0]}
    if weights is None:
        return LayerResult(scale * task_vectors.mean(dim=0), diagnostics)
    mean = weighted_sum(task_vectors, weights).div_(weight_sum(weights, "weight_average"))
    return LayerResult(scale * mean, diagnostics)


@register(
    "task_arithmetic",
    citation=TA_CITATION,
    title="Task arithmetic",
    needs_matrix=False,
    linear_coefficient=lambda params, w: [params["scale"] * x for x in w],
    factored=True,
    cost=linear_cost,
    weights="any",
)
def task_arithmetic(
    task_vectors: torch.Tensor, *, scale: float = 0.3, weights: Sequence[float] | None = None
) -> LayerResult:
    """Task arithmetic: the sum of the task vectors, scaled by lambda (weighted: lambda * sum_i w_i tau_i).

    Args:
        scale: lambda in merged = W_0 + lambda * sum_i tau_i (0.3 as in Ilharco et al.).
    """
    diagnostics = {"n_experts": task_vectors.shape[0]}
    if weights is None:
        return LayerResult(scale * task_vectors.sum(dim=0), diagnostics)
    return LayerResult(scale * weighted_sum(task_vectors, weights), diagnostics)


def _linear_coefficients(params: dict, weights: Sequence[float]) -> list[float]:
    if not params["normalize"]:
        return list(weights)
    total = weight_sum([params["base_weight"], *weights], "linear") if params["base_weight"] else None
    total = weight_sum(weights, "linear") if total is None else total
    return [w / total for w in weights]


def _base_weight_normalized(params: dict, n: int | None) -> None:
    if params["base_weight"] and not params["normalize"]:
        raise ValueError(
            "base_weight weighs the base in the average (normalize: true); without normalize the base keeps weight 1"
        )


@register(
    "linear",
    citation=SOUPS_CITATION,
    title="Linear",
    needs_matrix=False,
    linear_coefficient=_linear_coefficients,
    factored=True,
    cost=linear_cost,
    weights="any",
    featured=False,  # without weights the weight average, already in the demo, speed and inspect lists
    settings=(),
    check=_base_weight_normalized,
)
def linear(
    task_vectors: torch.Tensor,
    *,
    normalize: bool = True,
    base_weight: float = 0.0,
    weights: Sequence[float] | None = None,
) -> LayerResult:
    """Linear (mergekit's name): the weighted average of the experts, W_0 + sum_i w_i tau_i / sum_i w_i.

    With normalize false the weighted sum W_0 + sum_i w_i tau_i (task arithmetic with lambda 1). The base keeps
    weight 1 then: mergekit's un-normalized linear, sum_i w_i W_i, also scales the base by sum_i w_i (the two
    agree when the weights sum to 1). With ``base_weight`` b the base is one of the models averaged:
    (b W_0 + sum_i w_i W_i) / (b + sum_i w_i) = W_0 + sum_i w_i tau_i / (b + sum_i w_i) (mergekit's linear of
    models among which the base is listed). Without weights every expert weighs 1: the plain average (or sum).

    Args:
        normalize: divide by the sum of the weights (a weighted average); false: the weighted sum.
        base_weight: the base's own weight in the average (normalize true): 0 averages the experts alone.
    """
    w = (1.0,) * task_vectors.shape[0] if weights is None else weights
    coefficients = _linear_coefficients({"normalize": normalize, "base_weight": base_weight}, w)
    delta = weighted_sum(task_vectors, coefficients)
    return LayerResult(delta, {"n_experts": task_vectors.shape[0]})


def _no_experts(params: dict, n: int | None) -> None:
    if n:
        raise ValueError(
            f"passthrough copies the base as it is and takes no experts (got {n}): remove them (experts: []), or "
            "choose a method that merges them"
        )


@register(
    "passthrough",
    citation="mergekit's passthrough",
    title="Passthrough",
    needs_matrix=False,
    cost=linear_cost,
    featured=False,
    settings=(),
    check=_no_experts,
)
def passthrough(task_vectors: torch.Tensor) -> LayerResult:
    """Passthrough (mergekit's name): the base's tensors as they are, a copy; with a recipe's ``layers``, a
    frankenmerge's stacked layers copied as they are. It takes no experts (the plan copies every tensor)."""
    return LayerResult(torch.zeros(task_vectors.shape[1:], dtype=task_vectors.dtype, device=task_vectors.device))


@register(
    "model_sum",
    citation=SOUPS_CITATION,
    title="Weighted sum of models",
    needs_matrix=False,
    cost=linear_cost,
    weights="any",
    featured=False,
    settings=(),
)
def model_sum(
    task_vectors: torch.Tensor,
    *,
    base_weight: float = 0.0,
    weights: Sequence[float] | None = None,
    base: torch.Tensor,
) -> LayerResult:
    """The weighted sum of the models themselves, b W_0 + sum_i w_i W_i, not normalized (mergekit's linear with
    normalize false): unlike ``linear``, the base is scaled by the weights too, so the result is not the base plus
    weighted task vectors unless b + sum_i w_i = 1.

    Args:
        base_weight: the base's own weight b (0: the experts' weighted sum alone).
    """
    w = (1.0,) * task_vectors.shape[0] if weights is None else tuple(weights)
    delta = weighted_sum(task_vectors, w).add_(base, alpha=base_weight + sum(w) - 1.0)
    return LayerResult(delta, {"n_experts": task_vectors.shape[0]})
