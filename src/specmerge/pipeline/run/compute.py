"""The compute step of a work item: its inputs -> the merged tensor (or merged LoRA factors) and diagnostics.

For one plan entry (or a block of its rows): stack the task vectors tau_i on the device in the compute
dtype, apply the planned action, form W_0 + delta and cast it to the output dtype. The route is chosen by
what the method declares and what the experts hold, never by names:

- ``keep_base``: W_0, cast;
- linear merges (averages, and methods that declare ``Method.linear``: weight average, task arithmetic) of
  full checkpoints on the CPU: W_0 + sum_i c_i tau_i in cache-sized chunks (:func:`linear_merge`);
- every expert a LoRA adapter (or not changing the tensor), on a 2-D weight, with an average or a method
  that declares ``Method.factored``: the exact merge on the factors (``factored``), no d_out x d_in stack;
- otherwise ``dense``: the N x ... stack (:func:`specmerge.io.views.task_vectors.task_vector_stack`) and the method.

:func:`route` names the route of a plan entry from its experts' kinds alone, before anything is read (the dry
run and the cost model use it; the functions below follow it). These functions read no file and write none: the
same inputs give the same bits whatever the executor.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

import torch

from specmerge.io.formats.layout import CONV1D_LAYOUT, transpose_result
from specmerge.io.views.task_vectors import Dense, TaskVector, low_rank_deltas, task_vector_stack, task_vector_sum
from specmerge.linalg.lowrank import AdapterFactors, FactoredResult, adapter_factors
from specmerge.linalg.solve import LayerProjections
from specmerge.methods import get_method
from specmerge.methods.linear import weighted_sum
from specmerge.pipeline.plan.rules import TensorPlan
from specmerge.pipeline.run.finite import all_finite, check_inputs, refuse_nonfinite

CHUNK_ELEMENTS = 2**18  # linear merges on the CPU run in chunks this long: every pass stays in cache

Route = Literal["keep_base", "linear", "unchanged", "factored", "sum", "dense"]
ROUTES: dict[str, str] = {  # what each route does, in words (the dry run prints them)
    "keep_base": "W_0 copied (cast to the output dtype)",
    "linear": "W_0 + sum_i c_i tau_i in cache-sized chunks, row block by row block",
    "unchanged": "no expert changes it: W_0 copied",
    "factored": "exact merge on the LoRA factors, no d_out x d_in stack",
    "sum": "average as a running sum (two buffers)",
    "dense": "N x ... stack of task vectors, then the method",
}


def resolve_device(device: str) -> torch.device:
    """``auto`` is the first CUDA device when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{device}' was asked for but torch sees no CUDA device; use --device cpu or auto")
    return resolved


def linear_coefficient(entry: TensorPlan, n: int, weights: Sequence[float] | None = None) -> tuple[float, ...] | None:
    """c_i in merged = W_0 + sum_i c_i tau_i when ``entry`` is such a merge of ``n`` experts (an average, or a
    method that declares itself linear) with per-expert ``weights`` (None: none given), else None.

    An average is the plain mean (c_i = s / n), or with weights the weighted mean (c_i = s w_i / sum_j w_j)."""
    if n == 0:
        return None
    if entry.action == "average":
        scale = entry.params.get("scale", 1.0)
        if weights is None:
            return (scale / n,) * n
        total = sum(weights)
        return tuple(scale * w / total for w in weights)
    if entry.action == "merge":
        return get_method(entry.method).linear_coefficient(entry.params, n, weights)
    return None


