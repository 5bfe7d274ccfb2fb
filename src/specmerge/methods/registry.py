"""The registry of merge methods: a method's signature is its schema, CLI help and documentation.

A method is a pure function ``fn(task_vectors, *, <params>) -> LayerResult`` where ``task_vectors``
is the ``N x ...`` stack of expert deltas for one tensor. :func:`register` turns it into a
:class:`Method`: its parameters are the keyword-only arguments of ``fn`` (types, bounds and defaults
from the signature, help text from the ``Args:`` section of the docstring), and what the caller may
do with it is declared, not guessed from its name or signature:

- ``linear_coefficient``: the merged delta is sum_i c_i tau_i, so it is the same function of every
  row (the executor merges such tensors in row blocks, or as concatenated LoRA factors);
- ``weights``: ``fn`` takes per-expert weights (``weights``, one float per expert, or None for none given):
  ``"any"`` finite weights, ``"positive"`` (methods that elect signs); other methods refuse weights;
- ``factored``: ``fn`` run on the small cores T_i of LoRA experts tau_i = P T_i R^T returns the core
  of exactly the dense result (:meth:`Method.merge_factored`); ``fn`` takes the real layer shape as
  ``full_shape`` if it needs it;
- ``seeded``: ``fn`` draws random numbers from ``tensor_name`` and ``expert_keys`` (the caller's context);
- ``spectral``: ``fn`` is one :func:`~specmerge.linalg.solve.spectral_merge` and takes a layer's stored projections
  in place of the stack (a spectral cache re-synthesizes any of its settings without a decomposition);
- a ``base`` keyword: ``fn`` needs the base tensor W_0 itself (it merges whole weights, as slerp does): never
  factored, and the caller passes it;
- ``cost``: what merging one tensor costs in operations (:mod:`.operations`), for the dry run's estimate and
  the progress bar (:mod:`specmerge.pipeline.estimate.cost`); a method without one is estimated as a few passes;
- ``featured``, ``title``, ``settings``: how listings and the accuracy benchmark show it.

Float parameters are finite: NaN is refused everywhere, and +-Inf (also written ``1e400``) too, except
where a parameter's type says that +Inf means "no limit" (:data:`.params.NonNegativeOrInf`, e.g. SWUDI's ``t``).
This module imports nothing above ``specmerge.linalg``; the built-in methods register themselves from
their family modules, which ``specmerge.methods`` (the catalog) imports.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import ConfigDict, Field, ValidationError, create_model

from specmerge.errors import unknown_name_message
from specmerge.foreign import METHODS
from specmerge.linalg.lowrank import FactoredResult, LoraDelta, factor_cores
from specmerge.linalg.precision import compute_dtype
from specmerge.methods.operations import CostFunction, Operations
from specmerge.methods.params import (
    SEED_KEYWORDS,
    Param,
    check_given,
    check_validated,
    parse_docstring,
    signature_params,
    validation_message,
)
from specmerge.methods.settings import Setting  # re-exported: methods import it from here

# (validated params, per-expert weights: all 1.0 when none are given) -> c_i in merged delta = sum_i c_i tau_i
LinearCoefficient = Callable[[Mapping[str, Any], tuple[float, ...]], Sequence[float]]
Weighting = Literal["any", "positive"]
InputCheck = Callable[[dict[str, Any], int | None], None]


@dataclass
class LayerResult:
    """A merged delta for one tensor plus the per-layer diagnostics the method computed on the way."""

    delta: torch.Tensor
    diagnostics: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.diagnostics.setdefault("delta_norm", float(torch.linalg.vector_norm(self.delta)))


@dataclass(frozen=True, eq=False)
class Method:
    """A registered merge method: calling it validates the parameters and merges one stack of task vectors."""

    name: str
    fn: Callable[..., LayerResult]
    summary: str
    citation: str
    title: str  # display name, e.g. "TSV-M"
    needs_matrix: bool  # needs 2-D weights (an N x d_out x d_in stack)
    params: tuple[Param, ...]
    context: frozenset[str]  # the reserved context keywords ``fn`` accepts
    factored: bool = False  # exact on the cores of LoRA experts: see :meth:`merge_factored`
    seeded: bool = False  # draws random numbers from (tensor_name, expert_keys)
    featured: bool = True  # shown in the demo, speed and inspect lists (False: reference implementations, ...)
    variant_of: str | None = None  # the method whose implementation this one shares, with declared differences
    settings: tuple[Setting, ...] = ()  # the accuracy benchmark's rows; () = not benchmarked
    fixed: Mapping[str, Any] = field(default_factory=dict)  # keyword arguments always passed, not user-facing
    coefficient: LinearCoefficient | None = None  # (validated params, weights) -> c_i, when the merge is linear
    cost: CostFunction | None = None  # (stack shape, itemsize, validated params) -> Operations of one merge
    weighting: Weighting | None = None  # which per-expert weights ``fn`` takes; None: it takes none
    check: InputCheck | None = None  # (validated params, N or None) -> raises ValueError for what fn cannot take
    spectral: bool = False  # fn is one spectral_merge: it also takes a LayerProjections (see the module docstring)

    @property
    def linear(self) -> bool:
        """Whether the merged delta is sum_i c_i tau_i (the same function of every row and every entry)."""
        return self.coefficient is not None

    @property
    def needs_base(self) -> bool:
        """Whether the method merges whole weights and needs the base tensor W_0 (passed as ``base``)."""
        return "base" in self.context

    def linear_coefficient(
        self, params: Mapping[str, Any], n: int, weights: Sequence[float] | None = None
    ) -> tuple[float, ...] | None:
        """c_i in merged delta = sum_i c_i tau_i for ``n`` experts, these params and per-expert ``weights`` (None:
        none given); None if the method is not linear or n = 0."""
        if self.coefficient is None or n == 0:
            return None
        self.check_weights(weights, n)
        return tuple(self.coefficient(self.validate(params), (1.0,) * n if weights is None else tuple(weights)))

    def check_weights(self, weights: Sequence[float] | None, n: int | None = None) -> None:
        """Refuse per-expert ``weights`` this method does not define (one line); None (no weights) always passes."""
        if weights is None:
            return
        if n is not None and len(weights) != n:
            raise ValueError(f"method '{self.name}': got {len(weights)} weights for {n} experts; give one per expert")
        if self.weighting is None and any(w != 1 for w in weights):
            raise ValueError(
                f"method '{self.name}' does not define per-expert weights (got {list(weights)}): remove them, or "
                f"use a method that takes them ({', '.join(n for n, m in _METHODS.items() if m.weighting)})"
            )
        if not all(math.isfinite(w) and (w > 0 or self.weighting == "any") for w in weights):
            must = "finite" if self.weighting == "any" else "finite and > 0 (it elects signs from weighted deltas)"
            raise ValueError(f"method '{self.name}': expert weights must be {must}, got {list(weights)}")

    def operations(self, shape: tuple[int, ...], itemsize: int, params: Mapping[str, Any]) -> Operations | None:
        """The declared cost of merging a stack of ``shape`` (N x ...) in a compute dtype of ``itemsize`` bytes with
        ``params`` (the cost function gets them validated, with the ``fixed`` arguments); None when none is declared."""
        return None if self.cost is None else self.cost(tuple(shape), itemsize, {**self.validate(params), **self.fixed})

    def param(self, name: str) -> Param:
        found = {p.name: p for p in self.params}
        if name not in found:
            raise ValueError(unknown_name_message(f"parameter of method '{self.name}'", name, list(found)))
        return found[name]

    def validate(self, params: Mapping[str, Any], n: int | None = None) -> dict[str, Any]:
        """Check names and types of ``params`` (strings from a CLI are coerced), and with the declared ``check`` the
        params together and the number of experts ``n`` (if known); return all params with defaults."""
        check_given(self.name, params, self.params)
        try:
            model = self._model.model_validate(dict(params))
        except ValidationError as err:
            raise ValueError(validation_message(self.name, err.errors(), params)) from None
        values = model.model_dump()
        check_validated(self.name, values, n)
        try:
            self.check is None or self.check(values, n)
        except ValueError as err:
            raise ValueError(f"method '{self.name}': {err}") from None
        return values

    def params_schema(self) -> dict[str, Any]:
        """The JSON Schema of this method's ``params`` (types, bounds, defaults, help as descriptions)."""
        return self._model.model_json_schema()

    @functools.cached_property
    def _model(self) -> Any:
        fields = {p.name: (p.annotation, Field(default=p.default, description=p.help)) for p in self.params}
        config = ConfigDict(extra="forbid", strict=False, allow_inf_nan=False)  # see the module docstring
        return create_model(f"{self.name}_params", __config__=config, **fields)

    def __call__(
        self,
        task_vectors: torch.Tensor,
        *,
        dtype: torch.dtype | None = None,
        tensor_name: str = "",
        expert_keys: Sequence[str] | None = None,
        weights: Sequence[float] | None = None,
        base: torch.Tensor | None = None,
        **params: Any,
    ) -> LayerResult:
        """Validate ``params`` and run the method on one stack of task vectors.

        ``dtype`` is the compute dtype (default: float32 for half inputs, else the input's).
        ``tensor_name`` names the tensor in errors; with ``expert_keys`` it seeds a seeded method.
        ``weights``: per-expert weights, for a method that defines them (:meth:`check_weights`).
        ``base``: the base tensor W_0, for a method that needs it (:attr:`needs_base`).
        """
        context: dict[str, Any] = {}
        if self.needs_base:
            if base is None:
                raise ValueError(f"method '{self.name}' merges whole weights: pass the base tensor as base=")
            context["base"] = compute_dtype(base, dtype)
        return self._run(task_vectors, dtype, tensor_name, expert_keys, params, context, weights)

    def merge_cores(
        self,
        cores: torch.Tensor,
        full_shape: tuple[int, int],
        *,
        dtype: torch.dtype | None = None,
        tensor_name: str = "",
        expert_keys: Sequence[str] | None = None,
        weights: Sequence[float] | None = None,
        **params: Any,
    ) -> LayerResult:
        """Run a factored method on the cores T_i (N x p x q) of experts tau_i = P T_i R^T of shape ``full_shape``.

        Returns the core of the merged delta: the dense merge is P @ delta @ R^T (see :meth:`merge_factored`).
        """
        if not self.factored:
            raise ValueError(f"method '{self.name}' cannot merge factored (low-rank) experts; densify them first")
        shape = {"full_shape": full_shape} if "full_shape" in self.context else {}
        return self._run(cores, dtype, tensor_name, expert_keys, params, shape, weights)

    def merge_factored(
        self,
        deltas: Sequence[LoraDelta],
        *,
        dtype: torch.dtype | None = None,
        weights: Sequence[float] | None = None,
        **params: Any,
    ) -> FactoredResult:
        """Merge LoRA experts exactly, without densifying: ``result.dense()`` equals the method on the B_i A_i stack.

        The bases and the small solve run in float64 whatever ``dtype`` (the compute dtype of the result:
        default float32 for half inputs, else the factors'): they are (sum r_i)-sized, so it costs nothing
        and keeps the factored result at least as accurate as the dense one.
        """
        if not self.factored:
            raise ValueError(f"method '{self.name}' cannot merge factored (low-rank) experts; densify them first")
        if not deltas:
            raise ValueError(f"method '{self.name}': no LoRA experts given")
        out_dtype = compute_dtype(deltas[0].B, dtype).dtype
        P, R, cores = factor_cores(deltas, torch.float64)
        result = self.merge_cores(cores, deltas[0].shape, weights=weights, **params)
        diagnostics = {**result.diagnostics, "factored_rank": min(P.shape[1], R.shape[1])}
        return FactoredResult((P @ result.delta).to(out_dtype), R.T.to(out_dtype), diagnostics)

    def __reduce__(self) -> tuple[Callable[[str], Method], tuple[str]]:
        """Pickled (for worker processes) and copied by name: a registered method is one object per process."""
        return lookup, (self.name,)

    def _run(
        self,
        stack: torch.Tensor,
        dtype: torch.dtype | None,
        tensor_name: str,
        expert_keys: Sequence[str] | None,
        params: Mapping[str, Any],
        context: Mapping[str, Any],
        weights: Sequence[float] | None = None,
    ) -> LayerResult:
        """Validate ``params`` and ``weights``, check the stack's shape, add the context, run ``fn`` in the compute
        dtype."""
        values = self.validate(params, stack.shape[0])
        self._check_stack(stack, tensor_name)
        self.check_weights(weights, stack.shape[0])
        if self.seeded:
            values.update(tensor_name=tensor_name, expert_keys=expert_keys)
        if self.weighting is not None:
            values["weights"] = None if weights is None else tuple(float(w) for w in weights)
        return self.fn(compute_dtype(stack, dtype), **values, **context, **self.fixed)

    def _check_stack(self, task_vectors: torch.Tensor, tensor_name: str) -> None:
        if self.needs_matrix and task_vectors.dim() != 3:
            raise ValueError(
                f"method '{self.name}' needs 2-D weights (a stack N x d_out x d_in), "
                f"got a stack of shape {tuple(task_vectors.shape)} for tensor '{tensor_name or '?'}'"
            )


