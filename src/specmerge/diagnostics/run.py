"""``specmerge inspect``: spectral diagnostics of base + experts, written as a report folder (no merged model).

The inputs are read exactly as ``merge`` reads them (lazy sources, PEFT LoRA adapters, the same plan:
2-D linear weights, embeddings and heads excluded), one layer at a time with the next one prefetched,
so memory holds one layer's stack, never a model. For every layer the normal equation and the
eigendecomposition of C are computed once (:func:`specmerge.linalg.solve.shared_decompositions`) and
reused by the statistics of :mod:`specmerge.diagnostics.statistics` and by every compared method. LoRA layers
take the factored route (the small cores of ``specmerge.linalg.lowrank.factor_cores``: exact, no d_in x d_in
matrix) for the statistics and for the methods that have a factored form; methods without one
(TIES, DARE, iterative WUDI) densify that layer's deltas. On the layer chosen for it, the optimizer-as-filter
diagnostic (:mod:`specmerge.diagnostics.optimizer_filter`) runs iterative WUDI and fits its filter.

The output folder is written to a temporary folder and renamed into place when complete: the tables and
``report.md`` by :mod:`specmerge.diagnostics.tables`, the PNG figures by :mod:`specmerge.diagnostics.plots`.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from specmerge.diagnostics.method_specs import MethodSpec, parse_method_spec
from specmerge.diagnostics.optimizer_filter import (
    FilterProblem,
    dense_problem,
    factored_problem,
    fit_directions,
    optimizer_filter_trace,
)
from specmerge.diagnostics.options import InspectOptions
from specmerge.diagnostics.plots import require_matplotlib, write_plots
from specmerge.diagnostics.statistics import (
    RULES,
    filter_family,
    full_spectrum,
    layer_depth,
    layer_statistics,
    layer_type,
)
from specmerge.diagnostics.tables import InspectState, render_report, summarize, write_tables
from specmerge.errors import RecipeError, SpecmergeError, closest_name
from specmerge.io.formats.layout import CONV1D_LAYOUT, transposed_weights
from specmerge.io.formats.protocol import TensorSource
from specmerge.io.hub.ids import absolute_spec
from specmerge.io.output.folder import atomic_directory
from specmerge.io.views.experts import Expert
from specmerge.io.views.task_vectors import TaskVector, low_rank_deltas, task_vector_stack
from specmerge.linalg.lowrank import factor_cores
from specmerge.linalg.quadratic import TauInit, expert_norms_sq, initial_point, normal_equation
from specmerge.linalg.solve import equation_and_spectrum, shared_decompositions
from specmerge.linalg.spectrum import decompose
from specmerge.methods import get_method
from specmerge.pipeline.inputs.open import open_inputs, refuse_output_inside_inputs
from specmerge.pipeline.plan.rules import TensorPlan, make_plan
from specmerge.pipeline.recipe.model import Recipe
from specmerge.pipeline.run.compute import resolve_device
from specmerge.pipeline.run.executor import prefetched
from specmerge.pipeline.run.finite import check_finite
from specmerge.pipeline.run.threads import check_threads, merge_threads
from specmerge.pipeline.run.work import WorkItem, read_inputs

# Step counts at which the optimizer-as-filter diagnostic measures and fits the filter (plus the last step).
DEFAULT_CHECKPOINTS = (1, 2, 5, 10, 20, 50, 100, 200, 300, 500, 1000, 2000)


@dataclass
class LayerInput:
    """One layer's task vectors: the dense N x d_out x d_in stack, or LoRA cores with their bases.

    A factored layer (every expert a LoRA adapter or unchanged) holds the cores T_i of tau_i = P T_i R^T in
    ``stack`` (float64, exact), ``full_shape`` (d_out, d_in) and the bases (P, R); ``values`` keep the
    experts' low-rank deltas for :meth:`dense`, formed only when a method without a factored form asks.
    """

    stack: torch.Tensor
    full_shape: tuple[int, int] | None = None  # set when ``stack`` holds cores tau_i = P T_i R^T
    bases: tuple[torch.Tensor, torch.Tensor] | None = None  # P, R
    values: Sequence[TaskVector] = ()
    _dense: torch.Tensor | None = field(default=None, repr=False)

    @property
    def factored(self) -> bool:
        return self.full_shape is not None

    def dense(self) -> torch.Tensor:
        """The dense stack (formed once, in float64, from the LoRA factors when the layer is factored)."""
        if self._dense is None:
            self._dense = self.stack
            if self.factored:
                dtype, device = self.stack.dtype, self.stack.device
                self._dense = task_vector_stack(self.values, None, dtype=dtype, device=device, shape=self.full_shape)
        return self._dense


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
    runs (default: chosen from the CPUs free, see :mod:`specmerge.pipeline.run.threads`). Returns the content of
    ``summary.json``.
    """
    check_threads(threads)
    opts = InspectOptions(**options)
    specs = [parse_method_spec(s, len(experts)) for s in opts.methods]
    if opts.plots:
        require_matplotlib()
    recipe = Recipe(base=absolute_spec(os.fspath(base)), experts=[absolute_spec(os.fspath(e)) for e in experts])
    output = Path(output)
    refuse_output_inside_inputs(output, [recipe.base, *recipe.experts])  # before opening anything
    device = resolve_device(opts.device)
    dtype = getattr(torch, opts.compute_dtype)
    started = time.perf_counter()
    with ExitStack() as stack:
        threads_used = stack.enter_context(merge_threads(threads))  # torch's count restored on leaving
        base_source, expert_sources = open_inputs(stack, recipe.base, recipe.experts, output)
        layers, skipped = select_layers(recipe, base_source, expert_sources, opts.layers)
        chosen = choose_wudi_layer(layers, opts.wudi_layer)  # checks a given name even with wudi off
        wudi_layer = chosen if opts.wudi else None
        keep = set(representative_layers(layers, opts.representatives)) | {wudi_layer}
        with atomic_directory(output, overwrite=overwrite) as folder:
            state = InspectState()
            work = [WorkItem(entry) for entry in layers]
            bar = tqdm(total=len(layers), unit="layer", disable=not progress, desc="inspecting")
            with bar:
                for item, inputs in prefetched(work, lambda item: read_inputs(item, base_source, expert_sources)):
                    entry, base_tensor = item.entry, inputs.base
                    bar.set_postfix_str(entry.name, refresh=False)
                    check_finite(entry, base_tensor, inputs.values, base_source, expert_sources)  # before any SVD
                    layer = layer_input(entry, base_tensor, inputs.values, device, dtype)
                    base_norm = float(torch.linalg.vector_norm(base_tensor.double()))
                    inspect_layer(entry, layer, base_norm, specs, recipe.expert_keys, opts, state, entry.name in keep)
                    if entry.name == wudi_layer:
                        wudi_diagnostics(entry, layer, opts, state)
                    del layer, base_tensor, inputs
                    bar.update()
            seconds = time.perf_counter() - started
            summary = summarize(recipe, opts, specs, state, skipped, wudi_layer, seconds, device)
            summary.update(threads=threads_used.threads, threads_from=threads_used.source)
            write_tables(folder, state, recipe.expert_keys, summary)
            if opts.plots:
                write_plots(folder, state, specs, wudi_layer)
            (folder / "report.md").write_text(render_report(summary, state, specs, opts.plots))
    return summary


