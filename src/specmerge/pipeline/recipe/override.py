"""A recipe's per-tensor override: the treatment of the tensors whose name matches a pattern."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from specmerge.errors import RecipeError, unknown_name_message
from specmerge.pipeline.recipe.expert_entries import refuse_boolean_weights


class Override(BaseModel):
    """Treatment of the tensors whose name matches ``pattern`` (an fnmatch glob); the first match wins."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pattern: str = Field(min_length=1)
    action: Literal["merge", "average", "keep_base"] = "merge"
    method: str | None = None  # for action=merge; None = the recipe's method
    params: dict[str, Any] = Field(default_factory=dict)
    # the matched tensors' expert weights (merge or average), one per expert; None: the recipe's
    expert_weights: Annotated[list[float | list[Any]] | None, BeforeValidator(refuse_boolean_weights)] = None

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            pattern = data.get("pattern", "?")
            for key in data:
                if key not in cls.model_fields:
                    message = unknown_name_message("override key", str(key), list(cls.model_fields))
                    raise RecipeError(f"override '{pattern}': {message}", (key,))
            if data.get("params", {}) is None:  # an empty `params:` in YAML
                data = {**data, "params": {}}
        return data

    @model_validator(mode="after")
    def _merge_only_options(self) -> Override:
        if self.action == "keep_base" and self.expert_weights is not None:
            raise RecipeError(
                f"override '{self.pattern}': expert_weights apply to merged or averaged tensors, not to keep_base",
                ("expert_weights",),
            )
        if self.action != "merge" and (self.method is not None or self.params):
            raise RecipeError(
                f"override '{self.pattern}': 'method' and 'params' apply only to action 'merge', "
                f"not '{self.action}'; remove them or set action: merge",
                ("method" if self.method is not None else "params",),
            )
        return self
