"""Parameter values that vary across layers and tensors, as in mergekit: a list ``[v_0, ..., v_k]`` instead of one
number (a gradient over the layers), or a list of conditions ``[{filter: self_attn, value: 0.5}, {value: 0.3}]``.

A tensor's position in its stack of layers is t = i / (L - 1) for layer i of L (t = 1 when L = 1): i is the first
all-digit component of its name (``model.layers.7.mlp...`` -> 7) and L the number of layers under the same prefix
in the base (``model.layers``; a vision tower's ``vision_model.encoder.layers`` counts its own). The list is read
as a piecewise-linear curve over t, its values evenly spaced from t = 0 to t = 1. Tensors outside the numbered
layers (embeddings, final norms, heads) take the first value, as mergekit gives them.

A list of conditions gives each tensor the value of its first condition that matches its name: ``filter: s`` matches
a name that contains ``s`` (mergekit's meaning; ``*`` matches every name), ``pattern: g`` one that matches the
fnmatch glob ``g`` (specmerge's overrides' meaning), and a condition with neither matches every name. Its value is a
number or a gradient. A tensor that no condition matches is an error of the plan, naming the tensor (mergekit gives
such a tensor no value either).

Gradients and conditions are allowed for a method's float parameters (``density``, ``t``, ``scale``, ...) and
expert weights, validated value by value when the recipe is read; the plan gives each tensor its own scalar
(:func:`evaluate`, :func:`at_position`), so methods never see lists.
"""

from __future__ import annotations

import fnmatch
import math
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
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


CONDITION_KEYS = ("filter", "pattern", "value")


class NoCondition(ValueError):
    """No condition of a list of conditions matches a tensor's name."""


def is_conditions(value: Any) -> bool:
    """Whether ``value`` is a list of conditions (mappings with ``value``), not a gradient."""
    return isinstance(value, list) and any(isinstance(v, Mapping) for v in value)


def matches(condition: Mapping[str, Any], name: str | None) -> bool:
    """Whether ``condition`` applies to the tensor ``name`` (None: a tensor outside every filter's reach)."""
    if "filter" in condition and condition["filter"] not in (None, "*"):
        return name is not None and str(condition["filter"]) in name
    if condition.get("pattern") is not None:
        return name is not None and fnmatch.fnmatchcase(name, str(condition["pattern"]))
    return True


def evaluate(value: Any, name: str | None, t: float | None) -> Any:
    """The scalar that ``value`` (a number, a gradient or a list of conditions) takes for tensor ``name`` at layer
    position ``t``; :class:`NoCondition` when no condition matches."""
    if is_conditions(value):
        for condition in value:
            if matches(condition, name):
                return evaluate(condition["value"], name, t)
        filters = [c.get("filter", c.get("pattern")) for c in value]
        raise NoCondition(f"no condition matches it (filters {filters}; add a last {{value: ...}} for the rest)")
    if isinstance(value, list):
        return interpolate(value, t)
    return value


def at_position(params: Mapping[str, Any], t: float | None, name: str | None = None) -> dict[str, Any]:
    """``params`` with every gradient or list of conditions replaced by its value for tensor ``name`` at position
    ``t`` (:func:`evaluate`; without a name, conditions with a filter or pattern do not match)."""
    return {key: evaluate(value, name, t) for key, value in params.items()}


def varies(value: Any) -> bool:
    """Whether ``value`` is a gradient or a list of conditions rather than one value (a tuple is a value per
    expert, resolved by the plan)."""
    return isinstance(value, list)


def is_layered(params: Mapping[str, Any]) -> bool:
    return any(varies(value) for value in params.values())


