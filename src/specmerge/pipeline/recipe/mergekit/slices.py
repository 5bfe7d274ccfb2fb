"""mergekit's ``slices`` and ``passthrough`` as recipe data: a frankenmerge (``layers``), a copy of one model, or a
merge of slices, each written as the same merge of ``models`` (one slice over every layer, the form many published
slerp configs take, is that merge; several slices over consecutive layer ranges are put together by
:mod:`.ranges`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specmerge.errors import RecipeError
from specmerge.io.hub.ids import resolve_input
from specmerge.pipeline.recipe.mergekit.config import MergekitConfig, setting_of


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


def slice_merges(config: MergekitConfig) -> tuple[Path, list[tuple[int, int, dict[str, Any]]]]:
    """The folder of the base (a hub id's cache snapshot, downloaded unless offline, as the merge itself would) and
    the merges of ``slices`` (not passthrough), each as (first layer, end, the same merge written with ``models``:
    its sources, the slice's parameters over the config's): one slice over every layer of its models (the form many
    published configs take), or several that merge the same models over consecutive layer ranges, each source of a
    slice taking the same range, from the first layer to the last. Anything else is refused in one line."""
    slices = config.slices or []
    parts, models = [], None
    for i, piece in enumerate(slices):
        if not isinstance(piece, Mapping) or not isinstance(piece.get("sources"), list) or not piece["sources"]:
            raise RecipeError(f"slices[{i}]: a slice is {{sources: [...], parameters: {{...}}}}", ("slices", i))
        unknown = [key for key in piece if key not in ("sources", "parameters")]
        if unknown:
            raise RecipeError(
                f"slices[{i}]: '{unknown[0]}' is not supported (sources and parameters are)", ("slices", i)
            )
        sources = []
        for k, source in enumerate(piece["sources"]):
            extra = [key for key in source if key not in ("model", "layer_range", "parameters")]
            if not isinstance(source, Mapping) or extra or "model" not in source or "layer_range" not in source:
                raise RecipeError(
                    f"slices[{i}].sources[{k}]: give model, layer_range and parameters only", ("slices", i, k)
                )
            sources.append(source)
        ranges = {tuple(source["layer_range"]) for source in sources}
        names = [source["model"] for source in sources]
        if len(ranges) != 1 or (models is not None and names != models):
            raise RecipeError(
                f"slices[{i}]: slices merging different layers of their models (or other models than the first "
                "slice's) are not supported: each slice's sources take the same layer_range of the same models",
                ("slices", i),
            )
        models = names
        first, end = ranges.pop()
        entries = [
            {"model": s["model"], **({"parameters": s["parameters"]} if s.get("parameters") else {})} for s in sources
        ]
        data = config.model_dump(exclude_none=True, exclude={"slices"})
        above, own = config.parameters or {}, piece.get("parameters") or {}
        parameters = {key: setting_of(own.get(key), above.get(key)) for key in {**above, **own}}
        parts.append((first, end, {**data, "models": entries, **({"parameters": parameters} if parameters else {})}))
    base = config.base_model or (models or [""])[0]
    folder = resolve_input(base).path  # a HubError in one line when it cannot be had
    layers = _layer_count(folder, base)
    starts = [first for first, _, _ in parts]
    ends = [end for _, end, _ in parts]
    if layers is None or starts != [0, *ends[:-1]] or ends[-1] != layers:
        have = "its config.json states no num_hidden_layers" if layers is None else f"{layers} layers"
        given = ", ".join(f"[{first}, {end}]" for first, end, _ in parts)
        raise RecipeError(
            f"slices: the layer ranges {given} must follow each other from the first layer to the last of the models "
            f"({have}): a merge of some layers only is a smaller model, not supported; write the merge with models",
            ("slices",),
        )
    return folder, parts


def _layer_count(folder: Path, spec: str) -> int | None:
    """num_hidden_layers of the config.json in the model ``spec``'s ``folder`` (None: not stated); a RecipeError
    when it has none."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise RecipeError(
            f"slices: the model '{spec}' has no config.json ({config_file}), whose layer count the slices are checked "
            "against: give a model folder or a Hugging Face hub id",
            ("slices",),
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    count = text.get("num_hidden_layers") if isinstance(text, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) else None
