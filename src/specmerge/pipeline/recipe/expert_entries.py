"""Experts given with their weight (and name): ``experts: [{path: a, weight: 0.7, name: math}, b, ...]``.

The recipe keeps one list per aspect: ``experts`` (paths), ``expert_weights`` and ``expert_keys``; an entry written
as a mapping fills its place in each (:func:`split_entries`, run before validation). ``expert_weights`` are checked
against the methods that will get them (:func:`check_weights`): a method defines them or they are refused, before
anything is read.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specmerge.errors import RecipeError, unknown_name_message
from specmerge.methods import get_method
from specmerge.pipeline.recipe.layered import at_position

ENTRY_KEYS = ("path", "weight", "name")
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
    paths, weights, names = [], [], []
    for i, entry in enumerate(experts):
        if not isinstance(entry, Mapping):
            paths.append(entry)
            weights.append(1.0)
            names.append(None)
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
    out = {**data, "experts": paths}
    for key, values, given in (("expert_weights", weights, "weight"), ("expert_keys", names, "name")):
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
        if isinstance(w, bool):
            raise RecipeError(
                f"expert_weights[{i}] is {str(w).lower()}: a weight is a number, and a boolean is never read as one "
                "(false is not 0)",
                (i,),
            )
    return weights


def normalize_weights(weights: Sequence[float] | None, n_experts: int | None) -> list[float] | None:
    """Validated weights: finite, one per expert; all 1 (the same as none) becomes None."""
    if weights is None:
        return None
    if n_experts is not None and len(weights) != n_experts:
        raise RecipeError(
            f"expert_weights has {len(weights)} values but there are {n_experts} experts: give one weight per expert"
        )
    for i, w in enumerate(weights):
        if not math.isfinite(w):
            raise RecipeError(f"expert_weights[{i}] is {w}: a weight must be a finite number", (i,))
    return None if all(w == 1 for w in weights) else [float(w) for w in weights]


def check_weights(weights: Sequence[float] | None, uses: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
    """Refuse weights that a method the recipe uses (name, params) does not define, or on which it cannot compute
    (a weighted mean of weights summing to 0), in one line."""
    if weights is None:
        return
    for name, params in uses:
        method = get_method(name)
        try:
            method.check_weights(weights, len(weights))
            if method.linear:  # its coefficients, from the first value of any list across layers
                method.linear_coefficient(at_position(params, None), len(weights), weights)
        except ValueError as err:
            raise RecipeError(str(err)) from None


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