def validate_layered(method: Method, params: Mapping[str, Any], n: int | None = None) -> dict[str, Any]:
    """``method.validate`` for params that may hold gradients and lists of conditions (:func:`validate_value`): each
    belongs to a float parameter, and each of its values is valid with the other parameters (at their first
    values); returns the complete params, gradients as lists of floats and conditions as mappings."""
    lists = {key: value for key, value in params.items() if varies(value)}
    if not lists:
        return method.validate(params, n)
    for key in lists:
        param = method.param(key)
        if not _is_float(param.annotation):
            raise ValueError(
                f"method '{method.name}': parameter '{key}' is {param.type_name}: only float parameters take a list "
                "of values across layers or a list of conditions"
            )
        if not lists[key]:
            raise ValueError(f"method '{method.name}': parameter '{key}' is an empty list: give at least one value")
    first = {key: first_value(value) if key in lists else value for key, value in params.items()}
    completed = method.validate(first, n)
    for key, value in lists.items():

        def check(scalar: Any, k: int, key: str = key) -> Any:
            try:
                return method.validate({**first, key: scalar}, n)[key]
            except ValueError as err:
                raise ValueError(f"{err} (value {k} of the list for '{key}')") from None

        completed[key] = validate_value(value, check, f"method '{method.name}': parameter '{key}'")
    return completed


def first_value(value: Any) -> Any:
    """The first number of a gradient or list of conditions (the value checked with the other parameters)."""
    while varies(value) and value:
        value = value[0]["value"] if isinstance(value[0], Mapping) and "value" in value[0] else value[0]
    return value


def validate_value(value: Any, check: Callable[[Any, int], Any], what: str) -> Any:
    """``value`` with each of its numbers replaced by ``check(number, k)`` (k counts them): a number, a gradient
    (a non-empty list of at most :data:`MAX_LAYER_VALUES` numbers) or a list of conditions, each a mapping of
    ``value`` (a number or a gradient) and at most one of ``filter`` (a substring) and ``pattern`` (a glob); a
    one-line ValueError names ``what`` for anything else."""
    counter = iter(range(MAX_LAYER_VALUES * MAX_LAYER_VALUES))
    if not is_conditions(value):
        return _gradient(value, check, what, counter)
    if len(value) > MAX_LAYER_VALUES:
        raise ValueError(f"{what} has {len(value)} conditions; at most {MAX_LAYER_VALUES} are taken")
    checked = []
    for i, condition in enumerate(value):
        if not isinstance(condition, Mapping) or "value" not in condition:
            raise ValueError(f"{what}: condition {i} is {condition!r}: write {{filter: <part of a name>, value: ...}}")
        unknown = [key for key in condition if key not in CONDITION_KEYS]
        if unknown:
            raise ValueError(f"{what}: condition {i} has the unknown key '{unknown[0]}' (filter, pattern, value)")
        if condition.get("filter") is not None and condition.get("pattern") is not None:
            raise ValueError(f"{what}: condition {i} has both filter and pattern: give one")
        for key in ("filter", "pattern"):
            if condition.get(key) is not None and (not isinstance(condition[key], str) or not condition[key]):
                raise ValueError(f"{what}: condition {i}'s {key} is {condition[key]!r}: give a non-empty name")
        if is_conditions(condition["value"]):
            raise ValueError(f"{what}: condition {i}'s value is a list of conditions: give a number or a gradient")
        where = {key: condition[key] for key in ("filter", "pattern") if condition.get(key) is not None}
        checked.append({**where, "value": _gradient(condition["value"], check, what, counter)})
    return checked


def _gradient(value: Any, check: Callable[[Any, int], Any], what: str, counter: Iterator[int]) -> Any:
    if not isinstance(value, list | tuple):
        return check(value, next(counter))
    if not value:
        raise ValueError(f"{what} is an empty list: give at least one value")
    if len(value) > MAX_LAYER_VALUES:
        raise ValueError(
            f"{what} has {len(value)} values across layers; at most {MAX_LAYER_VALUES} (one per layer of the deepest "
            "models, with room to spare) are taken"
        )
    return [check(v, next(counter)) for v in value]


def _is_float(annotation: Any) -> bool:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # a value per expert, or one for all
        return any(_is_float(a) for a in typing.get_args(annotation) if typing.get_origin(a) is not tuple)
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation is float
