"""Parameter values that vary across layers: a list ``[v_0, ..., v_k]`` instead of one number, as in mergekit.

A tensor's position in its stack of layers is t = i / (L - 1) for layer i of L (t = 1 when L = 1): i is the first
all-digit component of its name (``model.layers.7.mlp...`` -> 7) and L the number of layers under the same prefix
in the base (``model.layers``; a vision tower's ``vision_model.encoder.layers`` counts its own). The list is read
as a piecewise-linear curve over t, its values evenly spaced from t = 0 to t = 1. Tensors outside the numbered
layers (embeddings, final norms, heads) take the first value, as mergekit gives them.

Lists are allowed for a method's float parameters (``density``, ``t``, ``scale``, ...), validated value by value
when the recipe is read; the plan gives each tensor its own scalar (:func:`at_position`), so methods never see
lists.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Iterable, Mapping
from typing import Annotated, Any

from specmerge.methods import Method

MAX_LAYER_VALUES = 1024  # points of a gradient across layers: more is a mistake (and validating them would hang)


def layer_positions(names: Iterable[str]) -> dict[str, float | None]:
    """Each name's position t in [0, 1] in its stack of layers, or None for a name outside numbered layers."""
    located: dict[str, tuple[str, int] | None] = {}
    counts: dict[str, int] = {}
    for name in names:
        parts = name.split(".")
        index = next((k for k, part in enumerate(parts) if part.isdigit()), None)
        if index is None:
            located[name] = None
            continue
        prefix, layer = ".".join(parts[:index]), int(parts[index])
        located[name] = (prefix, layer)
        counts[prefix] = max(counts.get(prefix, 0), layer + 1)
    positions: dict[str, float | None] = {}
    for name, where in located.items():
        if where is None:
            positions[name] = None
        else:
            prefix, layer = where
            positions[name] = layer / (counts[prefix] - 1) if counts[prefix] > 1 else 1.0
    return positions


def interpolate(values: list[float], t: float | None) -> float:
    """The piecewise-linear curve through ``values`` (evenly spaced over [0, 1]) at ``t`` (None: the first value)."""
    if t is None or len(values) == 1:
        return values[0]
    scaled = t * (len(values) - 1)
    low = min(math.floor(scaled), len(values) - 1)
    high = min(low + 1, len(values) - 1)
    fraction = scaled - low
    return values[low] if fraction == 0 else (1 - fraction) * values[low] + fraction * values[high]


def at_position(params: Mapping[str, Any], t: float | None) -> dict[str, Any]:
    """``params`` with every list value replaced by its value at position ``t`` (:func:`interpolate`)."""
    return {key: interpolate(value, t) if isinstance(value, list) else value for key, value in params.items()}


def is_layered(params: Mapping[str, Any]) -> bool:
    return any(isinstance(value, list) for value in params.values())


def validate_layered(method: Method, params: Mapping[str, Any], n: int | None = None) -> dict[str, Any]:
    """``method.validate`` for params that may hold lists (one value per layer position): every list is non-empty,
    belongs to a float parameter, and each of its values is valid with the other parameters (at their first
    values); returns the complete params, lists as lists of floats."""
    lists = {key: value for key, value in params.items() if isinstance(value, list | tuple)}
    if not lists:
        return method.validate(params, n)
    first = {key: value[0] if key in lists and value else value for key, value in params.items()}
    for key, values in lists.items():
        param = method.param(key)
        if not _is_float(param.annotation):
            raise ValueError(
                f"method '{method.name}': parameter '{key}' is {param.type_name}: only float parameters take a list "
                "of values across layers"
            )
        if not values:
            raise ValueError(f"method '{method.name}': parameter '{key}' is an empty list: give at least one value")
        if len(values) > MAX_LAYER_VALUES:
            raise ValueError(
                f"method '{method.name}': parameter '{key}' has {len(values)} values across layers; at most "
                f"{MAX_LAYER_VALUES} (one per layer of the deepest models, with room to spare) are taken"
            )
    completed = method.validate(first, n)
    for key, values in lists.items():
        checked = []
        for k, value in enumerate(values):
            try:
                checked.append(method.validate({**first, key: value}, n)[key])
            except ValueError as err:
                raise ValueError(f"{err} (value {k} of the list for '{key}')") from None
        completed[key] = checked
    return completed


def _is_float(annotation: Any) -> bool:
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation is float
