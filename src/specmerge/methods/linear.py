"""Linear merges: the merged delta is c * sum_i tau_i (weight averaging, task arithmetic).

Being linear in the deltas they are declared so (``linear_coefficient``): the executor merges them row
block by row block, and LoRA experts exactly on their cores.
"""

from __future__ import annotations

import torch

from specmerge.methods.operations import Operations, Shape, numel, passes
from specmerge.methods.registry import LayerResult, register

TA_CITATION = "Ilharco et al., Editing Models with Task Arithmetic, ICLR 2023"


def linear_cost(shape: Shape, itemsize: int, params: dict) -> Operations:
    """The stack's N passes into the mean or sum, and the scale (when not merged in chunks by the executor)."""
    return passes(shape[0] + 3, numel(shape[1:]), itemsize) + Operations(workspace=numel(shape[1:]) * itemsize)


@register(
    "weight_average",
    citation="Wortsman et al., Model Soups, ICML 2022",
    title="Weight average",
    needs_matrix=False,
    linear_coefficient=lambda params, n: params["scale"] / n,
    factored=True,
    cost=linear_cost,
)
def weight_average(task_vectors: torch.Tensor, *, scale: float = 1.0) -> LayerResult:
    """Weight averaging: the mean of the task vectors over all N experts.

    Args:
        scale: s in merged = W_0 + s * mean_i tau_i (1 gives the plain average of the experts).
    """
    return LayerResult(scale * task_vectors.mean(dim=0), {"n_experts": task_vectors.shape[0]})


@register(
    "task_arithmetic",
    citation=TA_CITATION,
    title="Task arithmetic",
    needs_matrix=False,
    linear_coefficient=lambda params, n: params["scale"],
    factored=True,
    cost=linear_cost,
)
def task_arithmetic(task_vectors: torch.Tensor, *, scale: float = 0.3) -> LayerResult:
    """Task arithmetic: the sum of the task vectors, scaled by lambda.

    Args:
        scale: lambda in merged = W_0 + lambda * sum_i tau_i (0.3 as in Ilharco et al.).
    """
    return LayerResult(scale * task_vectors.sum(dim=0), {"n_experts": task_vectors.shape[0]})
