"""Several mergekit ``slices`` merging the same models over consecutive layer ranges, as one recipe.

mergekit merges each slice's layers with that slice's parameters (a source's over the slice's over the config's), a
gradient running over the slice's own layers (t = 0 at its first layer, 1 at its last); the tensors before the
layers (the input embeddings) take the first slice's parameters and those after them (the final norm, the output
head) the last slice's, both at t = 0. The recipe says the same: its top level is the first slice's merge (a tensor
outside the layers takes a gradient's first value), and each layer gets an override with its slice's method, params
and expert weights at its position in the slice (conditions on tensor names kept as they are); the tensors after the
layers get one when the last slice gives them other values than the first.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from specmerge.errors import RecipeError, SpecmergeError
from specmerge.io.formats.sources import open_source
from specmerge.io.views.stacked import before_layers, layer_of
from specmerge.pipeline.recipe.layered import interpolate, is_conditions, varies
from specmerge.pipeline.recipe.mergekit.config import MergekitConfig
from specmerge.pipeline.recipe.mergekit.slices import slice_merges


def several_slices(config: MergekitConfig, convert: Callable[[Mapping[str, Any]], Any]) -> tuple[dict, list[str]]:
    """The recipe data of a merge of several slices (``convert`` makes each slice's merge) and the differences from
    mergekit that its slices' conversions list, each once."""
    folder, parts = slice_merges(config)
    conversions = [convert(data) for _, _, data in parts]
    out = dict(conversions[0].data)
    own = [_own_params(c.data) for c in conversions]
    if any(o != own[0] for o in own) or any(varies(v) for params in own[0] for v in params.values()):
        raise RecipeError(
            "slices: a parameter given per model that differs between the slices or across layers is not supported "
            "with several slices: give it under the slice's parameters (the same for every model), or use one slice",
            ("slices",),
        )
    names = _tensor_names(folder, out["base"])
    prefix = _layer_prefix(names, out["base"])
    overrides = []
    for (first, end, _), conversion in zip(parts, conversions, strict=True):
        for layer in range(first, end):
            t = (layer - first) / (end - first - 1) if end - first > 1 else 1.0
            overrides.append({"pattern": f"{_glob_escape(prefix)}.{layer}.*", **_merge_at(conversion.data, t)})
    start, last = _merge_at(conversions[0].data, 0.0), _merge_at(conversions[-1].data, 0.0)
    if last != start:  # the tensors after the layers: the last slice's values
        after = [name for name in names if layer_of(name) is None and not before_layers(name)]
        overrides += [{"pattern": _glob_escape(name), **copy.deepcopy(last)} for name in after]  # no YAML aliases
    out["overrides"] = overrides
    differences = list(dict.fromkeys(note for c in conversions for note in c.differences))
    return out, differences


def _own_params(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [dict(e.get("params", {})) if isinstance(e, Mapping) else {} for e in data["experts"]]


def _weights(data: Mapping[str, Any]) -> list[Any] | None:
    experts = data["experts"]
    if not any(isinstance(e, Mapping) and "weight" in e for e in experts):
        return None
    return [e.get("weight", 1.0) if isinstance(e, Mapping) else 1.0 for e in experts]


def _merge_at(data: Mapping[str, Any], t: float) -> dict[str, Any]:
    """An override's method, params and expert weights: those of the slice's merge ``data`` at position ``t``."""
    override: dict[str, Any] = {
        "method": data["method"],
        "params": {key: _at(value, t) for key, value in data.get("params", {}).items()},
    }
    weights = _weights(data)
    if weights is not None:
        override["expert_weights"] = [_at(w, t) for w in weights]
    return override


def _at(value: Any, t: float) -> Any:
    """``value`` at position ``t`` of its slice: a gradient's value there, conditions kept with theirs."""
    if is_conditions(value):
        return [{**c, "value": _at(c["value"], t)} if isinstance(c, Mapping) else c for c in value]
    if isinstance(value, list):
        return interpolate([float(v) for v in value], t)
    return value


def _tensor_names(folder: Path, base: str) -> list[str]:
    """The names of the tensors of the base in ``folder`` (a hub id's cache snapshot, as resolved for its slices)."""
    try:
        with open_source(folder) as source:
            return list(source.infos())
    except (SpecmergeError, OSError) as err:  # a missing or unreadable folder: one line, as a recipe error
        raise RecipeError(f"slices: the base model '{base}' cannot be read for its layers' names: {err}") from None


def _layer_prefix(names: Sequence[str], base: str) -> str:
    prefixes = {found[0] for found in map(layer_of, names) if found is not None}
    if len(prefixes) != 1:
        raise RecipeError(
            f"slices: the base model '{base}' has {len(prefixes)} stacks of numbered layers "
            f"({', '.join(sorted(prefixes)[:3]) or 'none'}): several slices merge a model with one stack",
            ("slices",),
        )
    return prefixes.pop()


def _glob_escape(text: str) -> str:
    """``text`` as an fnmatch pattern that matches only itself."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)
