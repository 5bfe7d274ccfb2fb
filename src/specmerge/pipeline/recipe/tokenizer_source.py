"""The recipe's ``tokenizer_source``: which vocabulary and tokenizer a merged model gets, as an annotated field type.

``union`` (the default: the base's tokens, then every token an expert added; the base's own tokenizer when no
expert adds one), ``base``, or an expert, named as :mod:`specmerge.pipeline.recipe.input_choice` names inputs (its
``expert_keys`` name or its path as given in ``experts``). ``union`` and ``base`` mean those even if an expert is
called so. Unknown names are refused when the recipe is validated, with a did-you-mean hint.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from pydantic import AfterValidator, ValidationInfo

from specmerge.errors import RecipeError, unknown_name_message
from specmerge.pipeline.recipe.input_choice import input_index
from specmerge.pipeline.recipe.values import Flag

UNION = "union"
BASE_TOKENIZER = "base"


def tokenizer_index(value: str, experts: Sequence[str], keys: Sequence[str]) -> str | int:
    """``union``, ``base``, or the index of the expert ``value`` names; ValueError when it names none."""
    if value in (UNION, BASE_TOKENIZER):
        return value
    index = input_index(value, experts, keys)
    if index is None or index < 0:
        raise ValueError(unknown_name_message("tokenizer_source", value, [UNION, BASE_TOKENIZER, *keys]))
    return index


def _check(value: str, info: ValidationInfo) -> str:
    experts, keys = info.data.get("experts"), info.data.get("expert_keys")
    if experts is None or keys is None:
        return value  # the experts are invalid; that error is reported
    try:
        index = tokenizer_index(value, experts, keys)
    except ValueError as err:
        raise RecipeError(f"{err} (an expert is named by its expert_keys name or its path)") from None
    return keys[index] if isinstance(index, int) else value  # an expert by its key: the written recipe is portable


TokenizerSource = Annotated[str, AfterValidator(_check), Flag(metavar="SOURCE")]

TOKENIZER_SOURCE_HELP = (
    "the merged model's vocabulary and tokenizer when experts add tokens (rows of embed_tokens / lm_head matched by "
    "token string): union (the base's tokens, then every token an expert added), base (tokens experts added are "
    "dropped), or an expert (its expert_keys name or path: its tokenizer)"
)
