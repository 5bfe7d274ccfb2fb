"""``specmerge inspect``: spectral diagnostics of base + experts, written as a report folder (no merged model).

The inputs are read exactly as ``merge`` reads them (lazy sources, PEFT LoRA adapters, the same plan:
2-D linear weights, embeddings and heads excluded), one layer at a time with the next one prefetched,
so memory holds one layer's stack, never a model. For every layer the normal equation and the
eigendecomposition of C are computed once (:func:`specmerge.methods.spectral.shared_decompositions`) and
reused by the statistics of :mod:`specmerge.diagnostics.statistics` and by every compared method. LoRA layers
take the factored route (the small cores of ``specmerge.linalg.lowrank.factor_cores``: exact, no d_in x d_in
matrix) for the statistics and for the methods that have a factored form; methods without one
(TIES, DARE, iterative WUDI) densify that layer's deltas.

The output folder (written to a temporary folder and renamed into place when complete):

- ``layers.csv`` / ``layers.json``: one row per inspected 2-D layer.
- ``summary.json``: the per-model table (paper App. C), the optimizer-as-filter fits, inputs, options, timings.
- ``optimizer_filter.csv``, ``filters.csv``: the fits per step count, the filters h_k on the WUDI layer.
- ``spectra.png``, ``kept_ranks.png``, ``filter_shapes.png``, ``delta_norms.png``, ``optimizer_filter.png``.
- ``report.md``: the tables and plots together.
"""

from __future__ import annotations

import csv
import difflib
import json
import math
import os
import re
import statistics
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from tqdm.auto import tqdm

from specmerge.diagnostics import statistics as diagnostics
from specmerge.io.layout import CONV1D_LAYOUT, transpose_item
from specmerge.io.sources import TensorSource, open_source
from specmerge.io.writer import atomic_directory
from specmerge.linalg.lowrank import LoraDelta, factor_cores
from specmerge.methods.registry import get_method, unknown_name_message
from specmerge.methods.spectral import (
    TauInit,
    _equation_and_spectrum,
    decompose,
    expert_norms_sq,
    initial_point,
    normal_equation,
    shared_decompositions,
)
from specmerge.pipeline.api import _refuse_duplicate_inputs, _refuse_output_inside_inputs, open_expert, stored_in_out
from specmerge.pipeline.executor import _prefetched, check_finite, resolve_device
from specmerge.pipeline.plan import TensorPlan, make_plan
from specmerge.pipeline.recipe import DEVICE_PATTERN, Recipe, RecipeError
from specmerge.pipeline.threads import check_threads, merge_threads
from specmerge.version import __version__

# The methods whose merged-delta norm is reported by default (the norm-shortcut diagnostic): the
# pseudoinverse D C^+ against the regularised solvers and the linear baselines.
DEFAULT_METHODS = (
    "closed_form",
    "swudi",
    "swudi_a",
    "swudi_a:rule=gavish_donoho",
    "tsv_m",
    "iso_c",
    "task_arithmetic",
    "weight_average",
)
DEFAULT_CHECKPOINTS = (1, 2, 5, 10, 20, 50, 100, 200, 300, 500, 1000, 2000)
PLOTS = {
    "spectra": "spectra.png",
    "kept_ranks": "kept_ranks.png",
    "filter_shapes": "filter_shapes.png",
    "delta_norms": "delta_norms.png",
    "optimizer_filter": "optimizer_filter.png",
}


@dataclass(frozen=True)
class MethodSpec:
    """A method to compare, as ``NAME`` or ``NAME:key=value,key=value`` (values read as YAML scalars)."""

    label: str
    name: str
    params: dict[str, Any]


