"""A recipe's ``layers``: a frankenmerge, decoder layers of several models stacked into one (mergekit's ``slices``
with ``passthrough``).

``layers: [{model: A, range: [0, 24]}, {model: B, range: [8, 32]}]`` builds a model of 48 layers: A's first 24, then
B's layers 8 to 31, renumbered from 0 (each range's end is not included, as mergekit's ``layer_range``). The input
embeddings come from the first range's model and the final norm and output head from the last range's
(:mod:`specmerge.io.views.stacked`); ``base`` is the model whose config (its layer count rewritten) and tokenizer the
output gets. The method is ``passthrough`` and there are no experts: nothing is merged, every tensor is copied.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specmerge.errors import RecipeError

LAYERS_HELP = (
    "a frankenmerge: the output's decoder layers, ranges of models' layers stacked in order, e.g. "
    "[{model: A, range: [0, 24]}, {model: B, range: [8, 32]}] (method passthrough, no experts; embeddings from the "
    "first range's model, final norm and head from the last's, config and tokenizer from base)"
)


class LayerRange(BaseModel):
    """Layers ``range[0]`` to ``range[1] - 1`` of ``model`` (a folder, file or hub id)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1)
    range: tuple[int, int]

    @field_validator("range", mode="before")
    @classmethod
    def _whole_numbers(cls, value: Any) -> Any:
        if not isinstance(value, list | tuple) or len(value) != 2 or any(isinstance(v, bool) for v in value):
            raise RecipeError(f"a layer range is [first, end] (the end not included), got {value!r}")
        if not all(isinstance(v, int) and v >= 0 for v in value) or value[0] >= value[1]:
            raise RecipeError(f"a layer range is two whole numbers first < end, got {list(value)}")
        return value


def check_layers(recipe: Any) -> None:
    """A frankenmerge (a recipe with ``layers``) has the method passthrough and no experts; a recipe without layers
    has experts, unless its method is passthrough (a copy of the base); passthrough takes no overrides."""
    layers, method, experts = recipe.layers, recipe.method, recipe.experts
    if method == "passthrough" and recipe.overrides:
        raise RecipeError("passthrough copies every tensor as it is: overrides have nothing to change; remove them")
    if layers is not None:
        if not layers:
            raise RecipeError("layers is empty: give at least one range, e.g. [{model: A, range: [0, 24]}]")
        if method != "passthrough" or experts:
            raise RecipeError(
                "layers (a frankenmerge) copies layers, it merges nothing: method passthrough, no experts"
            )
    elif not experts and method != "passthrough":
        raise RecipeError("experts: give at least one expert fine-tuned from the base", ("experts",))
