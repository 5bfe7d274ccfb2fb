"""A mergekit config's models as specmerge's inputs: the base, the experts (a LoRA applied to the base, mergekit's
``model+lora``, is the adapter as an expert over the base) and the base's own entry among the models."""

from __future__ import annotations

import os

from specmerge.errors import RecipeError
from specmerge.pipeline.recipe.mergekit.config import MergekitConfig, ModelEntry
from specmerge.pipeline.recipe.mergekit.methods import Dialect


def split_models(config: MergekitConfig, dialect: Dialect) -> tuple[str, list[ModelEntry], ModelEntry | None]:
    """The base model, the other models (the experts) and the base's own entry among the models (or None)."""
    base = config.base_model
    if base is not None and _lora_applied(base):
        raise RecipeError(
            f"base_model '{base}' is a model with a LoRA applied (model+lora): merge the LoRA into it first",
            ("base_model",),
        )
    entries = [_lora_over_base(entry, i, base) for i, entry in enumerate(config.models or [])]
    names = [entry.model for entry in entries]
    if base is None and dialect.base == "required":
        raise RecipeError(
            f"merge_method '{config.merge_method}' needs base_model: name the model the others were tuned from"
        )
    if base is None:  # linear, karcher, base-free multislerp / nuslerp: the first model stands as the base
        base = names[0]
    if dialect.method == "linear" and base not in names:
        raise RecipeError(
            f"linear averages the models listed, and base_model '{base}' is not among them: list it under models "
            "with its weight, or remove base_model"
        )
    base_entry = entries[names.index(base)] if base in names else None
    experts = [entry for entry in entries if entry.model != base]
    low, high = dialect.models
    if len(experts) < low or (high is not None and len(experts) > high):
        count = f"exactly {low}" if low == high else f"at least {low}" if high is None else f"{low} to {high}"
        raise RecipeError(
            f"merge_method '{config.merge_method}' takes {count} model(s) besides the base, got {len(experts)}"
        )
    return base, experts, base_entry


def _lora_applied(model: str) -> bool:
    return "+" in model and not os.path.exists(model)


def _lora_over_base(entry: ModelEntry, i: int, base: str | None) -> ModelEntry:
    """A model with a LoRA applied (mergekit's ``model+lora``) as what specmerge merges the same: the LoRA adapter,
    an expert over the base, when the model is ``base_model``; any other model with a LoRA is refused."""
    if not _lora_applied(entry.model):
        return entry
    parts = entry.model.split("+")
    if len(parts) != 2 or parts[0] != base:
        raise RecipeError(
            f"models[{i}]: '{entry.model}' applies a LoRA to '{parts[0]}', which is not base_model: specmerge merges a "
            "LoRA adapter as an expert over the base; merge the LoRA into that model first",
            ("models", i),
        )
    return ModelEntry(model=parts[1], parameters=entry.parameters)