def parse_method_spec(spec: str) -> MethodSpec:
    """Parse and validate ``NAME[:key=value,...]`` against the method's signature (no I/O)."""
    name, _, rest = spec.partition(":")
    method = get_method(name.strip())
    params: dict[str, Any] = {}
    for pair in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"method '{spec}': expected NAME or NAME:key=value,key=value, got '{pair}'")
        try:
            params[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or "not a YAML value"
            raise RecipeError(f"method '{spec}': value of '{key.strip()}' is not valid YAML ({problem})") from None
    method.validate(params)
    return MethodSpec(spec.strip(), method.name, params)


def _swudi_default(name: str) -> Any:
    return get_method("swudi").param(name).default


class InspectOptions(BaseModel):
    """What ``inspect`` computes; validated before any file is read.

    ``layers`` is a regular expression searched in tensor names; ``wudi_layer`` names the layer of the
    optimizer-as-filter and filter-shape diagnostics (default: the middle one of the most common shape).
    ``gd_lr`` None is 0.25 / lambda_max of that layer (Landweber eta = 0.5 / lambda_max). Numbers are
    finite (``t`` may be +inf, as SWUDI's); every mistake raises :class:`RecipeError` with one line.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    layers: str | None = None
    methods: tuple[str, ...] = DEFAULT_METHODS
    rank_ratio: float = Field(default_factory=lambda: _swudi_default("rank_ratio"), ge=0, le=1)
    t: float = Field(default_factory=lambda: _swudi_default("t"), ge=0, allow_inf_nan=True)  # inf: no filter
    tikhonov_alpha: float = Field(default_factory=lambda: get_method("spectral_filter").param("alpha").default, gt=0)
    tau_init: TauInit = "sum"
    wudi: bool = True
    wudi_layer: str | None = None
    wudi_steps: int = Field(default=300, ge=1)
    wudi_init: TauInit = "sum"
    adam_lr: float = Field(default=1e-5, gt=0)
    gd_lr: float | None = Field(default=None, gt=0)
    representatives: int = Field(default=6, ge=1)
    compute_dtype: Literal["float32", "float64"] = "float32"
    device: str = "cpu"
    plots: bool = True

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise _option_error(err) from None

    @field_validator("device")
    @classmethod
    def _valid_device(cls, value: str) -> str:
        if not DEVICE_PATTERN.match(value):
            raise ValueError(f"device '{value}' is not one of cpu, cuda, cuda:N (N = 0, 1, ...), auto")
        return value

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


# Command-line flags of the options that have one (others are Python-only).
_FLAGS = {"layers": "--layers", "methods": "--method", "rank_ratio": "--rank-ratio", "t": "--t", "wudi": "--no-wudi"}
_FLAGS |= {"wudi_layer": "--wudi-layer", "wudi_steps": "--wudi-steps", "adam_lr": "--adam-lr", "gd_lr": "--gd-lr"}
_FLAGS |= {"compute_dtype": "--compute-dtype", "device": "--device", "plots": "--no-plots"}


def _option_error(err: ValidationError) -> RecipeError:
    """One line for the first problem with the inspect options (and a count of the others)."""
    errors = err.errors()
    first = errors[0]
    key = ".".join(str(part) for part in first["loc"][:1])
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    if first["type"] == "extra_forbidden":
        return RecipeError(unknown_name_message("inspect option", key, list(InspectOptions.model_fields)) + more)
    name = f"inspect option '{key}'" + (f" ({_FLAGS[key]})" if key in _FLAGS else "")
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, Exception):
        return RecipeError(f"{name}: {cause}{more}")
    message = first["msg"][:1].lower() + first["msg"][1:]
    return RecipeError(f"{name}: {message} (got {first.get('input')!r}){more}")


@dataclass
class LayerInput:
    """One layer's task vectors: the dense N x d_out x d_in stack, or LoRA cores with their bases."""

    stack: torch.Tensor
    full_shape: tuple[int, int] | None = None  # set when ``stack`` holds cores tau_i = P T_i R^T
    bases: tuple[torch.Tensor, torch.Tensor] | None = None  # P, R
    deltas: Sequence[LoraDelta] = ()
    _dense: torch.Tensor | None = field(default=None, repr=False)

    @property
    def factored(self) -> bool:
        return self.full_shape is not None

    def dense(self) -> torch.Tensor:
        """The dense stack (formed once from the LoRA factors when the layer is factored)."""
        if self._dense is None:
            self._dense = torch.stack([d.dense() for d in self.deltas]) if self.factored else self.stack
        return self._dense


@dataclass
class InspectState:
    """What the report needs after streaming: scalar rows, a few spectra, the WUDI-layer diagnostics."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    spectra: dict[str, dict[str, Any]] = field(default_factory=dict)
    filters: dict[str, Any] | None = None
    fits: list[diagnostics.FilterFit] = field(default_factory=list)


def inspect_model(
    base: str | os.PathLike,
    experts: Sequence[str | os.PathLike],
    output: str | os.PathLike,
    *,
    overwrite: bool = False,
    progress: bool = True,
    threads: int | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Write the spectral report of ``experts`` (fine-tuned from ``base``) to the new folder ``output``.

    ``options`` are the fields of :class:`InspectOptions`. ``threads`` is torch's thread count while it
    runs (default: chosen from the CPUs free, see :mod:`specmerge.pipeline.threads`). Returns the content of
    ``summary.json``.
    """
    check_threads(threads)
    opts = InspectOptions(**options)
    specs = [parse_method_spec(s) for s in opts.methods]
    if opts.plots:
        _require_matplotlib()
    recipe = Recipe(base=os.path.abspath(base), experts=[os.path.abspath(e) for e in experts])
    output = Path(output)
    _refuse_output_inside_inputs(output, [recipe.base, *recipe.experts])
    device = resolve_device(opts.device)
    dtype = getattr(torch, opts.compute_dtype)
    started = time.perf_counter()
    with ExitStack() as stack:
        threads_used = stack.enter_context(merge_threads(threads))  # torch's count restored on leaving
        base_source = stack.enter_context(open_source(recipe.base))
        expert_sources = [stack.enter_context(open_expert(p, base_source.infos())) for p in recipe.experts]
        _refuse_duplicate_inputs([recipe.base, *recipe.experts], [base_source, *expert_sources])
        _refuse_output_inside_inputs(output, [recipe.base, *recipe.experts], [base_source, *expert_sources])
        layers, skipped = select_layers(recipe, base_source, expert_sources, opts.layers)
        chosen = choose_wudi_layer(layers, opts.wudi_layer)  # checks a given name even with wudi off
        wudi_layer = chosen if opts.wudi else None
        keep = set(representative_layers(layers, opts.representatives)) | {wudi_layer}
        with atomic_directory(output, overwrite=overwrite) as folder:
            state = InspectState()
            work = [(entry, None) for entry in layers]
            bar = tqdm(total=len(layers), unit="layer", disable=not progress, desc="inspecting")
            with bar:
                for entry, _, base_tensor, items in _prefetched(work, base_source, expert_sources):
                    bar.set_postfix_str(entry.name, refresh=False)
                    check_finite(entry, base_tensor, items, base_source, expert_sources)  # before any SVD
                    layer = layer_input(entry, base_tensor, items, device, dtype)
                    base_norm = float(torch.linalg.vector_norm(base_tensor.double()))
                    _inspect_layer(entry, layer, base_norm, specs, recipe.expert_keys, opts, state, entry.name in keep)
                    if entry.name == wudi_layer:
                        _wudi_diagnostics(entry, layer, opts, state)
                    del layer, base_tensor, items
                    bar.update()
            seconds = time.perf_counter() - started
            summary = _summary(recipe, opts, specs, state, skipped, wudi_layer, seconds, device)
            summary.update(threads=threads_used.threads, threads_from=threads_used.source)
            _write_tables(folder, state, specs, recipe.expert_keys, summary)
            if opts.plots:
                write_plots(folder, state, specs, wudi_layer)
            (folder / "report.md").write_text(render_report(summary, state, specs, opts.plots))
    return summary


def select_layers(
    recipe: Recipe, base: TensorSource, experts: Sequence[Any], pattern: str | None
) -> tuple[list[TensorPlan], list[str]]:
    """The 2-D linear layers that ``merge`` would give to a spectral method, filtered by ``pattern``.

    Base tensors that no expert holds (a pooler or ``position_ids`` saved only with the base) are
    skipped and returned by name; every other mismatch (a tensor missing from some experts, another
    shape, a tensor the base lacks) is refused by the merge plan with its message.
    """
    infos = base.infos()
    expert_infos = [e.infos() for e in experts]
    skipped = [name for name in infos if not any(name in e for e in expert_infos)]
    kept = {name: info for name, info in infos.items() if name not in skipped}
    plan = make_plan(recipe, kept, expert_infos, list(recipe.experts), stored_in_out(recipe.base, kept, experts))
    layers = [e for e in plan if e.action == "merge" and (pattern is None or re.search(pattern, e.name))]
    if not layers:
        what = f"matches --layers '{pattern}'" if pattern else "is in the base"
        raise ValueError(f"no 2-D linear weight {what} ({base.describe()}); nothing to inspect")
    return layers, skipped


def choose_wudi_layer(layers: Sequence[TensorPlan], name: str | None) -> str:
    """``name`` if it is an inspected layer, else the middle layer (in model order) of the most common shape."""
    names = [e.name for e in layers]
    if name is not None:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1, cutoff=0)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(f"--wudi-layer '{name}' is not one of the inspected 2-D layers{hint}")
        return name
    shapes = [e.shape for e in layers]
    common = max(dict.fromkeys(shapes), key=shapes.count)
    candidates = [e.name for e in layers if e.shape == common]
    return candidates[len(candidates) // 2]


def representative_layers(layers: Sequence[TensorPlan], count: int) -> list[str]:
    """Up to ``count`` layers for the spectrum plot: the middle-depth layer of each layer type, in model order."""
    by_type: dict[str, list[str]] = {}
    for e in layers:
        by_type.setdefault(diagnostics.layer_type(e.name), []).append(e.name)
    return [names[len(names) // 2] for names in list(by_type.values())[:count]]


def layer_input(
    entry: TensorPlan, base_tensor: torch.Tensor, items: Sequence[Any], device: torch.device, dtype: torch.dtype
) -> LayerInput:
    """The task vectors of one layer: LoRA cores (float64, exact) when every expert is an adapter, else dense.

    A weight stored (in, out) (``entry.transposed``, a Conv1D) is oriented (out, in), as ``merge`` gives it
    to a matrix method.
    """
    if entry.transposed:
        base_tensor, items = base_tensor.T, [transpose_item(item) for item in items]
    shape = tuple(base_tensor.shape)
    if all(item is None or isinstance(item, LoraDelta) for item in items):
        deltas = [
            LoraDelta.zero(shape, torch.float64, device) if item is None else item.to(device, torch.float64)
            for item in items
        ]
        if any(d.rank for d in deltas):
            P, R, cores = factor_cores(deltas, torch.float64)
            return LayerInput(cores, shape, (P, R), deltas)
    base_c = base_tensor.to(device=device, dtype=dtype)
    stack = torch.empty((len(items), *shape), dtype=dtype, device=device)
    for row, item in zip(stack, items, strict=True):
        if isinstance(item, torch.Tensor):
            row.copy_(item).sub_(base_c)
        elif item is None:
            row.zero_()
        else:  # a LoRA adapter among full checkpoints: densified
            row.copy_(item.to(device, dtype).dense())
    return LayerInput(stack)


def _inspect_layer(
    entry: TensorPlan,
    layer: LayerInput,
    base_norm: float,
    specs: Sequence[MethodSpec],
    expert_keys: Sequence[str],
    opts: InspectOptions,
    state: InspectState,
    keep_spectrum: bool,
) -> None:
    start = time.perf_counter()
    d_out, d_in = entry.shape[::-1] if entry.transposed else entry.shape  # as layer_input oriented it
    row: dict[str, Any] = {
        "name": entry.name,
        "type": diagnostics.layer_type(entry.name),
        "depth": diagnostics.layer_depth(entry.name),
        "d_out": d_out,
        "d_in": d_in,
        "N": layer.stack.shape[0],
        "route": "factored" if layer.factored else "dense",
        "layout": CONV1D_LAYOUT if entry.transposed else "linear (out, in)",
    }
    with shared_decompositions():
        eq, spectrum = _equation_and_spectrum(layer.stack, layer.full_shape)
        norms = expert_norms_sq(layer.stack).sqrt()
        if spectrum is None:
            row.update(n_nonzero=0, rel_norms=[0.0] * len(norms))
        else:
            start_point = initial_point(layer.stack, opts.tau_init)
            stats = diagnostics.layer_statistics(
                eq, spectrum, start_point, expert_norms=norms, base_norm=base_norm, rank_ratio=opts.rank_ratio
            )
            row.update(stats)
            if keep_spectrum:
                state.spectra[entry.name] = {
                    "eigenvalues": diagnostics.full_spectrum(spectrum.eigenvalues, d_in),
                    **{f"K_{rule}": stats[f"K_{rule}"] for rule in diagnostics.RULES},
                }
        for spec in specs:
            row[f"norm[{spec.label}]"] = method_delta_norm(spec, layer, entry.name, expert_keys)
    row["seconds"] = time.perf_counter() - start
    state.rows.append(row)


def method_delta_norm(spec: MethodSpec, layer: LayerInput, name: str, expert_keys: Sequence[str]) -> float:
    """||merged delta||_F of one method on one layer (on the cores when the method merges them exactly)."""
    method = get_method(spec.name)
    if layer.factored and method.factored:
        result = method(
            layer.stack, full_shape=layer.full_shape, tensor_name=name, expert_keys=expert_keys, **spec.params
        )
    else:
        result = method(layer.dense(), tensor_name=name, expert_keys=expert_keys, **spec.params)
    return float(result.diagnostics["delta_norm"])


def filter_problem(layer: LayerInput, tau_init: TauInit) -> diagnostics.FilterProblem:
    """The optimizer-as-filter problem of one layer, in float64 (factored for LoRA cores)."""
    if layer.factored:
        P, R = layer.bases
        eq = normal_equation(layer.stack.double())
        spectrum = decompose(eq, layer.full_shape)
        return diagnostics.factored_problem(P, R, eq, spectrum, initial_point(layer.stack.double(), tau_init))
    stack = layer.dense().double()
    eq = normal_equation(stack)
    return diagnostics.dense_problem(eq, decompose(eq), initial_point(stack, tau_init))


def _wudi_diagnostics(entry: TensorPlan, layer: LayerInput, opts: InspectOptions, state: InspectState) -> None:
    """Filter shapes and the Adam / plain-GD empirical filters with their fits, on the chosen layer."""
    row = state.rows[-1]
    if row.get("n_nonzero", 0) == 0:
        return
    spectrum = state.spectra[entry.name]
    state.filters = {
        "layer": entry.name,
        "eigenvalues": spectrum["eigenvalues"],
        "gains": diagnostics.filter_family(
            spectrum["eigenvalues"],
            t=opts.t,
            rank_ratio=opts.rank_ratio,
            alpha=opts.tikhonov_alpha,
            adaptive_rank=spectrum["K_psqrt"],
        ),
    }
    problem = filter_problem(layer, opts.wudi_init)
    gd_lr = opts.gd_lr if opts.gd_lr is not None else 0.25 / float(problem.eigenvalues[0])
    checkpoints = [s for s in DEFAULT_CHECKPOINTS if s < opts.wudi_steps] + [opts.wudi_steps]
    for optimizer, lr in (("adam", opts.adam_lr), ("sgd", gd_lr)):
        state.fits += diagnostics.optimizer_filter_trace(problem, optimizer=optimizer, lr=lr, checkpoints=checkpoints)
    state.filters["fit_eigenvalues"] = problem.eigenvalues[diagnostics.fit_directions(problem)].cpu()


# ---------------------------------------------------------------------------------------------
# Tables


def _summary(recipe, opts, specs, state, skipped, wudi_layer, seconds, device) -> dict[str, Any]:
    norms = {
        spec.label: math.sqrt(sum(r[f"norm[{spec.label}]"] ** 2 for r in state.rows)) for spec in specs
    }  # whole-model ||delta||_F over the inspected layers
    return {
        "specmerge": __version__,
        "base": recipe.base,
        "experts": dict(zip(recipe.expert_keys, recipe.experts, strict=True)),
        "options": opts.model_dump(),
        "device": str(device),
        "seconds": round(seconds, 3),
        "layers_inspected": len(state.rows),
        "routes": {route: sum(r["route"] == route for r in state.rows) for route in ("dense", "factored")},
        "skipped_not_in_experts": skipped,
        "summary": diagnostics.summarize_layers(state.rows),
        "model_delta_norms": norms,
        "wudi_layer": wudi_layer,
        "optimizer_filter": [fit.row() for fit in state.fits],
    }


def _csv_value(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def _json_safe(value: Any) -> Any:
    """Non-finite floats as strings ('inf', 'nan'): strict JSON has no Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def flat_row(row: dict[str, Any], expert_keys: Sequence[str]) -> dict[str, Any]:
    """A layer row with the per-expert relative norms as columns ``rel_norm[<expert>]``."""
    flat = {k: v for k, v in row.items() if k != "rel_norms"}
    for key, value in zip(expert_keys, row.get("rel_norms", []), strict=False):
        flat[f"rel_norm[{key}]"] = value
    return flat


def _write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(v) for k, v in row.items()})


def _write_tables(folder: Path, state: InspectState, specs, expert_keys, summary: dict[str, Any]) -> None:
    _write_csv(folder / "layers.csv", [flat_row(r, expert_keys) for r in state.rows])
    (folder / "layers.json").write_text(json.dumps(_json_safe(state.rows), indent=1))
    (folder / "summary.json").write_text(json.dumps(_json_safe(summary), indent=1))
    if state.fits:
        _write_csv(folder / "optimizer_filter.csv", [fit.row() for fit in state.fits])
    if state.filters is not None:
        lam = state.filters["eigenvalues"]
        rows = [
            {"k": k + 1, "lambda": float(lam[k]), **{n: float(g[k]) for n, g in state.filters["gains"].items()}}
            for k in range(lam.numel())
        ]
        _write_csv(folder / "filters.csv", rows)


# ---------------------------------------------------------------------------------------------
# Plots


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            "inspect draws its plots with matplotlib: pip install matplotlib (or pass --no-plots)"
        ) from None


def write_plots(folder: Path, state: InspectState, specs: Sequence[MethodSpec], wudi_layer: str | None) -> None:
    """Draw every plot of the report into ``folder`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    _plot_spectra(folder / PLOTS["spectra"], state)
    _plot_kept_ranks(folder / PLOTS["kept_ranks"], state.rows)
    _plot_delta_norms(folder / PLOTS["delta_norms"], state.rows, specs)
    if state.filters is not None:
        _plot_filter_shapes(folder / PLOTS["filter_shapes"], state.filters)
    if state.fits:
        _plot_optimizer_filter(folder / PLOTS["optimizer_filter"], state.fits, state.filters, wudi_layer)


RULE_LABELS = {
    "fixed": "fixed ratio r (SWUDI)",
    "psqrt": "psqrt (SWUDI-A)",
    "gavish_donoho": "Gavish-Donoho",
    "participation": "eigenvalue participation",
}


def _short(name: str, width: int = 48) -> str:
    name = name.removesuffix(".weight")
    return name if len(name) <= width else "..." + name[-(width - 3) :]


def _layered(count: int) -> list[float]:
    """Line widths from thick to thin, so that curves which coincide (e.g. every cut beyond the rank) stay visible."""
    return [1.2 + 2.4 * (count - 1 - i) / max(count - 1, 1) for i in range(count)]


def _plain_log_ticks(axis: Any, decades: float = 1.0) -> None:
    """Log-axis ticks written as plain numbers: at 1, 2, 5 x 10^k over up to 2 decades, else at powers of 10."""
    from matplotlib import ticker

    subs = (1.0, 2.0, 5.0) if decades <= 2 else (1.0,)
    axis.set_major_locator(ticker.LogLocator(base=10, subs=subs, numticks=30))
    axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(ticker.NullFormatter())


def _plot_spectra(path: Path, state: InspectState) -> None:
    import matplotlib.pyplot as plt

    names = [n for n in state.spectra if any(r["name"] == n for r in state.rows)]
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.9 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        s = state.spectra[name]
        lam = s["eigenvalues"]
        positive = lam[lam > 0]
        k = torch.arange(1, positive.numel() + 1)
        ax.semilogy(k, positive / positive[0], color="black", lw=1.4, label=r"$\lambda_k/\lambda_{max}$")
        for rule, style, color in (("psqrt", "--", "tab:blue"), ("gavish_donoho", ":", "tab:red")):
            K = s[f"K_{rule}"]
            ax.axvline(K, ls=style, color=color, lw=1.6, label=f"{RULE_LABELS[rule]}: K={K}")
        ax.set_title(f"{_short(name)}\n(d_in={lam.numel()}, {positive.numel()} non-zero)", fontsize=9)
        ax.set_xlabel("eigen-direction k (descending)")
        ax.set_ylabel(r"$\lambda_k / \lambda_{max}$ of C")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.suptitle("Eigen-spectra of C for representative layers, with the rank rules' cuts", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_kept_ranks(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    import matplotlib.pyplot as plt

    live = [r for r in rows if r.get("n_nonzero", 0) > 0]
    types = list(dict.fromkeys(r["type"] for r in live))
    width = 0.8 / len(diagnostics.RULES)
    fig, ax = plt.subplots(figsize=(max(6.5, 1.3 * len(types) + 2.5) + 3, 4.6))
    smallest = 1.0
    for j, rule in enumerate(diagnostics.RULES):
        means = [_mean_of(live, t, f"K_{rule}_ratio") for t in types]
        smallest = min([smallest, *(m for m in means if m > 0)])
        x = [i + (j - (len(diagnostics.RULES) - 1) / 2) * width for i in range(len(types))]
        ax.bar(x, means, width, label=RULE_LABELS[rule])
    ranks = [statistics.mean(r["numerical_rank"] / r["d_in"] for r in live if r["type"] == t) for t in types]
    ax.hlines(ranks, [i - 0.45 for i in range(len(types))], [i + 0.45 for i in range(len(types))], color="black",
              lw=2, label="numerical rank of C / d_in")  # fmt: skip
    ax.set_xticks(range(len(types)))
    ax.set_xticklabels(types, rotation=25, ha="right", fontsize=9)
    ax.set_ylabel(r"mean kept-rank ratio $K / d_{in}$" + (" (log)" if smallest < 0.05 else ""))
    ax.set_xlabel("layer type")
    if smallest < 0.05:  # low-rank experts: the adaptive cuts are a few % of d_in, invisible on a linear axis
        ax.set_yscale("log")
        ax.set_ylim(smallest / 2, 2.0)
    else:
        ax.set_ylim(0, 1.12)
    ax.set_title("Kept rank by layer type and rank rule (mean over layers of the type)")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mean_of(rows: Sequence[dict[str, Any]], layer_type: str, key: str) -> float:
    values = [r[key] for r in rows if r["type"] == layer_type]
    return sum(values) / len(values)


def _plot_delta_norms(path: Path, rows: Sequence[dict[str, Any]], specs: Sequence[MethodSpec]) -> None:
    import matplotlib.pyplot as plt

    fig, (ax, bar_ax) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [2.2, 1]})
    x = range(1, len(rows) + 1)
    markers = "osD^vx*+"
    for i, (spec, lw) in enumerate(zip(specs, _layered(len(specs)), strict=True)):
        values = [max(r[f"norm[{spec.label}]"], 1e-30) for r in rows]
        ax.semilogy(x, values, marker=markers[i % len(markers)], ms=3.5, lw=lw, alpha=0.85, label=spec.label)
    norms = [r[f"norm[{spec.label}]"] for r in rows for spec in specs if r[f"norm[{spec.label}]"] > 0]
    _plain_log_ticks(ax.yaxis, math.log10(max(norms) / min(norms)) if norms else 1.0)
    ax.set_xlabel("layer (model order)")
    ax.set_ylabel(r"$\|\hat\tau\|_F$ of the merged delta")
    ax.set_title("Merged-delta norm per layer")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncols=3, frameon=False)
    totals = [math.sqrt(sum(r[f"norm[{spec.label}]"] ** 2 for r in rows)) for spec in specs]
    colors = [f"C{i}" for i in range(len(specs))]
    bar_ax.barh(range(len(specs)), totals, color=colors)
    bar_ax.set_yticks(range(len(specs)))
    bar_ax.set_yticklabels([s.label for s in specs], fontsize=8)
    bar_ax.invert_yaxis()
    spread = max(totals) / max(min(totals), 1e-30)
    if spread > 30:  # a norm shortcut of orders of magnitude: log scale, else linear stays readable
        bar_ax.set_xscale("log")
    bar_ax.set_xlim(right=max(totals) * (4 if spread > 30 else 1.25))
    bar_ax.set_xlabel(r"$\|\hat\tau\|_F$ over all inspected layers" + (" (log)" if spread > 30 else ""))
    bar_ax.set_title("Whole-model merged-delta norm")
    for i, v in enumerate(totals):
        bar_ax.text(v, i, f" {v:.3g}", va="center", fontsize=8)
    bar_ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_filter_shapes(path: Path, filters: dict[str, Any]) -> None:
    import matplotlib.pyplot as plt

    lam = filters["eigenvalues"]
    positive = lam > 0
    k = torch.arange(1, lam.numel() + 1)[positive]
    fig, (ax, gain_ax) = plt.subplots(1, 2, figsize=(12, 4.4))
    styles = ["-", "--", "-.", ":", "-"]
    gains = filters["gains"]
    for (name, h), style, lw in zip(gains.items(), styles, _layered(len(gains)), strict=False):
        ax.plot(k, h[positive], ls=style, lw=lw, alpha=0.85, label=name)
        inverse = (h[positive] / lam[positive]).clamp(min=1e-30)
        gain_ax.semilogy(k, inverse, ls=style, lw=lw, alpha=0.85, label=name)
    ax.set_xlabel("eigen-direction k (descending eigenvalue)")
    ax.set_ylabel(r"filter $h_k$")
    ax.set_ylim(-0.03, 1.05)
    ax.set_title("Filter shapes")
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(True, alpha=0.3)
    gain_ax.set_xlabel("eigen-direction k (descending eigenvalue)")
    gain_ax.set_ylabel(r"inverse gain $h_k / \lambda_k$ (log)")
    inverse_gains = 1 / lam[positive]
    gain_ax.set_ylim(float(inverse_gains.min()) / 10, float(inverse_gains.max()) * 3)
    gain_ax.set_title("Effective inverse gain (0 = direction dropped)")
    gain_ax.grid(True, which="major", alpha=0.3)
    rank = int(positive.sum())
    shown = f" ({rank} non-zero of d_in = {lam.numel()} directions shown)" if rank < lam.numel() else ""
    fig.suptitle(f"Spectral filters on {_short(filters['layer'], 70)}{shown}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_optimizer_filter(
    path: Path, fits: Sequence[diagnostics.FilterFit], filters: dict[str, Any] | None, layer: str | None
) -> None:
    import matplotlib.pyplot as plt

    from specmerge.linalg.filters import Exponential, Landweber

    lam = filters["fit_eigenvalues"].double()
    grid = torch.logspace(math.log10(float(lam.min())), math.log10(float(lam.max())), 200, dtype=torch.float64)
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.6))
    for ax, optimizer, title in ((axes[0], "adam", "Adam"), (axes[1], "sgd", "plain gradient descent")):
        own = [f for f in fits if f.optimizer == optimizer]
        shown = own if len(own) <= 4 else [own[i] for i in _spread(len(own), 4)]
        for i, fit in enumerate(shown):
            if optimizer == "adam":
                curve = Exponential(fit.t_eff)(grid)
                text = f"exponential t={fit.t_eff:.3g}, R²={fit.r2_exponential:.4f}, RMSE={fit.rmse_exponential:.1e}"
            else:
                curve = Landweber(2 * fit.lr, fit.n_eff)(grid)
                text = f"Landweber n={fit.n_eff:.4g}, R²={fit.r2_landweber:.6f}, RMSE={fit.rmse_landweber:.1e}"
            if math.isnan(fit.r2_exponential):
                error = fit.rmse_exponential if optimizer == "adam" else fit.rmse_landweber
                text = f"saturated (h = 1 everywhere, no R²), RMSE={error:.1e}"
            ax.scatter(lam, fit.h, s=9, color=f"C{i}", alpha=0.55)
            ax.plot(grid, curve, color=f"C{i}", lw=1.4, label=f"step {fit.step}: {text}")
        ax.set_xscale("log")
        _plain_log_ticks(ax.xaxis, math.log10(float(lam.max() / lam.min())))
        ax.set_xlabel(r"eigenvalue $\lambda_k$ of C (log)")
        ax.set_ylabel(r"empirical filter $h_k$ (dots) and fit (lines)")
        ax.set_title(f"{title}, lr {own[0].lr:.3g}")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=1, frameon=False)
    ax = axes[2]
    for optimizer, marker, name in (("adam", "o", "Adam"), ("sgd", "s", "GD")):
        own = [f for f in fits if f.optimizer == optimizer]
        steps = [f.step for f in own]
        ax.plot(steps, [f.r2_exponential for f in own], marker=marker, ls="-", label=f"{name}: exponential fit")
        ax.plot(steps, [f.r2_landweber for f in own], marker=marker, ms=4, ls="--", label=f"{name}: Landweber fit")
    ax.set_xscale("log")
    ax.set_xlabel("optimizer steps (log)")
    ax.set_ylabel(r"$R^2$ of the best fit")
    values = [v for f in fits for v in (f.r2_exponential, f.r2_landweber) if math.isfinite(v)]
    clipped = min([*values, 0.9]) < -1.0
    ax.set_ylim(max(min([*values, 0.9]), -1.0) - 0.02, 1.01)
    if clipped:
        ax.set_ylabel(r"$R^2$ of the best fit (axis clipped at -1)")
    ax.set_title(r"Fit quality $R^2$ vs steps")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=2, frameon=False)
    fig.suptitle(f"Optimizer as a spectral filter (iterative WUDI) on {_short(layer or '', 70)}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _spread(n: int, k: int) -> list[int]:
    """k indices spread evenly over range(n), first and last included."""
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


# ---------------------------------------------------------------------------------------------
# report.md

SUMMARY_ROWS = (
    ("# linear layers", "n_layers", "d"),
    ("‖tau_i‖_F / ‖W_0‖_F (mean over i, layers)", "mean_update_magnitude", ".4f"),
    ("Effective-rank ratio r_eff / d_in (mean)", "effective_rank_ratio", ".3f"),
    ("lambda_max / lambda_med (median)", "median_max_over_median", ".3g"),
    ("lambda_90 / lambda_max (median)", "median_l90_over_max", ".2e"),
    ("Layer-wise CV of lambda_max", "cv_lambda_max", ".3f"),
    ("SWUDI-A psqrt mean K / d_in", "psqrt_mean_K_ratio", ".3f"),
)


def fmt(value: Any, spec: str) -> str:
    """A number for a Markdown table ('-' for None)."""
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


def summary_table(summary: dict[str, Any]) -> list[str]:
    """The per-architecture table (paper App. C) as Markdown lines."""
    s = summary["summary"]
    lines = ["| Statistic | Value |", "|---|---|"]
    lines += [f"| {label} | {fmt(s[key], spec)} |" for label, key, spec in SUMMARY_ROWS]
    lines.append(f"| SWUDI-A psqrt min/median/max K | {s['psqrt_K_min']}/{s['psqrt_K_median']:g}/{s['psqrt_K_max']} |")
    lines.append(
        f"| (not in the paper) lambda_max / smallest non-zero lambda (median) | "
        f"{fmt(s['median_condition_on_range'], '.3g')} |"
    )
    return lines


def render_report(summary: dict[str, Any], state: InspectState, specs: Sequence[MethodSpec], plots: bool) -> str:
    """report.md: inputs, the summary table, rank rules, optimizer fits, plots, per-layer table."""
    s, opts = summary["summary"], summary["options"]
    lines = [
        "# specmerge inspect report",
        "",
        f"Base: `{summary['base']}`  ",
        f"Experts ({len(summary['experts'])}): " + ", ".join(f"`{k}`" for k in summary["experts"]) + "  ",
        f"{summary['layers_inspected']} 2-D linear layers ({summary['routes']['dense']} dense, "
        f"{summary['routes']['factored']} LoRA factored) in {summary['seconds']:.1f} s on {summary['device']}, "
        f"specmerge {summary['specmerge']}.",
        "",
    ]
    if summary["skipped_not_in_experts"]:
        lines += [f"Base tensors no expert holds (skipped): {', '.join(summary['skipped_not_in_experts'])}.", ""]
    lines += ["## Summary (as the paper's per-architecture table, App. C)", "", *summary_table(summary), ""]
    lines += [
        "r_eff is the eigenvalue participation ratio (sum lambda)^2 / sum lambda^2; all d_in eigenvalues of C count "
        "(structural zeros included); eigenvalues below the solver's tolerance are exact zeros.",
        "",
        "## Rank rules",
        "",
        f"Kept rank K and the share of the WUDI proxy reduction (pseudoinverse = 1) kept by the cut, from tau_init = "
        f"{opts['tau_init']}; fixed ratio r = {opts['rank_ratio']:g}.",
        "",
        "| Rule | mean K / d_in | median share of proxy reduction |",
        "|---|---|---|",
    ]
    lines += [
        f"| {RULE_LABELS[r]} | {fmt(s[f'{r}_mean_K_ratio'], '.3f')} | {fmt(s[f'{r}_median_share'], '.4f')} |"
        for r in diagnostics.RULES
    ]
    lines += ["", "## Merged-delta norms (norm-shortcut diagnostic)", "", "| Method | whole-model norm |", "|---|---|"]
    lines += [f"| {label} | {fmt(v, '.4g')} |" for label, v in summary["model_delta_norms"].items()]
    lines += ["", *_optimizer_section(summary), ""]
    if plots:
        lines += ["## Plots", ""]
        for key, title in (
            ("spectra", "Eigen-spectra with the psqrt and Gavish-Donoho cuts"),
            ("kept_ranks", "Kept-rank ratio by layer type"),
            ("filter_shapes", "Filter shapes on the WUDI layer"),
            ("delta_norms", "Merged-delta norm per method"),
            ("optimizer_filter", "Optimizer as filter"),
        ):
            lines += [f"### {title}", "", f"![{title}]({PLOTS[key]})", ""]
    lines += ["## Per layer", "", *_layer_table(state.rows, specs)]
    return "\n".join(lines) + "\n"


def _optimizer_section(summary: dict[str, Any]) -> list[str]:
    fits = summary["optimizer_filter"]
    if not fits:
        return []
    opts = summary["options"]
    lines = [
        "## Optimizer as filter (iterative WUDI)",
        "",
        f"Layer `{summary['wudi_layer']}`, start tau_init = {opts['wudi_init']}, float64. Empirical filter "
        "h_k = lambda_k <(tau_n - tau_init) q_k, B q_k> / ||B q_k||^2; Landweber fitted with eta = 2 lr "
        "(a step of size lr on the WUDI loss), exponential with free t.",
        "",
        "R2 is nan once the filter is flat (saturated at 1: no spread left to explain); the RMSE still applies.",
        "",
        "| Optimizer | lr | step | t_eff | R2 exponential | RMSE exp. | n_eff | R2 Landweber | RMSE Landweber |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {f['optimizer']} | {f['lr']:.3g} | {f['step']} | {fmt(f['t_eff'], '.4g')} | "
        f"{fmt(f['r2_exponential'], '.6f')} | {fmt(f['rmse_exponential'], '.2e')} | {fmt(f['n_eff'], '.5g')} | "
        f"{fmt(f['r2_landweber'], '.6f')} | {fmt(f['rmse_landweber'], '.2e')} |"
        for f in fits
    ]
    return lines


def _layer_table(rows: Sequence[dict[str, Any]], specs: Sequence[MethodSpec], limit: int = 200) -> list[str]:
    head = ["layer", "d_out x d_in", "mean rel. norm", "r_eff/d_in", "lmax/lmed", "l90/lmax", "K psqrt", "K GD"]
    head += [f"norm {s.label}" for s in specs[:4]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows[:limit]:
        if r.get("n_nonzero", 0) == 0:
            lines.append(f"| {r['name']} | {r['d_out']}x{r['d_in']} | 0 (no expert changes it) |" + " |" * 9)
            continue
        rel = [v for v in r["rel_norms"] if v > 0]
        cells = [
            r["name"],
            f"{r['d_out']}x{r['d_in']}",
            fmt(sum(rel) / len(rel), ".4f"),
            fmt(r["r_eff_participation"] / r["d_in"], ".3f"),
            fmt(r["max_over_median"], ".3g"),
            fmt(r["l90_over_max"], ".2e"),
            str(r["K_psqrt"]),
            str(r["K_gavish_donoho"]),
        ]
        cells += [fmt(r[f"norm[{s.label}]"], ".4g") for s in specs[:4]]
        lines.append("| " + " | ".join(cells) + " |")
    if len(rows) > limit:
        lines.append(f"\n{len(rows) - limit} more layers in layers.csv.")
    return lines
