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


def parse_config(data: Mapping[str, Any]) -> MergekitConfig:
    """The config, checked key by key; a one-line :class:`RecipeError` names what mergekit itself would not read."""
    for key in data:
        if key not in MergekitConfig.model_fields:
            raise RecipeError(
                unknown_name_message("key of a mergekit config", str(key), list(MergekitConfig.model_fields)), (key,)
            )
    for i, entry in enumerate(data.get("models") or []):
        if isinstance(entry, str):
            raise RecipeError(f"models[{i}] is '{entry}': mergekit writes each as {{model: {entry}}}", ("models", i))
        if isinstance(entry, Mapping) and not isinstance(entry.get("model"), str):
            model = entry.get("model")
            raise RecipeError(
                f"models[{i}]: model is {model!r}: give the model's folder or hub id as text (a model with its "
                "LoRA, {model: ..., lora: ...}, is not supported: merge the LoRA into it first)",
                ("models", i),
            )
    try:
        config = MergekitConfig.model_validate(dict(data))
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise RecipeError(f"mergekit config: '{where}' {first['msg'].lower()}", tuple(first["loc"])) from None
    if sum(value is not None for value in (config.models, config.slices, config.modules)) != 1:
        raise RecipeError("a mergekit config has exactly one of models, slices and modules")
    return config
