"""The JSON Schema of a recipe, with the registered methods and each method's parameters filled in.

Editors with a YAML language server check and complete a recipe against it (``specmerge schema >
recipe.schema.json``; in the recipe: ``# yaml-language-server: $schema=recipe.schema.json``). It is built from
the :class:`~specmerge.pipeline.recipe.model.Recipe` model and the registry each time, so a newly registered method
appears with its parameters, bounds, defaults and help without any list to update.
"""

from __future__ import annotations

from typing import Any

from specmerge.methods import all_methods
from specmerge.pipeline.recipe.model import Override, Recipe


def _params_by_method(method_key: str, default: str | None) -> list[dict[str, Any]]:
    """``if method is X then params follows X's schema``, one rule per method (and for the default method, also
    when ``method`` is not given)."""
    rules = []
    for name, method in all_methods().items():
        condition: dict[str, Any] = {"properties": {method_key: {"const": name}}}
        if name == default:
            condition = {"anyOf": [condition, {"not": {"required": [method_key]}}]}
        rules.append({"if": condition, "then": {"properties": {"params": _layered(method.params_schema())}}})
    return rules


def _layered(params: dict[str, Any]) -> dict[str, Any]:
    """A method's params schema where every float parameter may also be a list of values across layers or a list of
    conditions (:mod:`specmerge.pipeline.recipe.layered`); values per expert go in the experts' entries."""
    for name, prop in params.get("properties", {}).items():
        number = next((p for p in prop.get("anyOf", []) if p.get("type") == "number"), None)  # one or per expert
        if prop.get("type") == "number" or number is not None:
            value = {k: v for k, v in (number or prop).items() if k not in ("default", "description", "title")}
            layered = {"type": "array", "items": value, "minItems": 1}
            condition = {
                "type": "object",
                "properties": {"filter": {"type": "string"}, "pattern": {"type": "string"}},
                "required": ["value"],
                "additionalProperties": False,
            }
            condition["properties"]["value"] = {"anyOf": [value, layered]}  # type: ignore[index]
            conditions = {"type": "array", "items": condition, "minItems": 1}
            kept = {k: v for k, v in prop.items() if k in ("default", "description", "title")}
            params["properties"][name] = {**kept, "anyOf": [value, layered, conditions]}
    return params


EXPERT_ENTRY = {  # experts: [{path, weight, name}] (pipeline/recipe/expert_entries.py)
    "type": "object",
    "properties": {
        "path": {"type": "string", "minLength": 1},
        "weight": {"type": "number"},
        "name": {"type": "string"},
    },
    "required": ["path"],
    "additionalProperties": False,
}


def recipe_schema() -> dict[str, Any]:
    """The recipe's JSON Schema (draft 2020-12): ``method`` is one of the registered names and ``params`` (also
    in merge overrides) follows the chosen method's parameters."""
    schema = Recipe.model_json_schema()
    names = list(all_methods())
    default = Recipe.model_fields["method"].default
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["properties"]["method"]["enum"] = names
    schema["properties"]["experts"]["items"] = {"anyOf": [schema["properties"]["experts"]["items"], EXPERT_ENTRY]}
    schema["allOf"] = _params_by_method("method", default)
    override = schema["$defs"][Override.__name__]
    override["properties"]["method"] = {"anyOf": [{"enum": names}, {"type": "null"}], "default": None}
    override["allOf"] = _params_by_method("method", None)
    return schema
