"""One registry of merge methods: a method's signature is its schema, CLI help and documentation.

A method is a pure function ``fn(task_vectors, *, <params>) -> LayerResult`` where
``task_vectors`` is the ``N x ...`` stack of expert deltas for one tensor. Parameters are the
keyword-only arguments of ``fn``; their types, defaults and help text are read from the signature
and the ``Args:`` section of the docstring. Three keyword names are reserved for context the caller
supplies rather than the user: ``tensor_name`` and ``expert_keys`` (used by seeded methods) and
``full_shape`` (methods that can merge small cores of low-rank experts exactly, see ``specmerge.linalg.lowrank``).

Float parameters are finite: NaN is refused everywhere, and +-Inf (also written ``1e400``) too, except
where a parameter's type says that +Inf means "no limit" (:data:`NonNegativeOrInf`, e.g. SWUDI's ``t``).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import math
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import torch
from pydantic import ConfigDict, Field, ValidationError, create_model

# Parameter types with bounds, checked when a recipe or CLI call is validated, before any tensor is read.
UnitInterval = Annotated[float, Field(ge=0, le=1)]
NonNegative = Annotated[float, Field(ge=0)]
Positive = Annotated[float, Field(gt=0)]
Count = Annotated[int, Field(ge=0)]
NonNegativeOrInf = Annotated[float, Field(ge=0, allow_inf_nan=True)]  # +inf means "no limit"; NaN is refused

CONTEXT_KEYWORDS = frozenset({"tensor_name", "expert_keys", "full_shape"})
BUILTIN_MODULES = ("specmerge.methods.spectral", "specmerge.methods.baselines", "specmerge.methods.iterative")


@dataclass
class LayerResult:
    """A merged delta for one tensor plus the per-layer diagnostics the method computed on the way."""

    delta: torch.Tensor
    diagnostics: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.diagnostics.setdefault("delta_norm", float(torch.linalg.vector_norm(self.delta)))


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


@dataclass(frozen=True)
class Method:
    """A registered merge method."""

    name: str
    fn: Callable[..., LayerResult]
    summary: str
    citation: str
    needs_matrix: bool
    params: tuple[Param, ...]
    context: frozenset[str]  # the reserved context keywords fn accepts

    @property
    def factored(self) -> bool:
        """Whether the method merges the small cores of LoRA experts exactly (it takes ``full_shape``)."""
        return "full_shape" in self.context

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        known = [p.name for p in self.params]
        raise ValueError(unknown_name_message(f"parameter of method '{self.name}'", name, known))

    def validate(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Check names and types of ``params`` (strings from a CLI are coerced); return all params with defaults."""
        known = [p.name for p in self.params]
        for key, value in params.items():
            if key not in known:
                raise ValueError(unknown_name_message(f"parameter of method '{self.name}'", key, known))
            if _is_nan(value):
                raise ValueError(f"method '{self.name}': parameter '{key}' must be a number, not NaN (got {value!r})")
        try:
            model = self._model.model_validate(dict(params))
        except ValidationError as err:
            first = err.errors()[0]
            loc = ".".join(str(x) for x in first["loc"])
            raise ValueError(
                f"method '{self.name}': parameter '{loc}' {first['msg'].lower()} (got {first.get('input')!r})"
            ) from None
        values = model.model_dump()
        for key, value in values.items():  # NaN from another spelling, where +inf is allowed
            if _is_nan(value):
                raise ValueError(f"method '{self.name}': parameter '{key}' must be a number, not NaN")
        return values

    @functools.cached_property
    def _model(self) -> Any:
        fields = {p.name: (p.annotation, p.default) for p in self.params}
        config = ConfigDict(extra="forbid", strict=False, allow_inf_nan=False)  # see the module docstring
        return create_model(f"{self.name}_params", __config__=config, **fields)

    def __call__(
        self,
        task_vectors: torch.Tensor,
        *,
        dtype: torch.dtype | None = None,
        tensor_name: str = "",
        expert_keys: Sequence[str] | None = None,
        full_shape: tuple[int, int] | None = None,
        **params: Any,
    ) -> LayerResult:
        """Validate ``params`` and run the method on one stack of task vectors.

        ``dtype`` is the compute dtype (default: float32 for half inputs, else the input's).
        """
        values = self.validate(params)
        if self.needs_matrix and task_vectors.dim() != 3:
            raise ValueError(
                f"method '{self.name}' needs 2-D weights (a stack N x d_out x d_in), "
                f"got a stack of shape {tuple(task_vectors.shape)} for tensor '{tensor_name or '?'}'"
            )
        if "tensor_name" in self.context:
            values["tensor_name"] = tensor_name
        if "expert_keys" in self.context:
            values["expert_keys"] = expert_keys
        if full_shape is not None:
            if "full_shape" not in self.context:
                raise ValueError(f"method '{self.name}' cannot merge factored (low-rank) experts; densify them first")
            values["full_shape"] = full_shape
        return self.fn(compute_dtype(task_vectors, dtype), **values)


def _is_nan(value: Any) -> bool:
    """Whether ``value`` is NaN or a string that reads as NaN ("nan", "NaN")."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return False
    return isinstance(value, float) and math.isnan(value)


def compute_dtype(task_vectors: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Cast to the compute dtype: ``dtype`` if given, float32 for half inputs, else unchanged."""
    if not task_vectors.is_floating_point():
        raise TypeError(f"task vectors must be floating point, got {task_vectors.dtype}")
    if dtype is not None:
        return task_vectors.to(dtype)
    if task_vectors.dtype in (torch.float16, torch.bfloat16):
        return task_vectors.float()
    return task_vectors


_METHODS: dict[str, Method] = {}


def register(name: str, *, citation: str, needs_matrix: bool = True) -> Callable:
    """Decorator: add a method to the registry, deriving its parameters from the signature."""

    def wrap(fn: Callable[..., LayerResult]) -> Callable[..., LayerResult]:
        if name in _METHODS:
            raise ValueError(f"method '{name}' is registered twice")
        summary, helps = _parse_docstring(fn)
        hints = typing.get_type_hints(fn, include_extras=True)
        params = []
        signature = inspect.signature(fn).parameters
        for p in signature.values():
            if p.kind is not inspect.Parameter.KEYWORD_ONLY or p.name in CONTEXT_KEYWORDS:
                continue
            if p.default is inspect.Parameter.empty:
                raise TypeError(f"method '{name}': parameter '{p.name}' needs a default")
            if p.name not in helps:
                raise TypeError(f"method '{name}': parameter '{p.name}' has no help text in the docstring")
            params.append(Param(p.name, hints[p.name], p.default, helps[p.name]))
        context = frozenset(CONTEXT_KEYWORDS & signature.keys())
        _METHODS[name] = Method(name, fn, summary, citation, needs_matrix, tuple(params), context)
        return fn

    return wrap


def _load_builtins() -> None:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)


def all_methods() -> dict[str, Method]:
    """All registered methods, by name."""
    _load_builtins()
    return dict(_METHODS)


def get_method(name: str) -> Method:
    """The method called ``name``; an unknown name raises with a did-you-mean hint."""
    _load_builtins()
    try:
        return _METHODS[name]
    except KeyError:
        raise ValueError(unknown_name_message("method", name, list(_METHODS))) from None


def unknown_name_message(what: str, name: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"unknown {what} '{name}': {hint}known: {', '.join(sorted(known))}"


def _parse_docstring(fn: Callable) -> tuple[str, dict[str, str]]:
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
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
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
