"""Command-line options generated from pydantic models: the model is the one source of every option.

:func:`add_fields` adds a flag (or a positional argument) for each field of a model: its name from the field
(``--field-name``, ``--no-field-name`` for a switch that is on by default, or the
:class:`~specmerge.pipeline.recipe.values.Flag` declared on the field), its help from the field's ``description``
and default, its metavar from the field's type (the choices of a ``Literal``). :func:`field_values` gives back
the fields that were typed, and only those (a flag not given leaves the model's default in place), so the
model validates the command line exactly as it validates a recipe or a Python call.

How a field's type is typed on the command line:

- ``bool``: a switch without a value (``--merge-embeddings``, ``--no-plots``); ``bool | None`` (None: decided
  later) two, ``--merge-embeddings`` and ``--no-merge-embeddings``;
- ``dict``: a repeatable ``KEY=VALUE`` flag, the pairs read by :func:`~specmerge.pipeline.recipe.values.parse_pairs`;
- a list or tuple: a repeatable flag, one item each (a positional list takes one or more); items that are
  mappings are read as YAML (``--expert-params '{density: 0.5}'``);
- ``str`` (names, paths, patterns, regular expressions): the text as typed;
- anything else (numbers, sizes, choices): the text read as a YAML recipe reads it
  (:func:`~specmerge.pipeline.recipe.values.parse_value`: ``0.5``, ``.inf``, ``null``, ``5GB``).
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from specmerge.errors import RecipeError
from specmerge.pipeline.recipe.values import field_flag, parse_pairs, parse_value

Kind = Literal["switch", "pairs", "list", "text", "value"]


def field_kind(field: FieldInfo) -> Kind:
    """How ``field`` is typed on the command line (see the module docstring)."""
    annotation = _without_none(field.annotation)
    origin = typing.get_origin(annotation)
    if annotation is bool:
        return "switch"
    if annotation is dict or origin is dict:
        return "pairs"
    if annotation in (list, tuple) or origin in (list, tuple):
        return "list"
    if annotation is str:
        return "text"
    return "value"


def add_fields(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    names: Iterable[str] | None = None,
    *,
    positional: bool = False,
) -> None:
    """Add to ``parser`` an option for each field of ``model`` named in ``names`` (default: every field), or a
    positional argument each with ``positional``. Read them back with :func:`field_values`."""
    for name in model.model_fields if names is None else names:
        field = model.model_fields[name]
        kind = field_kind(field)
        dest = _dest(model, name)
        if positional:
            parser.add_argument(dest, metavar=name, nargs="+" if kind == "list" else None, help=_help(field, kind))
            continue
        flag = field_flag(name, field)
        names_typed = [n for n in (flag.short, flag.name) if n]
        if kind == "switch":
            default = field.get_default(call_default_factory=True)
            parser.add_argument(
                *names_typed,
                dest=dest,
                action="store_const",
                const=default is not True,
                default=argparse.SUPPRESS,
                help=_help(field, kind),
            )
            if default is None and flag.name and flag.name.startswith("--"):  # both ways, unset: decided later
                parser.add_argument(
                    "--no-" + flag.name[2:], dest=dest, action="store_const", const=False, default=argparse.SUPPRESS,
                    help=f"the opposite of {flag.name}",
                )  # fmt: skip
            continue
        parser.add_argument(
            *names_typed,
            dest=dest,
            action="append" if kind in ("pairs", "list") else "store",
            default=argparse.SUPPRESS,
            metavar=flag.metavar or _metavar(name, field),
            help=_help(field, kind),
        )


def field_values(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The fields of ``model`` given on the command line, typed as a recipe types them (not yet validated)."""
    given = vars(args)
    values: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        dest = _dest(model, name)
        if dest not in given:
            continue
        typed = given[dest]
        kind = field_kind(field)
        flag = field_flag(name, field).name
        if kind == "pairs":
            values[name] = parse_pairs(typed, flag)
        elif kind == "value":
            values[name] = parse_value(typed, flag)
        elif kind == "list" and _items_are_mappings(field):  # each typed as YAML: '{density: 0.5}'
            values[name] = [parse_value(item, flag) for item in typed]
        else:
            values[name] = typed
    return values


def _items_are_mappings(field: FieldInfo) -> bool:
    args = typing.get_args(_without_none(field.annotation))
    return bool(args) and (args[0] is dict or typing.get_origin(args[0]) is dict)


def _dest(model: type[BaseModel], name: str) -> str:
    """The attribute of the parsed arguments that holds ``model``'s field (two models may share a field name)."""
    return f"{model.__name__}:{name}"


def _without_none(annotation: Any) -> Any:
    """``X`` for ``X | None``; the annotation itself otherwise."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _metavar(name: str, field: FieldInfo) -> str:
    annotation = _without_none(field.annotation)
    if typing.get_origin(annotation) is Literal:
        return "{" + ",".join(str(choice) for choice in typing.get_args(annotation)) + "}"
    return name.upper()


def _help(field: FieldInfo, kind: Kind) -> str:
    """The field's description and its default; ``%`` escaped for argparse."""
    text = field.description or ""
    default = None if field.is_required() else field.get_default(call_default_factory=True)
    if kind == "switch":
        text += " (default: on; this flag turns it off)" if default is True else ""
    elif default is not None and default != "" and default != {} and default != [] and default != ():
        shown = ", ".join(map(str, default)) if isinstance(default, list | tuple) else str(default)
        text += f" (default: {shown})"
    return text.replace("%", "%%")


def flag_error(err: RecipeError, model: type[BaseModel]) -> RecipeError:
    """``err`` about a value given on the command line, naming its flag first (``option --dtype (recipe key
    'dtype'): ...``, not only the recipe key it became); other errors unchanged."""
    key = err.loc[0] if err.loc else None
    field = model.model_fields.get(key) if isinstance(key, str) else None
    prefix = f"recipe key '{key}'"
    if field is None or not str(err).startswith(prefix):
        return err
    return RecipeError(f"option {field_flag(key, field).name} ({prefix}){str(err)[len(prefix) :]}", err.loc)
