"""A method's parameters read from its function: keyword-only arguments, bound types, docstring help.

The types and bounds of a parameter are its annotation (e.g. :data:`UnitInterval`); its default is the
signature's; its help text is its entry in the ``Args:`` section of the docstring. Keyword arguments that
the caller supplies (:data:`CONTEXT_KEYWORDS`) are not parameters.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field

from specmerge.errors import unknown_name_message
from specmerge.foreign import param_hint

# Parameter types with bounds, checked when a recipe or CLI call is validated, before any tensor is read.
UnitInterval = Annotated[float, Field(ge=0, le=1)]
NonNegative = Annotated[float, Field(ge=0)]
Positive = Annotated[float, Field(gt=0)]
Count = Annotated[int, Field(ge=0)]
NonNegativeOrInf = Annotated[float, Field(ge=0, allow_inf_nan=True)]  # +inf means "no limit"; NaN is refused


def per_expert(scalar: Any) -> Any:
    """The type of a parameter that takes one value for every expert or a value per expert (a tuple, in the
    experts' order): mergekit's per-model density, gamma and epsilon. A recipe gives per-expert values in its
    experts' entries (``experts: [{path: ..., params: {density: 0.5}}]``); the plan passes the method a tuple."""
    return typing.Union[scalar, tuple[scalar, ...]]  # noqa: UP007 (Annotated members)


SEED_KEYWORDS = frozenset({"tensor_name", "expert_keys"})  # context a seeded method receives
# keyword arguments the caller supplies, never the user: the seed context, the layer's real shape (factored
# methods), the per-expert weights (weighted methods) and the base tensor W_0 (methods of whole weights, slerp)
CONTEXT_KEYWORDS = SEED_KEYWORDS | {"full_shape", "weights", "base"}


@dataclass(frozen=True)
class Param:
    """One user-facing parameter of a method."""

    name: str
    annotation: Any
    default: Any
    help: str

    @property
    def type_name(self) -> str:
        return _type_name(self.annotation)

    @property
    def per_expert(self) -> bool:
        """Whether the parameter also takes one value per expert (:func:`per_expert`)."""
        args = typing.get_args(self.annotation) if typing.get_origin(self.annotation) is typing.Union else ()
        return any(typing.get_origin(a) is tuple for a in args)


def signature_params(
    name: str, fn: Callable, fixed: dict[str, Any], defaults: dict[str, Any], helps: Mapping[str, str]
) -> tuple[tuple[Param, ...], frozenset[str]]:
    """The user-facing parameters of ``fn`` (keyword-only, less context keywords and ``fixed``) and its context."""
    hints = typing.get_type_hints(fn, include_extras=True)
    signature = inspect.signature(fn).parameters
    keyword_only = {p.name for p in signature.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    for key in [*fixed, *defaults]:
        if key not in keyword_only or key in CONTEXT_KEYWORDS:
            raise TypeError(f"method '{name}': '{key}' is not a keyword-only parameter of {fn.__name__}")
    params = []
    for p in signature.values():
        if p.name not in keyword_only or p.name in CONTEXT_KEYWORDS or p.name in fixed:
            continue
        default = defaults.get(p.name, p.default)
        if default is inspect.Parameter.empty:
            raise TypeError(f"method '{name}': parameter '{p.name}' needs a default")
        if p.name not in helps:
            raise TypeError(f"method '{name}': parameter '{p.name}' has no help text in the docstring")
        params.append(Param(p.name, hints[p.name], default, helps[p.name]))
    return tuple(params), frozenset(CONTEXT_KEYWORDS & signature.keys())


def is_nan(value: Any) -> bool:
    """Whether ``value`` is NaN or a string that reads as NaN ("nan", "NaN")."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return False
    return isinstance(value, float) and math.isnan(value)


def check_given(method: str, params: Mapping[str, Any], declared: Sequence[Param]) -> None:
    """A one-line ValueError for a parameter ``method`` does not have (another tool's name explained, a typo
    answered with the closest name), a boolean for a number, or NaN."""
    known = {p.name: p for p in declared}
    for key, value in params.items():
        if key not in known:
            what, foreign = f"parameter of method '{method}'", param_hint(method, key)
            raise ValueError(unknown_name_message(what, key, list(known), foreign=foreign))
        refuse_boolean_number(method, key, value, known[key].annotation)
        if is_nan(value):
            raise ValueError(f"method '{method}': parameter '{key}' must be a number, not NaN (got {value!r})")


def check_validated(method: str, values: Mapping[str, Any], n: int | None) -> None:
    """After validation: NaN from another spelling (where +inf is allowed) refused, and values per expert one for
    each of ``n`` experts (when known)."""
    for key, value in values.items():
        if any(is_nan(v) for v in (value if isinstance(value, tuple) else (value,))):
            raise ValueError(f"method '{method}': parameter '{key}' must be a number, not NaN")
        if isinstance(value, tuple) and n is not None and len(value) != n:
            raise ValueError(
                f"method '{method}': parameter '{key}' has {len(value)} values, one per expert, for {n} experts"
            )


def validation_message(method: str, errors: Sequence[Any], params: Mapping[str, Any]) -> str:
    """One line for pydantic's ``errors`` on ``params``: the first error of the branch the input chose (a parameter
    that takes one value or one per expert, :func:`per_expert`, reports the tuple's error for a tuple)."""
    first = errors[0]
    for error in errors:
        loc = error["loc"]
        branch = next((str(x) for x in loc[1:] if isinstance(x, str)), None)
        if branch is None or branch.startswith("tuple") == isinstance(
            params.get(loc[0]) if loc else None, tuple | list
        ):
            first = error
            break
    name = first["loc"][0] if first["loc"] else "?"
    index = next((f" (value {x} of the values per expert)" for x in first["loc"] if isinstance(x, int)), "")
    return f"method '{method}': parameter '{name}' {first['msg'].lower()} (got {first.get('input')!r}){index}"


def refuse_boolean_number(method: str, name: str, value: Any, annotation: Any) -> None:
    """A one-line ValueError for a boolean (or a list holding one) given to a parameter that is not a switch: YAML's
    ``false`` would otherwise be read as 0 (``scale: false`` merging nothing)."""
    booleans = isinstance(value, bool) or (isinstance(value, list) and any(isinstance(v, bool) for v in value))
    if booleans and not (annotation is bool or bool in typing.get_args(annotation)):
        raise ValueError(
            f"method '{method}': parameter '{name}' is a number, got {json.dumps(value)}: a boolean is never read as a "
            "number (false is not 0)"
        )


def parse_docstring(fn: Callable) -> tuple[str, dict[str, str]]:
    doc = inspect.getdoc(fn) or ""
    summary = doc.split("\n\n")[0].replace("\n", " ").strip()
    helps: dict[str, str] = {}
    match = re.search(r"^Args:\n((?:[ \t]+.*\n?|\n)+)", doc, flags=re.MULTILINE)
    if match:
        current = None
        for line in match.group(1).splitlines():
            entry = re.match(r"^\s{4}(\w+)(?: \([^)]*\))?:\s*(.*)$", line)
            if entry:
                current = entry.group(1)
                helps[current] = entry.group(2).strip()
            elif current and line.strip():
                helps[current] += " " + line.strip()
    return summary, helps


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        inner, *extras = typing.get_args(annotation)
        bounds = [_bound_text(m) for extra in extras for m in getattr(extra, "metadata", [extra])]
        return " ".join([_type_name(inner), *filter(None, bounds)])
    if origin is Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(annotation)) + "}"
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        scalars = [a for a in args if typing.get_origin(a) is not tuple]
        each = " (or one per expert)" if len(scalars) < len(args) else ""
        return " | ".join(_type_name(a) for a in scalars) + each
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _bound_text(constraint: Any) -> str:
    for attr, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if hasattr(constraint, attr):
            return f"{symbol}{getattr(constraint, attr)}"
    if getattr(constraint, "allow_inf_nan", False):
        return "or inf"
    return ""