def route(entry: TensorPlan, kinds: Sequence[str], device: torch.device, *, chunked: bool = True) -> Route:
    """How an ``average`` or ``merge`` entry (or ``keep_base``) is computed, from the kinds of its experts' task
    vectors (``dense``, ``low_rank`` or ``zero``, :mod:`specmerge.io.views.task_vectors`), in expert order.

    ``linear`` (:func:`linear_merge`) for a linear merge of full checkpoints on the CPU, unless ``chunked`` is
    False (:func:`merged_delta` alone does not chunk); ``unchanged`` when no expert changes the tensor;
    ``factored`` when every value is low-rank or zero, on a 2-D weight, with an average or a method that
    declares an exact factored form; else ``sum`` for an average and ``dense`` (the stack and the method).
    """
    if entry.action == "keep_base":
        return "keep_base"
    dense = [kind == "dense" for kind in kinds]
    if chunked and all(dense) and device.type == "cpu" and linear_coefficient(entry, len(kinds)) is not None:
        return "linear"
    if all(kind == "zero" for kind in kinds):
        return "unchanged"
    method = get_method(entry.method) if entry.action == "merge" else None
    if not any(dense) and len(entry.shape) == 2 and (method is None or method.factored):
        return "factored"
    return "sum" if method is None else "dense"


def merged_delta(
    entry: TensorPlan,
    base_c: torch.Tensor | None,
    values: Sequence[TaskVector],
    *,
    device: torch.device,
    compute_dtype: torch.dtype,
    expert_keys: Sequence[str] | None = None,
    weights: Sequence[float] | None = None,
) -> tuple[torch.Tensor | FactoredResult | None, dict[str, Any]]:
    """The merged delta of one ``average`` or ``merge`` entry: dense, factored, or None (no expert changes it).

    ``base_c`` is the base tensor on ``device`` in ``compute_dtype`` (None only when no value is dense, as
    when writing an adapter). Routes, recorded in the diagnostics: ``factored`` when every value is low-rank
    (or zero) and the method declares an exact factored form (an average is the concatenation of the
    factors); otherwise ``dense``: low-rank values are formed as s B A for this tensor and stacked with the
    full checkpoints' W_i - W_0 (TIES, DARE and the iterative methods always densify).

    A weight stored (in, out) (``entry.transposed``, a Conv1D) is given to a matrix method as (out, in),
    tau_i^T, and the merged delta is returned transposed back, in the stored layout (a view when dense);
    elementwise methods and averages do not depend on the orientation and see the stored layout.

    ``weights`` are the per-expert weights (None: none given), for averages and the methods that define them;
    a method that merges whole weights (``Method.needs_base``) gets ``base_c``.
    """
    n = len(values)
    which = route(entry, [value.kind for value in values], device, chunked=False)
    if which == "unchanged":
        return None, {"route": "unchanged"}
    method = get_method(entry.method) if entry.action == "merge" else None
    if entry.stacked and method is not None and not method.linear:
        return stacked_delta(
            entry, base_c, values, device=device, compute_dtype=compute_dtype, expert_keys=expert_keys, weights=weights
        )
    if entry.transposed and method is not None and method.needs_matrix:
        oriented = dataclasses.replace(entry, shape=entry.shape[::-1], transposed=False)
        delta, diagnostics = merged_delta(
            oriented,
            None if base_c is None else base_c.T,
            [value.transposed() for value in values],
            device=device,
            compute_dtype=compute_dtype,
            expert_keys=expert_keys,
            weights=weights,
        )
        return transpose_result(delta), {**diagnostics, "layout": CONV1D_LAYOUT}
    shape = entry.shape if base_c is None else tuple(base_c.shape)
    if which == "factored":
        check_inputs(entry, None, values)  # the factors: small; the base is checked by the caller
        deltas = low_rank_deltas(values, dtype=compute_dtype, device=device)
        if method is None:  # average: sum_i c_i s_i B_i A_i, as one pair of concatenated factors
            scales = linear_coefficient(entry, n, weights)
            left = torch.cat([d.B * (c * d.scale) for c, d in zip(scales, deltas, strict=True)], dim=1)
            right = torch.cat([d.A for d in deltas], dim=0)
            return FactoredResult(left, right, {}), {"route": "factored"}
        result = method.merge_factored(deltas, dtype=compute_dtype, weights=weights, **entry.params)
        return result, {**result.diagnostics, "route": "factored"}
    if method is None and weights is None:  # average as a running sum: two buffers, not N
        delta = task_vector_sum(values, base_c, shape, dtype=compute_dtype, device=device)
        delta.div_(n).mul_(entry.params.get("scale", 1.0))
        if not all_finite(delta):  # NaN or Inf in any input reaches the sum (inf * 0 is NaN)
            refuse_nonfinite(entry, base_c, values)
        return delta, {"route": "sum"}
    stack = checked_stack(entry, base_c, values, device=device, compute_dtype=compute_dtype, shape=shape)
    if method is None:  # a weighted average of some LoRA and some full experts: the stack, weighted
        return weighted_sum(stack, linear_coefficient(entry, n, weights)), {"route": "dense"}
    whole = {"base": base_c} if method.needs_base else {}
    result = method(
        stack, dtype=compute_dtype, tensor_name=entry.name, expert_keys=expert_keys, weights=weights, **whole,
        **entry.params,
    )  # fmt: skip
    del stack
    return result.delta, {**result.diagnostics, "route": "dense"}


