"""Experts given with their weight, name and own parameters: ``experts: [{path: a, weight: 0.7, name: math,
params: {density: 0.5}}, b, ...]``.

The recipe keeps one list per aspect: ``experts`` (paths), ``expert_weights``, ``expert_keys`` and
``expert_params``; an entry written as a mapping fills its place in each (:func:`split_entries`, run before
validation). A weight may vary across layers and tensors as a method's float parameter does (a gradient, a list of
conditions: :mod:`.layered`). ``expert_weights`` are checked against the methods that will get them
(:func:`check_weights`): a method defines them or they are refused, before anything is read. ``expert_params`` hold
each expert's own values of the method's per-expert parameters (mergekit's per-model density, gamma, epsilon):
:func:`check_expert_params`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specmerge.errors import RecipeError, unknown_name_message
from specmerge.methods import get_method
from specmerge.methods.linear import weight_sum
from specmerge.pipeline.recipe.layered import first_value, validate_layered, validate_value, varies

ENTRY_KEYS = ("path", "weight", "name", "params")
WEIGHTS_HELP = (
    "per-expert weights, one per expert in order (repeatable), for methods that define them (linear, "
    "task_arithmetic, ties, dare_*, della*, breadcrumbs, weight_average); in a recipe also "
    "experts: [{path: ..., weight: 0.7}]; averaged tensors take the weighted mean"
)


def split_entries(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """``data`` with mapping entries of ``experts`` split into ``experts``, ``expert_weights`` and ``expert_keys``."""
    experts = data.get("experts")
    if not isinstance(experts, list | tuple) or not any(isinstance(e, Mapping) for e in experts):
        return data
    paths, weights, names, params = [], [], [], []
    for i, entry in enumerate(experts):
        if not isinstance(entry, Mapping):
            paths.append(entry)
            weights.append(1.0)
            names.append(None)
            params.append({})
            continue
        for key in entry:
            if key not in ENTRY_KEYS:
                message = unknown_name_message("key of an expert entry", str(key), list(ENTRY_KEYS))
                raise RecipeError(f"experts[{i}]: {message}", (i, key))
        if "path" not in entry:
            raise RecipeError(f"experts[{i}] has no 'path': write {{path: <folder or id>, weight: 0.7}}", (i,))
        paths.append(entry["path"])
        weights.append(entry.get("weight", 1.0))
        names.append(entry.get("name"))
        params.append(entry.get("params") or {})
    out = {**data, "experts": paths}
    aspects = (("expert_weights", weights, "weight"), ("expert_keys", names, "name"))
    for key, values, given in (*aspects, ("expert_params", params, "params")):
        if not any(isinstance(e, Mapping) and given in e for e in experts):
            continue
        if data.get(key) is not None:
            raise RecipeError(f"give each expert's {given} either in experts: [{{{given}: ...}}] or in {key}, not both")
        if key == "expert_keys" and None in values:
            raise RecipeError(f"experts[{values.index(None)}] has no 'name' where others have one: name every expert")
        out[key] = values
    return out


def refuse_boolean_weights(weights: Any) -> Any:
    """``weights`` as given, unless one is a boolean (YAML's true / false): never read as 1 / 0."""
    for i, w in enumerate(weights if isinstance(weights, list) else []):
        if isinstance(w, bool) or (isinstance(w, list) and any(isinstance(v, bool) for v in w)):
            raise RecipeError(
                f"expert_weights[{i}] is {str(w).lower()}: a weight is a number, and a boolean is never read as one "
                "(false is not 0)",
                (i,),
            )
    return weights


def normalize_weights(weights: Sequence[Any] | None, n_experts: int | None) -> list[Any] | None:
    """Validated weights: one per expert, each a finite number, a gradient or a list of conditions (:mod:`.layered`);
    all 1 (the same as none) becomes None."""
    if weights is None:
        return None
    if n_experts is not None and len(weights) != n_experts:
        raise RecipeError(
            f"expert_weights has {len(weights)} values but there are {n_experts} experts: give one weight per expert"
        )
    checked = []
    for i, w in enumerate(weights):

        def finite(value: Any, k: int, i: int = i) -> float:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise RecipeError(f"expert_weights[{i}] is {value!r}: a weight must be a finite number", (i,))
            return float(value)

        try:
            checked.append(validate_value(w, finite, f"expert_weights[{i}]"))
        except ValueError as err:
            raise RecipeError(str(err), (i,)) from None
    return None if all(w == 1 for w in checked) else checked


def scalar_weights(weights: Sequence[Any] | None) -> list[float] | None:
    """The first value of each weight (each as it is when none varies): what the checks before the plan see."""
    return None if weights is None else [float(first_value(w)) for w in weights]


def check_weights(weights: Sequence[Any] | None, uses: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
    """Refuse weights that a method the recipe uses (name, params) does not define, or on which it cannot compute
    (a weighted mean of weights summing to 0, ``normalize: true`` over them), in one line, before anything is read;
    weights that vary are checked at their first values here, and per tensor by the plan."""
    if weights is None:
        return
    first = scalar_weights(weights)
    for name, params in uses:
        method = get_method(name)
        try:
            method.check_weights(first, len(first))
            if any(varies(w) for w in weights):
                continue
            values = {k: first_value(v) for k, v in params.items()}
            if method.linear:  # its coefficients divide by what they divide by (linear: the base's weight too)
                method.linear_coefficient(values, len(first), first)
            elif method.weighting == "any" and method.validate(values).get("normalize") is True:
                weight_sum(first, None)  # normalize divides by the weights' sum
        except ValueError as err:
            raise RecipeError(str(err)) from None


def check_expert_params(
    expert_params: Sequence[Any] | None,
    keys: Sequence[str] | None,
    uses: Sequence[tuple[str, Mapping[str, Any]]],
) -> list[dict[str, Any]] | None:
    """Each expert's own parameter values, validated: a parameter that every merging method (name, params) of the
    recipe takes per expert, each value valid with the method's other params; None when no expert has any."""
    if expert_params is None or not any(expert_params):
        return None
    if keys is not None and len(expert_params) != len(keys):
        raise RecipeError(f"expert_params has {len(expert_params)} entries for {len(keys)} experts: give one each")
    checked = []
    for i, own in enumerate(expert_params):
        name = keys[i] if keys else str(i)
        if not isinstance(own, Mapping):
            raise RecipeError(f"expert '{name}': params is {own!r}: write a mapping, e.g. {{density: 0.5}}", (i,))
        for key in own:
            for method_name, params in uses:
                method = get_method(method_name)
                if key not in {p.name for p in method.params if p.per_expert}:
                    takes = sorted(p.name for p in method.params if p.per_expert) or ["none"]
                    raise RecipeError(
                        f"expert '{name}': parameter '{key}' of its own: method '{method.name}' does not take it per "
                        f"expert (it takes {', '.join(takes)}); give it under params for every expert",
                        (i, key),
                    )
                try:
                    validate_layered(method, {**params, key: own[key]})
                except ValueError as err:
                    raise RecipeError(f"expert '{name}': {err}", (i, key)) from None
        checked.append(dict(own))
    return checked


def default_expert_keys(experts: Sequence[str]) -> list[str]:
    """Each expert's folder/file name; where names repeat, as many parent folders as make them unique."""
    parts = [Path(os.path.normpath(e)).parts or (e,) for e in experts]
    keys = [p[-1] for p in parts]
    depth = 1
    while len(set(keys)) < len(keys) and depth < max(len(p) for p in parts):
        depth += 1
        repeated = {k for k in keys if keys.count(k) > 1}
        keys = ["/".join(p[-depth:]) if k in repeated else k for p, k in zip(parts, keys, strict=True)]
    for i, key in enumerate(keys):  # still equal (cannot happen for distinct paths): number them
        if keys.count(key) > 1:
            keys[i] = f"{key}#{i}"
    return keys
