"""The recipe's names for inputs: ``config_source`` (whose config the output takes) and ``modules`` (where own
modules come from), as annotated field types that :class:`~specmerge.pipeline.recipe.model.Recipe` declares.

An input is named by ``base``, by an expert's name (``expert_keys``; by default its folder or file name) or by
an expert's path as given in ``experts`` (compared after ``os.path.normpath`` and, for relative paths, also
as absolute paths from the current folder). ``base`` means the base even if an expert is called so. A
module's source is an expert or ``drop`` (the module is left out of the output). Unknown names are refused
when the recipe is validated, with a did-you-mean hint.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, ValidationInfo

from specmerge.errors import RecipeError, unknown_name_message
from specmerge.pipeline.recipe.values import Flag

BASE = "base"
DROP = "drop"


def input_index(name: str, experts: Sequence[str], keys: Sequence[str]) -> int | None:
    """-1 for the base, i for ``experts[i]`` (by key or path), None when ``name`` names no input."""
    if name == BASE:
        return -1
    if name in keys:
        return list(keys).index(name)
    for i, path in enumerate(experts):
        if os.path.normpath(name) == os.path.normpath(path) or os.path.abspath(name) == os.path.abspath(path):
            return i
    return None


def _known(value: str, info: ValidationInfo, what: str, extra: Sequence[str], where: str = "") -> str:
    experts, keys = info.data.get("experts"), info.data.get("expert_keys")
    if experts is None or keys is None:
        return value  # the experts are invalid; that error is reported
    if value in extra:
        return value
    index = input_index(value, experts, keys)
    if index is not None:  # an expert named by its path is held by its key: the recipe written stays portable
        return value if index < 0 else keys[index]
    message = unknown_name_message(what, value, [*extra, *keys])
    raise RecipeError(f"{where}{message} (an expert is named by its expert_keys name or its path)")


def _check_config_source(value: str, info: ValidationInfo) -> str:
    return _known(value, info, "config_source", [BASE])


def _check_modules(value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
    checked = {}
    for pattern, source in value.items():
        if not pattern:
            raise RecipeError("modules: a pattern is empty; give an fnmatch pattern of tensor names", (pattern,))
        try:
            checked[pattern] = _known(source, info, "source", [DROP], where=f"modules '{pattern}': ")
        except RecipeError as err:
            raise RecipeError(str(err), (pattern,)) from None
    return checked


def _none_is_empty(value: Any) -> Any:
    return {} if value is None else value  # an empty `modules:` in YAML means none


ConfigSource = Annotated[str, AfterValidator(_check_config_source), Flag(metavar="INPUT")]
ModuleSources = Annotated[
    dict[str, str],
    BeforeValidator(_none_is_empty),
    AfterValidator(_check_modules),
    Flag("--module", metavar="PATTERN=EXPERT"),
]

CONFIG_SOURCE_HELP = (
    "the input whose config.json (and generation/processor files) the output gets and whose tensor names it "
    "uses: base, or an expert (its expert_keys name or path)"
)
MODULES_HELP = (
    "where the experts' own modules (tensors the base lacks: a vision tower, a projector, a task head) come "
    "from: fnmatch pattern of the output tensor names -> an expert, or drop; the first matching pattern wins "
    "(repeatable; default: the one expert that holds a tensor, or the average of several)"
)