def stacked_delta(
    entry: TensorPlan,
    base_c: torch.Tensor | None,
    values: Sequence[TaskVector],
    **options: Any,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The merged delta of a stack of E experts' weights ``[E, ., .]`` (``entry.stacked``), merged as E linear
    layers: slice e is :func:`merged_delta` of slice e of every task vector, as a 2-D entry named ``<name>[e]`` (so
    seeded methods draw each slice's own masks) in the slices' orientation (``entry.transposed``). A linear method
    gives the same either way and is not split (see :func:`merged_delta`)."""
    shape = entry.shape if base_c is None else tuple(base_c.shape)
    out = torch.zeros(shape, dtype=options["compute_dtype"], device=options["device"])
    per_expert = []
    for e in range(shape[0]):
        part = dataclasses.replace(entry, name=f"{entry.name}[{e}]", shape=shape[1:], stacked=False)
        delta, diagnostics = merged_delta(
            part, None if base_c is None else base_c[e], [v.select(e) for v in values], **options
        )
        if isinstance(delta, FactoredResult):  # a LoRA stack's slice merged exactly on its factors
            delta = delta.left @ delta.right
        if delta is not None:
            out[e].copy_(delta)
        per_expert.append(diagnostics)
    return out, {"route": "stacked", "experts": shape[0], "per_expert": per_expert}


def checked_stack(
    entry: TensorPlan,
    base_c: torch.Tensor | None,
    values: Sequence[TaskVector],
    *,
    device: torch.device,
    compute_dtype: torch.dtype,
    shape: tuple[int, ...],
) -> torch.Tensor:
    """The N x ... stack of task vectors, refused (naming the inputs) if it holds NaN or Inf: checked before the
    method, as TIES would drop NaN and TSV-M an expert, silently."""
    stack = task_vector_stack(values, base_c, dtype=compute_dtype, device=device, shape=shape)
    if not all_finite(stack):
        refuse_nonfinite(entry, base_c, values)
    return stack


def spectral_stack(
    entry: TensorPlan, base_tensor: torch.Tensor, values: Sequence[TaskVector], *, device: torch.device,
    compute_dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """The stack a spectral method's ``dense`` route merges for ``entry``, oriented (out, in) as the method sees it:
    what a spectral cache decomposes and stores (:func:`merge_from_layer` then replaces the merge of it)."""
    base_c = base_tensor.to(device=device, dtype=compute_dtype)
    if entry.transposed:
        base_c, values = base_c.T, [value.transposed() for value in values]
    return checked_stack(entry, base_c, values, device=device, compute_dtype=compute_dtype, shape=tuple(base_c.shape))


def merge_from_layer(
    entry: TensorPlan, base_tensor: torch.Tensor, layer: LayerProjections, *, device: torch.device,
    compute_dtype: torch.dtype,
) -> tuple[torch.Tensor, dict[str, Any]]:  # fmt: skip
    """:func:`merge_tensor` of a spectral method's entry from the layer's stored projections instead of the experts'
    values (:func:`spectral_stack` of the same inputs, decomposed once): the same filter step on the same numbers, so
    the same bits, with no decomposition. Raises :class:`~specmerge.linalg.solve.ProjectionMissing` when the layer
    lacks what this setting needs (merge from the values then)."""
    base_c = base_tensor.to(device=device, dtype=compute_dtype)
    check_inputs(entry, base_c, ())
    params = get_method(entry.method).validate(entry.params, layer.n_total)
    return solved_from_layer(entry, base_c, layer, params, "cached")


def solved_from_layer(
    entry: TensorPlan, base_c: torch.Tensor, layer: LayerProjections, params: dict[str, Any], route_name: str
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The merged tensor of a spectral method's entry from a layer's projections (stored, or fresh and decomposed
    elsewhere): the method's filter step with its validated ``params``, in the stored layout, added to ``base_c`` (the
    checked base in the compute dtype), in the output dtype on the CPU; ``route_name`` goes into the diagnostics."""
    method = get_method(entry.method)
    result = method.fn(layer, **params, **method.fixed)
    delta, diagnostics = result.delta, {**result.diagnostics, "route": route_name}
    if entry.transposed:
        delta, diagnostics["layout"] = delta.T, CONV1D_LAYOUT
    merged = delta.add_(base_c) if delta.is_contiguous() else base_c.add_(delta)
    return merged.to(dtype=entry.out_dtype).cpu(), diagnostics


def spectral_batchable(entry: TensorPlan) -> bool:
    """Whether ``entry`` may join a batch of same-shape spectral layers
    (:func:`~specmerge.pipeline.run.batched.merge_spectral_batch`), from the plan alone: a whole 2-D weight (not an
    expert stack) that a spectral method merges, with no per-expert weights and without the base."""
    if entry.action != "merge" or entry.stacked or len(entry.shape) != 2:
        return False
    method = get_method(entry.method)
    return method.spectral and method.weighting is None and not method.needs_base


def merge_tensor(
    entry: TensorPlan,
    base_tensor: torch.Tensor,
    values: Sequence[TaskVector],
    *,
    device: torch.device,
    compute_dtype: torch.dtype,
    expert_keys: Sequence[str] | None = None,
    weights: Sequence[float] | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The merged tensor for one plan entry (in ``entry.out_dtype``, on the CPU) and its diagnostics.

    Raises :class:`~specmerge.pipeline.run.finite.NonFiniteInput` when an input holds NaN or Inf (which inputs,
    by index, and how many entries of the given blocks), or NonFiniteError when finite inputs overflow the
    compute dtype.
    """
    if entry.action == "keep_base":
        check_inputs(entry, base_tensor, ())
        return base_tensor.to(entry.out_dtype), {}
    if route(entry, [value.kind for value in values], device) == "linear":
        coefficients = linear_coefficient(entry, len(values), weights)
        return linear_merge(entry, base_tensor, [value.weight for value in values], coefficients, compute_dtype)
    base_c = base_tensor.to(device=device, dtype=compute_dtype)
    check_inputs(entry, base_c, ())  # merged_delta checks the experts
    delta, diagnostics = merged_delta(
        entry, base_c, values, device=device, compute_dtype=compute_dtype, expert_keys=expert_keys, weights=weights
    )
    if isinstance(delta, FactoredResult):
        merged = base_c.addmm_(delta.left, delta.right)
    elif delta is not None:  # a transposed view (a Conv1D weight's delta) goes into base_c: a contiguous result
        merged = delta.add_(base_c) if delta.is_contiguous() else base_c.add_(delta)
    else:
        merged = base_c
    return merged.to(dtype=entry.out_dtype).cpu(), diagnostics


def merge_adapter_tensor(
    entry: TensorPlan,
    values: Sequence[TaskVector],
    *,
    device: torch.device,
    compute_dtype: torch.dtype,
    max_rank: int | None = None,
    out_dtype: torch.dtype | None = None,
    expert_keys: Sequence[str] | None = None,
    weights: Sequence[float] | None = None,
) -> tuple[AdapterFactors | None, dict[str, Any]]:
    """The merged delta of LoRA experts as LoRA factors (on the CPU): exact, or truncated to ``max_rank`` with
    the discarded energy in the diagnostics (:func:`~specmerge.linalg.lowrank.adapter_factors`); None when the
    delta is zero (the adapter writes no module)."""
    delta, diagnostics = merged_delta(
        entry, None, values, device=device, compute_dtype=compute_dtype, expert_keys=expert_keys, weights=weights
    )
    if delta is None:
        return None, diagnostics
    f = adapter_factors(delta, max_rank=max_rank, dtype=out_dtype)
    diagnostics.update(adapter_rank=f.rank, discarded_energy=f.discarded_energy)
    if not f.rank:
        return None, diagnostics
    return AdapterFactors(f.B.cpu(), f.A.cpu(), f.discarded_energy), diagnostics


def linear_merge(
    entry: TensorPlan,
    base_tensor: torch.Tensor,
    weights: Sequence[torch.Tensor],
    coefficients: Sequence[float],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """W_0 + sum_i c_i (W_i - W_0) for full checkpoints' ``weights`` on the CPU, in cache-sized chunks.

    The same arithmetic as stacking the task vectors in ``dtype`` and calling the registry method (each
    tau_i = W_i - W_0 rounded once, summed, scaled, added to W_0), but each chunk's few passes stay in
    cache instead of streaming an N x tensor stack through memory several times: 2-3x faster end to end
    for task arithmetic (BENCHMARKS.md, issue 6). Equal c_i (no expert weights) scale the sum once, as the method
    does; else each tau_i is added with its own c_i. The diagnostics are the registry method's.

    NaN or Inf in any input makes its chunk's sum of squares non-finite (even at c = 0: inf * 0 is NaN),
    so the check for them costs one float test per chunk; only then are the inputs searched.
    """
    out = torch.empty(base_tensor.shape, dtype=entry.out_dtype)
    flat_out, flat_base = out.view(-1), base_tensor.reshape(-1)
    flat_items = [weight.reshape(-1) for weight in weights]
    chunk = min(CHUNK_ELEMENTS, flat_out.numel())
    base_c, acc, tau = (torch.empty(chunk, dtype=dtype) for _ in range(3))
    equal = len(set(coefficients)) == 1
    squares = 0.0
    for start in range(0, flat_out.numel(), chunk):
        stop = min(start + chunk, flat_out.numel())
        b, a, t = base_c[: stop - start], acc[: stop - start], tau[: stop - start]
        b.copy_(flat_base[start:stop])
        if equal:
            a.copy_(flat_items[0][start:stop]).sub_(b)  # converting first: a mixed-dtype sub is 3x slower
            for item in flat_items[1:]:
                a.add_(t.copy_(item[start:stop]).sub_(b))
            a.mul_(coefficients[0])
        else:
            a.zero_()
            for item, c in zip(flat_items, coefficients, strict=True):
                a.add_(t.copy_(item[start:stop]).sub_(b), alpha=c)
        chunk_squares = float(torch.dot(a, a))
        if not math.isfinite(chunk_squares):
            chunk_squares = _recheck_chunk(entry, a, base_tensor, weights, start, stop)
        squares += chunk_squares
        flat_out[start:stop].copy_(a.add_(b))
    if entry.action == "average":
        return out, {"route": "linear"}
    return out, {"n_experts": len(weights), "delta_norm": math.sqrt(squares), "route": "linear"}


def _recheck_chunk(
    entry: TensorPlan, a: torch.Tensor, base: torch.Tensor, weights: Sequence[torch.Tensor], start: int, stop: int
) -> float:
    """The sum of squares of a chunk whose float32 sum was not finite: raises for NaN or Inf in an input or
    in the delta itself (finite inputs overflowing the compute dtype); else it only overflowed, so recount."""
    flat = [base.reshape(-1), *(weight.reshape(-1) for weight in weights)]
    if not all(all_finite(x[start:stop]) for x in flat) or not all_finite(a):
        refuse_nonfinite(entry, base, [Dense(weight) for weight in weights])
    return float(torch.dot(a.double(), a.double()))
