"""Each tensor's own parameter values and expert weights, from the recipe's gradients, conditions and per-expert
values (:mod:`specmerge.pipeline.recipe.layered`, :mod:`specmerge.pipeline.recipe.expert_entries`).

A method sees scalars: the plan evaluates every gradient at the tensor's layer position and every list of
conditions at its name, gives a per-expert parameter (mergekit's per-model density, gamma, epsilon) one value per
expert (a tuple, in the experts' order; an expert without its own value takes the recipe's), and resolves the expert
weights (the matching override's, else the recipe's) the same way; weights that are all 1 are the same as none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from specmerge.methods import get_method
from specmerge.pipeline.recipe.layered import at_position, evaluate, is_layered


def resolve(
    entry: Any,
    t: float | None,
    weights: Sequence[Any] | None,
    own: Sequence[Mapping[str, Any]] | None,
    n: int,
) -> Any:
    """``entry`` (a TensorPlan of :mod:`.rules`, which imports this module) with its params and weights for its
    tensor at layer position ``t``; a ValueError (one line, to follow the tensor's name) for a value that is invalid
    there or a list of conditions that does not match it."""
    name = entry.name
    if entry.action == "keep_base":
        return entry
    params = entry.params
    if is_layered(params) or (own and entry.action == "merge"):
        params = _params_of(entry, t, own, n)
    resolved = None if weights is None else tuple(float(evaluate(w, name, t)) for w in weights)
    if resolved is not None and all(w == 1 for w in resolved):
        resolved = None
    if resolved is not None and entry.action == "merge":
        get_method(entry.method).check_weights(resolved, n)
    if resolved is not None and entry.action == "average" and sum(resolved) == 0:
        raise ValueError(
            f"is averaged ({entry.reason}), and the weighted mean divides by the expert weights' sum, which is 0 "
            "here: keep such tensors (non_matrix: keep_base, or an override) or change the weights"
        )
    return dataclasses.replace(entry, params=params, weights=resolved)


def _params_of(entry: Any, t: float | None, own: Sequence[Mapping[str, Any]] | None, n: int) -> dict[str, Any]:
    """The entry's params evaluated for its tensor, per-expert values as tuples, validated again (a value between
    two valid ones may still break a joint condition of the method)."""
    params = at_position(entry.params, t, entry.name)
    if entry.action != "merge":
        return {key: float(value) for key, value in params.items()}
    method = get_method(entry.method)
    for param in method.params:
        if param.per_expert and own and any(param.name in values for values in own):
            default = entry.params[param.name]
            params[param.name] = tuple(evaluate(values.get(param.name, default), entry.name, t) for values in own)
    return method.validate(params, n)