def select_layers(
    recipe: Recipe, base: TensorSource, experts: Sequence[Expert], pattern: str | None
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
    plan = make_plan(recipe, kept, expert_infos, list(recipe.experts), transposed_weights(base.path, kept, experts))
    layers = [e for e in plan if e.action == "merge" and (pattern is None or re.search(pattern, e.name))]
    if not layers:
        what = f"matches --layers '{pattern}'" if pattern else "is in the base"
        raise SpecmergeError(f"no 2-D linear weight {what} ({base.describe()}); nothing to inspect")
    return layers, skipped


def choose_wudi_layer(layers: Sequence[TensorPlan], name: str | None) -> str:
    """``name`` if it is an inspected layer, else the middle layer (in model order) of the most common shape."""
    names = [e.name for e in layers]
    if name is not None:
        if name not in names:  # the closest layer as a hint, not the list: a model has hundreds
            close = closest_name(name, names, cutoff=0)
            hint = f" (did you mean '{close}'?)" if close else ""
            raise RecipeError(f"--wudi-layer '{name}' is not one of the inspected 2-D layers{hint}")
        return name
    shapes = [e.shape for e in layers]
    common = max(dict.fromkeys(shapes), key=shapes.count)
    candidates = [e.name for e in layers if e.shape == common]
    return candidates[len(candidates) // 2]


def representative_layers(layers: Sequence[TensorPlan], count: int) -> list[str]:
    """Up to ``count`` layers for the spectrum plot: the middle-depth layer of each layer type, in model order."""
    by_type: dict[str, list[str]] = {}
    for e in layers:
        by_type.setdefault(layer_type(e.name), []).append(e.name)
    return [names[len(names) // 2] for names in list(by_type.values())[:count]]


def layer_input(
    entry: TensorPlan, base_tensor: torch.Tensor, values: Sequence[TaskVector], device: torch.device, dtype: torch.dtype
) -> LayerInput:
    """The task vectors of one layer: LoRA cores (float64, exact) when every expert is an adapter, else dense.

    A weight stored (in, out) (``entry.transposed``, a Conv1D) is oriented (out, in), as ``merge`` gives it
    to a matrix method. The dense stack is built in ``dtype`` on ``device``; a LoRA adapter among full
    checkpoints is densified into it.
    """
    if entry.transposed:
        base_tensor, values = base_tensor.T, [value.transposed() for value in values]
    shape = tuple(base_tensor.shape)
    deltas = low_rank_deltas(values, dtype=torch.float64, device=device)
    if deltas is not None and any(d.rank for d in deltas):
        P, R, cores = factor_cores(deltas, torch.float64)
        return LayerInput(cores, shape, (P, R), values)
    return LayerInput(task_vector_stack(values, base_tensor, dtype=dtype, device=device))


def inspect_layer(
    entry: TensorPlan,
    layer: LayerInput,
    base_norm: float,
    specs: Sequence[MethodSpec],
    expert_keys: Sequence[str],
    opts: InspectOptions,
    state: InspectState,
    keep_spectrum: bool,
) -> None:
    """Append the layer's row to ``state.rows``: shapes, route, statistics and every compared method's delta norm.

    The normal equation and its eigendecomposition are shared by the statistics and the methods; with
    ``keep_spectrum`` the full spectrum and the rank rules' cuts are kept for the plots and the WUDI layer.
    """
    start = time.perf_counter()
    d_out, d_in = entry.shape[::-1] if entry.transposed else entry.shape  # as layer_input oriented it
    row: dict[str, Any] = {
        "name": entry.name,
        "type": layer_type(entry.name),
        "depth": layer_depth(entry.name),
        "d_out": d_out,
        "d_in": d_in,
        "N": layer.stack.shape[0],
        "route": "factored" if layer.factored else "dense",
        "layout": CONV1D_LAYOUT if entry.transposed else "linear (out, in)",
    }
    with shared_decompositions():
        eq, spectrum = equation_and_spectrum(layer.stack, layer.full_shape)
        norms = expert_norms_sq(layer.stack).sqrt()
        if spectrum is None:
            row.update(n_nonzero=0, rel_norms=[0.0] * len(norms))
        else:
            start_point = initial_point(layer.stack, opts.tau_init)
            stats = layer_statistics(
                eq, spectrum, start_point, expert_norms=norms, base_norm=base_norm, rank_ratio=opts.rank_ratio
            )
            row.update(stats)
            if keep_spectrum:
                state.spectra[entry.name] = {
                    "eigenvalues": full_spectrum(spectrum.eigenvalues, d_in),
                    **{f"K_{rule}": stats[f"K_{rule}"] for rule in RULES},
                }
        for spec in specs:
            row[f"norm[{spec.label}]"] = method_delta_norm(spec, layer, entry.name, expert_keys)
    row["seconds"] = time.perf_counter() - start
    state.rows.append(row)


def method_delta_norm(spec: MethodSpec, layer: LayerInput, name: str, expert_keys: Sequence[str]) -> float:
    """||merged delta||_F of one method on one layer (on the cores when the method merges them exactly)."""
    method = get_method(spec.name)
    if layer.factored and method.factored:
        result = method.merge_cores(
            layer.stack, layer.full_shape, tensor_name=name, expert_keys=expert_keys, **spec.params
        )
    else:
        result = method(layer.dense(), tensor_name=name, expert_keys=expert_keys, **spec.params)
    return float(result.diagnostics["delta_norm"])


def filter_problem(layer: LayerInput, tau_init: TauInit) -> FilterProblem:
    """The optimizer-as-filter problem of one layer, in float64 (factored for LoRA cores)."""
    if layer.factored:
        P, R = layer.bases
        eq = normal_equation(layer.stack.double())
        spectrum = decompose(eq, layer.full_shape)
        return factored_problem(P, R, eq, spectrum, initial_point(layer.stack.double(), tau_init))
    stack = layer.dense().double()
    eq = normal_equation(stack)
    return dense_problem(eq, decompose(eq), initial_point(stack, tau_init))


def wudi_diagnostics(entry: TensorPlan, layer: LayerInput, opts: InspectOptions, state: InspectState) -> None:
    """Filter shapes and the Adam / plain-GD empirical filters with their fits, on the chosen layer."""
    row = state.rows[-1]
    if row.get("n_nonzero", 0) == 0:
        return
    spectrum = state.spectra[entry.name]
    state.filters = {
        "layer": entry.name,
        "eigenvalues": spectrum["eigenvalues"],
        "gains": filter_family(
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
        state.fits += optimizer_filter_trace(problem, optimizer=optimizer, lr=lr, checkpoints=checkpoints)
    state.filters["fit_eigenvalues"] = problem.eigenvalues[fit_directions(problem)].cpu()
