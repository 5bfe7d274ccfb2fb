"""A mergekit config as mergekit 0.1.5 reads it: its keys, checked strictly, and how it is recognised.

A YAML file is a mergekit config when it has ``merge_method`` and ``models`` (or ``slices`` / ``modules``) and none
of a specmerge recipe's ``method`` / ``experts`` (:func:`is_mergekit_config`). Every key mergekit accepts is known
here; the conversion (:mod:`.convert`) honours it or refuses it in one line, never ignores it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from specmerge.errors import RecipeError, unknown_name_message

SPECMERGE_KEYS = ("method", "experts")  # a specmerge recipe's own keys
Setting = Any  # a number, a boolean, a string, a gradient (a list) or a list of conditions ({filter, value})


class ModelEntry(BaseModel):
    """One of ``models``: a model reference and its own parameters."""

    model_config = ConfigDict(extra="forbid")

    model: str
    parameters: dict[str, Setting] | None = None


class MergekitConfig(BaseModel):
    """The keys of mergekit's ``MergeConfiguration``."""

    model_config = ConfigDict(extra="forbid")

    merge_method: str
    models: list[ModelEntry] | None = None
    slices: list[Any] | None = None
    modules: dict[str, Any] | None = None
    base_model: str | None = None
    parameters: dict[str, Setting] | None = None
    dtype: str | None = None
    out_dtype: str | None = None
    tokenizer_source: str | None = None
    tokenizer: dict[str, Any] | None = None
    chat_template: str | None = None


def setting_of(*settings: Setting | None) -> Setting | None:
    """One setting for the settings of a parameter from the highest precedence down (a source's, its slice's, the
    config's, mergekit's default; None: not given there), as mergekit resolves them: the first given one, except that
    a list of conditions none of which matches a tensor hands that tensor on to the next (its conditions followed by
    the next setting's, a number or gradient as the last ``{value: ...}``). None when none is given."""
    conditions: list[Any] = []
    for setting in settings:
        if isinstance(setting, Mapping):  # one condition, as mergekit also reads it
            setting = [setting]
        if setting is None or (isinstance(setting, list) and not setting):  # an empty list gives no value
            continue
        if not (isinstance(setting, list) and any(isinstance(c, Mapping) for c in setting)):
            return [*conditions, {"value": setting}] if conditions else setting
        for condition in setting:
            conditions.append(condition)
            if not isinstance(condition, Mapping) or condition.get("filter") in (None, "*"):
                return conditions  # a condition for every tensor: the next settings are never reached
    return conditions or None


def is_mergekit_config(data: Any) -> bool:
    """Whether ``data`` (a YAML document) is a mergekit config rather than a specmerge recipe."""
    if not isinstance(data, Mapping) or "merge_method" not in data:
        return False
    specmerge = any(key in data for key in SPECMERGE_KEYS)
    return not specmerge and any(key in data for key in ("models", "slices", "modules"))


def model_reference(value: Any, where: tuple[Any, ...]) -> Any:
    """A model as mergekit reads it, ``path[@revision][+lora[@revision]]`` or its mapping ``{model: ..., lora: ...}``
    (each a path, ``path@revision`` or ``{path, revision}``), as the text form; anything else is returned as it is
    (for the config's own check to name it)."""
    if not isinstance(value, Mapping):
        return value
    unknown = [key for key in value if key not in ("model", "lora", "override_architecture")]
    label = ".".join(str(part) for part in where)
    if unknown or "model" not in value:
        raise RecipeError(f"{label}: a model is its path or {{model: M, lora: L}}, not {dict(value)!r}", where)
    if value.get("override_architecture") is not None:
        raise RecipeError(
            f"{label}: override_architecture is not supported: write the architecture into a copy of the model's "
            "config.json and name that folder",
            where,
        )
    paths = [_model_path(value[key], (*where, key)) for key in ("model", "lora") if value.get(key) is not None]
    return "+".join(paths)


def _model_path(value: Any, where: tuple[Any, ...]) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("path"), str) and set(value) <= {"path", "revision"}:
        revision = value.get("revision")
        return f"{value['path']}@{revision}" if revision else value["path"]
    label = ".".join(str(part) for part in where)
    raise RecipeError(f"{label}: give a path, path@revision or {{path: P, revision: R}}, not {value!r}", where)


def with_model_references(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with every model reference (``base_model``, ``models``' and slices' sources' ``model``) as text."""
    data = dict(data)
    if "base_model" in data:
        data["base_model"] = model_reference(data["base_model"], ("base_model",))
    if isinstance(data.get("models"), list):
        data["models"] = [_entry_reference(entry, ("models", i)) for i, entry in enumerate(data["models"])]
    if isinstance(data.get("slices"), list):
        data["slices"] = [_slice_references(piece, i) for i, piece in enumerate(data["slices"])]
    return data


def _entry_reference(entry: Any, where: tuple[Any, ...]) -> Any:
    if not isinstance(entry, Mapping) or "model" not in entry:
        return entry
    return {**entry, "model": model_reference(entry["model"], (*where, "model"))}


def _slice_references(piece: Any, i: int) -> Any:
    if not isinstance(piece, Mapping) or not isinstance(piece.get("sources"), list):
        return piece
    sources = [_entry_reference(source, ("slices", i, "sources", k)) for k, source in enumerate(piece["sources"])]
    return {**piece, "sources": sources}


def parse_config(data: Mapping[str, Any]) -> MergekitConfig:
    """The config, checked key by key; a one-line :class:`RecipeError` names what mergekit itself would not read."""
    for key in data:
        if key not in MergekitConfig.model_fields:
            raise RecipeError(
                unknown_name_message("key of a mergekit config", str(key), list(MergekitConfig.model_fields)), (key,)
            )
    data = with_model_references(data)
    for i, entry in enumerate(data.get("models") or []):
        if isinstance(entry, str):
            raise RecipeError(f"models[{i}] is '{entry}': mergekit writes each as {{model: {entry}}}", ("models", i))
    try:
        config = MergekitConfig.model_validate(dict(data))
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise RecipeError(f"mergekit config: '{where}' {first['msg'].lower()}", tuple(first["loc"])) from None
    if sum(value is not None for value in (config.models, config.slices, config.modules)) != 1:
        raise RecipeError("a mergekit config has exactly one of models, slices and modules")
    return config