_METHODS: dict[str, Method] = {}


def register(
    name: str,
    *,
    citation: str,
    title: str | None = None,
    needs_matrix: bool = True,
    linear_coefficient: LinearCoefficient | None = None,
    factored: bool = False,
    seeded: bool = False,
    featured: bool = True,
    settings: Sequence[Setting] | None = None,
    fixed: Mapping[str, Any] | None = None,
    cost: CostFunction | None = None,
    weights: Weighting | None = None,
    check: InputCheck | None = None,
    spectral: bool = False,
) -> Callable[[Callable[..., LayerResult]], Method]:
    """Decorator: add a method to the registry and return its :class:`Method` (call that, not the raw function).

    ``title`` defaults to ``name``; ``settings`` to one benchmark row ``Setting(name, title)`` (``()``: none);
    ``fixed`` are keyword arguments of ``fn`` passed as given, not parameters (a variant's declared difference,
    :func:`register_variant`). Capabilities: the module docstring; ``seeded``, ``factored`` agree with fn's keywords.
    """

    def wrap(fn: Callable[..., LayerResult]) -> Method:
        summary, helps = parse_docstring(fn)
        params, context = signature_params(name, fn, dict(fixed or {}), {}, helps)
        method = Method(
            name, fn, summary, citation, title or name, needs_matrix, params, context, factored, seeded, featured,
            None, _settings(settings, name, title or name), dict(fixed or {}), linear_coefficient, cost, weights,
            check, spectral,
        )  # fmt: skip
        return _add(method)

    return wrap


