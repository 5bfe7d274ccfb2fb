"""mergekit's ``slices`` and ``passthrough`` as recipe data: a frankenmerge (``layers``), a copy of one model, or a
merge of one slice over every layer of its models (the form many published slerp configs take), written as the
same merge of ``models``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specmerge.errors import RecipeError
from specmerge.pipeline.recipe.mergekit.config import MergekitConfig


def passthrough_data(config: MergekitConfig) -> dict[str, Any]:
    """The recipe of ``passthrough``: of one model, its copy; of ``slices`` (one source each), a frankenmerge
    (``layers``)."""
    if config.slices is None:
        models = config.models or []
        if len(models) != 1 or models[0].parameters:
            raise RecipeError("passthrough of models copies exactly one model, without parameters", ("models",))
        return {"base": models[0].model, "experts": [], "method": "passthrough"}
    if config.parameters:
        raise RecipeError(f"passthrough takes no parameters, got {sorted(config.parameters)}", ("parameters",))
    layers = []
    for i, piece in enumerate(config.slices or []):
        sources = piece.get("sources") if isinstance(piece, Mapping) else None
        extra = [key for key in (piece if isinstance(piece, Mapping) else {}) if key != "sources"]
        if not isinstance(sources, list) or len(sources) != 1 or extra:
            raise RecipeError(
                f"slices[{i}]: a passthrough slice has exactly one source and nothing else", ("slices", i)
            )
        source = sources[0]
        unknown = [key for key in source if key not in ("model", "layer_range")] if isinstance(source, Mapping) else []
        if not isinstance(source, Mapping) or "model" not in source or "layer_range" not in source or unknown:
            raise RecipeError(f"slices[{i}]: a source is {{model: M, layer_range: [A, B]}}", ("slices", i))
        layers.append({"model": source["model"], "range": source["layer_range"]})
    base = config.base_model or layers[0]["model"]
    return {"base": base, "experts": [], "method": "passthrough", "layers": layers}


def one_slice_as_models(config: MergekitConfig) -> dict[str, Any]:
    """A merge of ``slices`` that is one slice over every layer of its models (the form many published configs
    take), written as the same merge of ``models`` (its sources, the slice's parameters over the config's); several
    slices merged range by range are refused in one line."""
    slices = config.slices or []
    ranges = {tuple(src.get("layer_range", ())) for piece in slices for src in piece.get("sources", [])}
    if len(slices) != 1 or len(ranges) != 1 or not isinstance(slices[0], Mapping):
        raise RecipeError(
            f"slices with merge_method '{config.merge_method}' merging layer ranges range by range are not supported: "
            "one slice whose sources all take every layer is (or write the merge with models)",
            ("slices",),
        )
    piece = slices[0]
    unknown = [key for key in piece if key not in ("sources", "parameters")]
    if unknown:
        raise RecipeError(f"slices[0]: '{unknown[0]}' is not supported (sources and parameters are)", ("slices", 0))
    first, end = ranges.pop()
    models = []
    for i, source in enumerate(piece["sources"]):
        extra = [key for key in source if key not in ("model", "layer_range", "parameters")]
        if extra or "model" not in source:
            raise RecipeError(f"slices[0].sources[{i}]: give model, layer_range and parameters only", ("slices", 0))
        models.append(
            {"model": source["model"], **({"parameters": source["parameters"]} if source.get("parameters") else {})}
        )
    layers = _local_layer_count(config.base_model or models[0]["model"])
    if first != 0 or layers is None or end != layers:
        have = (
            "its layer count is not known here (a local folder's config.json)" if layers is None else f"{layers} layers"
        )
        raise RecipeError(
            f"slices: layer_range [{first}, {end}] must take every layer of the models ({have}): a slice of some "
            "layers only is a smaller model, not supported; write the merge with models",
            ("slices",),
        )
    data = config.model_dump(exclude_none=True, exclude={"slices"})
    parameters = {**(config.parameters or {}), **(piece.get("parameters") or {})}
    return {**data, "models": models, **({"parameters": parameters} if parameters else {})}


def _local_layer_count(spec: str) -> int | None:
    """num_hidden_layers of a local model folder's config.json (None: not a local folder, or not stated)."""
    config_file = Path(spec) / "config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    count = text.get("num_hidden_layers") if isinstance(text, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) else None
