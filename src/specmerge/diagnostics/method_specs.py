"""The merge methods that ``specmerge inspect`` compares, written ``NAME`` or ``NAME:key=value,key=value``.

``inspect`` reports each method's merged-delta norm per layer (the norm-shortcut diagnostic). A spec is
parsed and validated against the method's parameters before any file is read; its label (the spec as
written) names the method's columns, ``norm[<label>]``. The default list comes from the registry's declared
capabilities (:func:`default_methods`), so a newly registered method appears without touching this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specmerge.methods import all_methods, get_method
from specmerge.pipeline.recipe.values import parse_pairs


@dataclass(frozen=True)
class MethodSpec:
    """A method to compare: ``label`` is the spec as written, ``name`` the registered method, ``params`` its values."""

    label: str
    name: str
    params: dict[str, Any]


def parse_method_spec(spec: str, n_experts: int | None = None) -> MethodSpec:
    """Parse and validate ``NAME[:key=value,...]`` against the method's signature (no I/O).

    Values are read as a recipe reads them (:func:`specmerge.pipeline.recipe.values.parse_pairs`); an unknown
    method, a malformed pair, a value out of the parameter's bounds, a method that cannot take ``n_experts``
    experts, or one that merges whole weights (slerp: inspect compares merges of task vectors) raises one line.
    """
    name, _, rest = spec.partition(":")
    method = get_method(name.strip())
    if method.needs_base:
        raise ValueError(
            f"method '{method.name}' merges whole weights with the base's; inspect compares merges of task "
            "vectors: merge with it (specmerge merge) instead"
        )
    params = parse_pairs(filter(None, (p.strip() for p in rest.split(","))), f"method '{spec}':")
    method.validate(params, n_experts)
    return MethodSpec(spec.strip(), method.name, params)


def default_methods() -> tuple[str, ...]:
    """The methods compared when none is given: the featured closed-form merges of the registry, in catalog order.

    Featured (:attr:`~specmerge.methods.Method.featured`) and with an exact factored form
    (:attr:`~specmerge.methods.Method.factored`): the pseudoinverse, the regularised spectral solvers and the
    linear and SVD baselines. Each costs one solve on the layer's shared decomposition and runs on LoRA cores
    without densifying; merges without a factored form (TIES / DARE masks, iterative WUDI and OptMerge: a full
    merge's cost per layer, on a densified stack for LoRA experts) are compared when named with ``-m``.
    """
    return tuple(name for name, method in all_methods().items() if method.featured and method.factored)
