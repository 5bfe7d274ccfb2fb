"""What ``specmerge inspect`` computes: :class:`InspectOptions`, the one source of every inspect option.

Python callers pass the fields as keyword arguments of ``inspect_model``; the command line's flags and
their help are generated from the fields (their ``description``; a :class:`~specmerge.pipeline.recipe.values.Flag`
where the flag is not ``--field-name``). Everything is validated before any file is read, and every
mistake raises :class:`RecipeError` with one line that names the option and its flag.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from specmerge.diagnostics.method_specs import default_methods, parse_method_spec
from specmerge.errors import RecipeError, unknown_name_message
from specmerge.linalg.quadratic import TauInit
from specmerge.methods import get_method
from specmerge.pipeline.recipe.values import Device, Flag, option_flag


def _method_default(method: str, name: str) -> Any:
    return get_method(method).param(name).default


class InspectOptions(BaseModel):
    """What ``inspect`` computes; validated before any file is read.

    Numbers are finite (``t`` may be +inf, as SWUDI's); every mistake raises :class:`RecipeError` with one line.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    layers: Annotated[str | None, Flag(metavar="REGEX")] = Field(
        default=None,
        description="inspect only the 2-D layers whose name matches this regular expression (searched in the name)",
    )
    methods: Annotated[tuple[str, ...], Flag("--method", "-m", "NAME[:K=V,...]")] = Field(
        default_factory=default_methods,
        description="methods whose merged-delta norm to report, as NAME or NAME:key=value,key=value (repeatable); "
        "by default the featured methods of `specmerge methods`",
    )
    rank_ratio: float = Field(
        default_factory=lambda: _method_default("swudi", "rank_ratio"),
        ge=0,
        le=1,
        description="fixed rank ratio r of the SWUDI cut in the layer statistics, swudi's by default",
    )
    t: float = Field(
        default_factory=lambda: _method_default("swudi", "t"),
        ge=0,
        allow_inf_nan=True,  # inf: no filter
        description="exponential filter time of the filter-shape plot (.inf: no filter), swudi's by default",
    )
    tikhonov_alpha: float = Field(
        default_factory=lambda: _method_default("spectral_filter", "alpha"),
        gt=0,
        description="Tikhonov alpha of the filter-shape plot, spectral_filter's by default",
    )
    tau_init: TauInit = Field(
        default="sum",
        description="start tau_init of the layer statistics' residual projections B = D - tau_init C: the sum "
        "or mean of the task vectors, or zero",
    )
    wudi: bool = Field(
        default=True,
        description="the optimizer-as-filter diagnostic: iterative WUDI on one layer, read as a spectral filter",
    )
    wudi_layer: Annotated[str | None, Flag(metavar="NAME")] = Field(
        default=None,
        description="layer of the optimizer-as-filter and filter-shape plots "
        "(default: the middle one of the most common shape)",
    )
    wudi_steps: int = Field(default=300, ge=1, description="iterative WUDI steps on that layer")
    wudi_init: TauInit = Field(default="sum", description="start of the iterative WUDI run: sum, mean or zero")
    adam_lr: float = Field(default=1e-5, gt=0, description="Adam learning rate of the iterative run (WUDI's)")
    gd_lr: float | None = Field(
        default=None,
        gt=0,
        description="plain gradient descent step (default: 0.25 / lambda_max of that layer; "
        "Landweber eta = 0.5 / lambda_max)",
    )
    representatives: int = Field(
        default=6,
        ge=1,
        description="how many layers' spectra the plots show: the middle-depth layer of each layer type",
    )
    compute_dtype: Literal["float32", "float64"] = Field(default="float32", description="dtype of the dense layers")
    device: Device = Field(default="cpu", description="cpu, cuda, cuda:N or auto (cuda when available)")
    plots: bool = Field(
        default=True, description="the PNG plots (need matplotlib); without them, tables and report.md only"
    )

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise _option_error(err) from None

    @field_validator("layers")
    @classmethod
    def _valid_regex(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as err:
                raise ValueError(f"--layers '{value}' is not a regular expression ({err})") from None
        return value

    @field_validator("methods")
    @classmethod
    def _valid_methods(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        labels = [parse_method_spec(spec).label for spec in value]
        if len(set(labels)) != len(labels):
            raise ValueError(f"a method is listed twice in {list(value)}")
        return value


def _option_error(err: ValidationError) -> RecipeError:
    """One line for the first problem with the inspect options (and a count of the others)."""
    errors = err.errors()
    first = errors[0]
    key = ".".join(str(part) for part in first["loc"][:1])
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    if first["type"] == "extra_forbidden":
        return RecipeError(unknown_name_message("inspect option", key, list(InspectOptions.model_fields)) + more)
    flag = option_flag(InspectOptions, key)
    name = f"inspect option '{key}'" + (f" ({flag})" if flag else "")
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, Exception):
        return RecipeError(f"{name}: {cause}{more}")
    message = first["msg"][:1].lower() + first["msg"][1:]
    return RecipeError(f"{name}: {message} (got {first.get('input')!r}){more}")