def register_variant(
    name: str,
    of: Method,
    *,
    title: str,
    summary: str,
    fixed: Mapping[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
    citation: str | None = None,
    featured: bool = True,
    settings: Sequence[Setting] | None = None,
    weights: Weighting | None = None,
) -> Method:
    """Register ``name`` as a variant of the method ``of``: the same function, parameters and capabilities, with
    the declared differences only (``fixed`` arguments, parameter ``defaults``, a ``summary``, its ``weights``)."""
    _, helps = parse_docstring(of.fn)
    all_fixed = {**of.fixed, **(fixed or {})}
    params, context = signature_params(name, of.fn, all_fixed, dict(defaults or {}), helps)
    method = Method(
        name, of.fn, summary, citation or of.citation, title, of.needs_matrix, params, context, of.factored,
        of.seeded, featured, of.name, _settings(settings, name, title), all_fixed, of.coefficient, of.cost,
        weights or of.weighting, of.check, of.spectral,
    )  # fmt: skip
    return _add(method)


def _settings(settings: Sequence[Setting] | None, name: str, title: str) -> tuple[Setting, ...]:
    return (Setting(name, title),) if settings is None else tuple(settings)


def _add(method: Method) -> Method:
    """Check the declared capabilities against the signature and the settings against the parameters; store."""
    if method.name in _METHODS:
        raise ValueError(f"method '{method.name}' is registered twice")
    accepts_seed = method.context & SEED_KEYWORDS
    if method.seeded and accepts_seed != SEED_KEYWORDS:
        raise TypeError(f"method '{method.name}' is declared seeded: its function must accept tensor_name, expert_keys")
    if accepts_seed and not method.seeded:
        raise TypeError(f"method '{method.name}' accepts {', '.join(sorted(accepts_seed))}: declare seeded=True")
    if "full_shape" in method.context and not method.factored:
        raise TypeError(f"method '{method.name}' accepts full_shape: declare factored=True if it is exact on cores")
    if ("weights" in method.context) != (method.weighting is not None):
        raise TypeError(f"method '{method.name}': declare weights='any' or 'positive' exactly when fn takes weights")
    if method.needs_base and (method.factored or method.linear):
        raise TypeError(f"method '{method.name}' takes the base tensor: it cannot be factored or linear in the deltas")
    known = {p.name for p in method.params}
    for setting in method.settings:
        unknown = (set(setting.params) | set(setting.grid)) - known
        if unknown:
            raise TypeError(f"method '{method.name}': setting '{setting.label}' sets unknown {sorted(unknown)}")
    _METHODS[method.name] = method
    return method


@contextlib.contextmanager
def registrations() -> Iterator[None]:
    """Methods registered inside this block are forgotten when it ends (for a plugin's tests)."""
    global _METHODS
    saved = _METHODS
    _METHODS = dict(saved)
    try:
        yield
    finally:
        _METHODS = saved


def registered() -> list[Method]:
    """Every registered method, in registration order (``all_methods`` gives display order)."""
    return list(_METHODS.values())


def canonical_name(name: str) -> str:
    """A method name as registered: ``SWUDI-A``, ``swudi-a`` and ``Swudi_A`` are all ``swudi_a`` (lower case, ``-``
    and spaces read as ``_``)."""
    return "_".join(name.strip().lower().replace("-", "_").split())


def lookup(name: str) -> Method:
    """The method called ``name`` (as typed: case, ``-`` and ``_`` do not matter, :func:`canonical_name`); an
    unknown name raises with a did-you-mean hint."""
    method = _METHODS.get(name) or _METHODS.get(canonical_name(name))
    if method is None:
        foreign = METHODS.get(canonical_name(name))
        message = unknown_name_message("method", name, list(_METHODS), compared=canonical_name(name), foreign=foreign)
        raise ValueError(message) from None
    return method
