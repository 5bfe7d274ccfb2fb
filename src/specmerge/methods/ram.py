"""Reinforced Agent Merging (RAM) and RAM+ (tensor-local), as mergekit names them (``ram``, ``ramplus_tl``).

An entry of a task vector *contributes* when its magnitude exceeds epsilon. Where one expert contributes, the
merged entry is its value as it is (not diluted by the experts that left the entry alone); where several do, their
mean; where none does, 0. RAM+ also scales each expert's unique entries up by 1 + r min(rho, alpha), rho the ratio
of the expert's shared to unique contributing entries in the tensor: an expert whose changes mostly overlap with
others' has its few unique ones weighed more.
"""

from __future__ import annotations

from typing import Annotated

import torch
from pydantic import Field

from specmerge.methods.operations import Operations, Shape, numel, passes
from specmerge.methods.registry import LayerResult, register

RAM_CITATION = "Reinforced Agent Merging (RAM), arXiv:2601.13572 (as implemented by mergekit's ram, ramplus_tl)"
NonNegative = Annotated[float, Field(ge=0)]


def ram_cost(shape: Shape, itemsize: int, params: dict) -> Operations:
    """The contribution masks and counts, the unique and shared parts, their sum: about 8 passes per expert."""
    n, x = shape[0], numel(shape[1:])
    return passes(8 * n + 4, x, itemsize) + Operations(workspace=n * x * (itemsize + 1) + x * 8)


def contributions(task_vectors: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(which entries of each expert contribute, |tau| > epsilon; how many experts contribute to each entry)."""
    flat = task_vectors.reshape(task_vectors.shape[0], -1)
    contributing = flat.abs() > epsilon
    return contributing, contributing.sum(dim=0, keepdim=True)


def ram_combine(task_vectors: torch.Tensor, epsilon: float, unique_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Per entry: the one contributing expert's value (times its ``unique_scale``), or the mean of the several."""
    flat = task_vectors.reshape(task_vectors.shape[0], -1)
    contributing, counts = contributions(task_vectors, epsilon)
    kept = flat * contributing
    unique = kept * (counts == 1)
    if unique_scale is not None:
        unique = unique * unique_scale.unsqueeze(-1)
    shared = kept * (counts > 1) / counts.clamp(min=1)
    return (unique + shared).sum(dim=0).reshape(task_vectors.shape[1:])


@register(
    "ram",
    citation=RAM_CITATION,
    title="RAM",
    needs_matrix=False,
    cost=ram_cost,
    featured=False,
    settings=(),
)
def ram(task_vectors: torch.Tensor, *, epsilon: NonNegative = 1e-5) -> LayerResult:
    """RAM: each entry changed by one expert keeps that expert's value; entries changed by several take their mean.

    Args:
        epsilon: a task vector's entry contributes when its magnitude exceeds this.
    """
    return LayerResult(ram_combine(task_vectors, epsilon), {"n_experts": task_vectors.shape[0]})


@register(
    "ramplus_tl",
    citation=RAM_CITATION,
    title="RAM+ (tensor-local)",
    needs_matrix=False,
    cost=ram_cost,
    featured=False,
    settings=(),
)
def ramplus_tl(
    task_vectors: torch.Tensor, *, r: NonNegative = 0.1, alpha: NonNegative = 0.2, epsilon: NonNegative = 1e-5
) -> LayerResult:
    """RAM+ computed per tensor: RAM, with each expert's unique entries scaled by 1 + r min(rho, alpha), rho its
    shared contributing entries over its unique ones in this tensor.

    Args:
        r: how much an expert's overlap raises its unique entries.
        alpha: the largest overlap ratio rho that counts.
        epsilon: a task vector's entry contributes when its magnitude exceeds this (and the smallest count of
            unique entries rho divides by).
    """
    contributing, counts = contributions(task_vectors, epsilon)
    shared = (contributing & (counts > 1)).sum(dim=1)
    unique = (contributing & (counts == 1)).sum(dim=1)
    rho = shared / unique.clamp(min=epsilon)
    scale = 1 + r * rho.clamp(min=0, max=alpha)
    merged = ram_combine(task_vectors, epsilon, scale.to(task_vectors.dtype))
    return LayerResult(merged, {"n_experts": task_vectors.shape[0], "unique_scale": [float(s) for s in scale]})
