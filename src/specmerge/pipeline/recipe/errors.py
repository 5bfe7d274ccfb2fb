"""Where a recipe went wrong: one line for pydantic's first validation problem, and the YAML line of a key.

:func:`recipe_error` turns a ``ValidationError`` of :class:`specmerge.pipeline.recipe.model.Recipe` into one
:class:`~specmerge.errors.RecipeError` line naming the key (``recipe key 'experts[1]'``, ``override '*.mlp.*'
key 'action'``); :func:`line_of` finds the line of that key in the recipe file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from specmerge.errors import RecipeError


def line_of(text: str, loc: Sequence[str | int]) -> int | None:
    """The 1-based line of the deepest node of ``loc`` found in the YAML document."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next((kv for kv in node.value if getattr(kv[0], "value", None) == str(part)), None)
            if match is None:
                break
            line, node = match[0].start_mark.line, match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line
        else:
            break
    return None if line is None else line + 1


def recipe_error(err: ValidationError, data: Mapping[str, Any]) -> RecipeError:
    """One line for the first problem pydantic found (ours carry their own message), and a count of the rest."""
    errors = err.errors()
    first = errors[0]
    loc = tuple(first["loc"])
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, RecipeError):
        return RecipeError(f"{cause}{more}", loc + cause.loc)
    where = key_name(loc, data)
    if first["type"] == "missing":
        return RecipeError(f"{where} is required{more}", loc)
    message = first["msg"][:1].lower() + first["msg"][1:]
    return RecipeError(f"{where}: {message} (got {first.get('input')!r}){more}", loc)


def key_name(loc: tuple[str | int, ...], data: Mapping[str, Any]) -> str:
    """``recipe key 'experts[1]'`` or ``override '*.mlp.*' key 'action'``."""
    if len(loc) >= 2 and loc[0] == "overrides" and isinstance(loc[1], int):
        items = data.get("overrides")
        item = items[loc[1]] if isinstance(items, list) and loc[1] < len(items) else None
        pattern = item.get("pattern") if isinstance(item, Mapping) else None
        name = f"override '{pattern}'" if pattern else f"overrides[{loc[1]}]"
        return f"{name} key '{dotted(loc[2:])}'" if len(loc) > 2 else name
    return f"recipe key '{dotted(loc)}'"


def dotted(loc: Sequence[str | int]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


TOO_DEEP = "a recipe is a mapping a few levels deep (base, experts, method, params, overrides)"


def parse_yaml(text: str, path: Path) -> Any:
    """The YAML document ``text`` of the recipe file ``path``; a one-line RecipeError where it cannot be read
    (naming the line and column of a syntax error, or saying that it is nested too deeply)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(err, "problem", None) or str(err).replace("\n", " ")
        raise RecipeError(f"{where}: invalid YAML: {problem}") from None
    except RecursionError:  # PyYAML builds nested values recursively
        raise RecipeError(f"{path}: the recipe is nested too deeply to read: {TOO_DEEP}") from None
