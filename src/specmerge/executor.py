"""Stream a merge plan through the methods: one tensor name at a time, reading the next while computing.

For every planned tensor: read it from the base and the N experts (on a background thread, one
block ahead), stack the deltas tau_i = W_i - W_0 on the device in the compute dtype, apply the
planned action, form W_0 + delta, cast to the output dtype and hand it to the writer. Work that is
the same row by row (keep_base, average, weight_average, task_arithmetic) goes in blocks of rows of
at most ``block_bytes`` per checkpoint, so a large embedding costs a block, not N + 1 copies of
itself. Peak memory is about two sets of N + 1 inputs of the largest matrix-merged tensor plus its
solver's workspace, never a model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from specmerge.adapters import AdapterExpert
from specmerge.lora import AdapterFactors, FactoredResult, LoraDelta, adapter_factors, merge_factored
from specmerge.plan import TensorPlan
from specmerge.registry import get_method
from specmerge.sources import TensorSource


@dataclass
class TensorReport:
    """What happened to one tensor: action, method, seconds spent computing, and the method's diagnostics."""

    name: str
    shape: tuple[int, ...]
    action: str
    method: str | None
    reason: str
    seconds: float
    diagnostics: dict[str, Any] = field(default_factory=dict)


def resolve_device(device: str) -> torch.device:
    """``auto`` is the first CUDA device when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{device}' was asked for but torch sees no CUDA device; use --device cpu or auto")
    return resolved


ROWWISE_METHODS = frozenset({"weight_average", "task_arithmetic"})  # the same function of every row
BLOCK_BYTES = 16 * 2**20  # small enough for reads, compute and writes to overlap well (BENCHMARKS.md, issue 6)
CHUNK_ELEMENTS = 2**18  # linear merges on the CPU run in chunks this long: every pass stays in cache

Rows = tuple[int, int] | None


def row_blocks(entry: TensorPlan, itemsize: int, block_bytes: int | None = None) -> list[Rows]:
    """Row ranges to process ``entry`` in (``[None]``: the whole tensor at once); default BLOCK_BYTES per block."""
    block_bytes = BLOCK_BYTES if block_bytes is None else block_bytes
    rowwise = entry.action in ("keep_base", "average") or entry.method in ROWWISE_METHODS
    if not rowwise or not entry.shape or entry.shape[0] == 0:
        return [None]
    rows = entry.shape[0]
    row_bytes = max(1, _numel(entry.shape) // rows * itemsize)
    per_block = max(1, block_bytes // row_bytes)
    if per_block >= rows:
        return [None]
    return [(start, min(start + per_block, rows)) for start in range(0, rows, per_block)]


Expert = TensorSource | AdapterExpert
# What an expert holds for one tensor: its weight W_i (full checkpoint), a low-rank delta (LoRA adapter),
# or None (an adapter that does not change this tensor: delta zero).
Item = torch.Tensor | LoraDelta | None


def _load(expert: Expert, name: str, rows: Rows) -> Item:
    if isinstance(expert, AdapterExpert):
        return expert.load_delta(name, rows)
    return expert.load(name, rows)


def _read(
    entry: TensorPlan, rows: Rows, base: TensorSource | None, experts: Sequence[Expert]
) -> tuple[torch.Tensor | None, list[Item]]:
    base_tensor = None if base is None else base.load(entry.name, rows)
    if entry.action == "keep_base":
        return base_tensor, []
    return base_tensor, [_load(expert, entry.name, rows) for expert in experts]


def _prefetched(
    work: Sequence[tuple[TensorPlan, Rows]], base: TensorSource | None, experts: Sequence[Expert]
) -> Iterator[tuple[TensorPlan, Rows, torch.Tensor | None, list[Item]]]:
    """Yield (entry, rows, base block, expert blocks), reading item k + 1 while the caller works on item k."""
    if not work:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="specmerge-read") as pool:
        pending = pool.submit(_read, *work[0], base, experts)
        for k, (entry, rows) in enumerate(work):
            base_tensor, items = pending.result()
            if k + 1 < len(work):
                pending = pool.submit(_read, *work[k + 1], base, experts)
            yield entry, rows, base_tensor, items


def merged_delta(
    entry: TensorPlan,
    base_c: torch.Tensor | None,
    items: Sequence[Item],
    *,
    device: torch.device,
    compute_dtype: torch.dtype,
    expert_keys: Sequence[str] | None = None,
) -> tuple[torch.Tensor | FactoredResult | None, dict[str, Any]]:
    """The merged delta of one ``average`` or ``merge`` entry: dense, factored, or None (no expert changes it).

    ``base_c`` is the base tensor on ``device`` in ``compute_dtype`` (None only when every item is a
    low-rank delta or None, as when writing an adapter). Routes, recorded in the diagnostics:
    ``factored`` when every expert is a LoRA adapter and the method has an exact factored form (the
    spectral methods, task arithmetic, weight average, TSV-M, Iso-C; an average is the concatenation
    of the factors); otherwise ``dense``: adapters' deltas are formed as s B A for this tensor and
    stacked with the full checkpoints' W_i - W_0 (TIES, DARE and the iterative methods always densify).
    """
    n = len(items)
    if all(item is None for item in items):
        return None, {"route": "unchanged"}
    all_factored = all(item is None or isinstance(item, LoraDelta) for item in items)
    method = get_method(entry.method) if entry.action == "merge" else None
    shape = entry.shape if base_c is None else tuple(base_c.shape)
    if all_factored and len(shape) == 2 and (method is None or method.factored):
        deltas = [
            LoraDelta.zero(shape, compute_dtype, device) if item is None else item.to(device, compute_dtype)
            for item in items
        ]
        if method is None:  # average: s / N * sum_i s_i B_i A_i, as one pair of concatenated factors
            scale = entry.params.get("scale", 1.0) / n
            left = torch.cat([d.B * (scale * d.scale) for d in deltas], dim=1)
            right = torch.cat([d.A for d in deltas], dim=0)
            return FactoredResult(left, right, {}), {"route": "factored"}
        result = merge_factored(method.name, deltas, dtype=compute_dtype, **entry.params)
        return result, {**result.diagnostics, "route": "factored"}
    if method is None:  # average as a running sum: two buffers, not N
        delta = torch.zeros(shape, dtype=compute_dtype, device=device)
        full = 0
        for item in items:
            if isinstance(item, torch.Tensor):
                delta.add_(item.to(device=device))
                full += 1
            elif item is not None:
                _add_low_rank(delta, item, device, compute_dtype)
        if full:
            delta.sub_(_needs_base(base_c, entry), alpha=full)
        delta.div_(n).mul_(entry.params.get("scale", 1.0))
        return delta, {"route": "dense"}
    stack = torch.empty((n, *shape), dtype=compute_dtype, device=device)
    for row, item in zip(stack, items, strict=True):  # filled in place: no temporaries
        if isinstance(item, torch.Tensor):
            row.copy_(item).sub_(_needs_base(base_c, entry))
        else:
            row.zero_()
            if item is not None:
                _add_low_rank(row, item, device, compute_dtype)
    result = method(stack, dtype=compute_dtype, tensor_name=entry.name, expert_keys=expert_keys, **entry.params)
    del stack
    return result.delta, {**result.diagnostics, "route": "dense"}


def _needs_base(base_c: torch.Tensor | None, entry: TensorPlan) -> torch.Tensor:
    if base_c is None:
        raise ValueError(f"tensor '{entry.name}': a full-checkpoint expert's delta needs the base tensor")
    return base_c


def _add_low_rank(target: torch.Tensor, delta: LoraDelta, device: torch.device, dtype: torch.dtype) -> None:
    d = delta.to(device, dtype)
    target.addmm_(d.B, d.A, alpha=d.scale)


def merge_tensor(
    entry: TensorPlan,
    base_tensor: torch.Tensor,
    items: Sequence[Item],
    *,
    device: torch.device,
    compute_dtype: torch.dtype,
    expert_keys: Sequence[str] | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The merged tensor for one plan entry (in ``entry.out_dtype``, on the CPU) and its diagnostics."""
    if entry.action == "keep_base":
        return base_tensor.to(entry.out_dtype), {}
    coefficient = _linear_coefficient(entry, len(items))
    if coefficient is not None and device.type == "cpu" and all(isinstance(i, torch.Tensor) for i in items):
        return _linear_merge(entry, base_tensor, items, coefficient, compute_dtype)
    base_c = base_tensor.to(device=device, dtype=compute_dtype)
    delta, diagnostics = merged_delta(
        entry, base_c, items, device=device, compute_dtype=compute_dtype, expert_keys=expert_keys
    )
    if isinstance(delta, FactoredResult):
        merged = base_c.addmm_(delta.left, delta.right)
    elif delta is not None:
        merged = delta.add_(base_c)
    else:
        merged = base_c
    return merged.to(dtype=entry.out_dtype).cpu(), diagnostics


def _linear_coefficient(entry: TensorPlan, n: int) -> float | None:
    """c in merged = W_0 + c * sum_i tau_i when ``entry`` is such a merge (average, task arithmetic, weight
    average), else None."""
    if n == 0:
        return None
    if entry.action == "average":
        return entry.params.get("scale", 1.0) / n
    if entry.action == "merge" and entry.method in ROWWISE_METHODS:
        scale = get_method(entry.method).validate(entry.params)["scale"]
        return scale / n if entry.method == "weight_average" else scale
    return None


def _linear_merge(
    entry: TensorPlan, base_tensor: torch.Tensor, items: Sequence[torch.Tensor], coefficient: float, dtype: torch.dtype
) -> tuple[torch.Tensor, dict[str, Any]]:
    """W_0 + c * sum_i (W_i - W_0) for full checkpoints on the CPU, in cache-sized chunks.

    The same arithmetic as stacking the task vectors in ``dtype`` and calling the registry method (each
    tau_i = W_i - W_0 rounded once, summed, scaled, added to W_0), but each chunk's few passes stay in
    cache instead of streaming an N x tensor stack through memory several times: 2-3x faster end to end
    for task arithmetic (BENCHMARKS.md, issue 6). The diagnostics are the registry method's.
    """
    out = torch.empty(base_tensor.shape, dtype=entry.out_dtype)
    flat_out, flat_base = out.view(-1), base_tensor.reshape(-1)
    flat_items = [item.reshape(-1) for item in items]
    chunk = min(CHUNK_ELEMENTS, flat_out.numel())
    base_c, acc, tau = (torch.empty(chunk, dtype=dtype) for _ in range(3))
    squares = 0.0
    for start in range(0, flat_out.numel(), chunk):
        stop = min(start + chunk, flat_out.numel())
        b, a, t = base_c[: stop - start], acc[: stop - start], tau[: stop - start]
        b.copy_(flat_base[start:stop])
        a.copy_(flat_items[0][start:stop]).sub_(b)  # converting first: a mixed-dtype sub is 3x slower
        for item in flat_items[1:]:
            a.add_(t.copy_(item[start:stop]).sub_(b))
        a.mul_(coefficient)
        squares += float(torch.dot(a, a))
        flat_out[start:stop].copy_(a.add_(b))
    if entry.action == "average":
        return out, {"route": "dense"}
    return out, {"n_experts": len(items), "delta_norm": math.sqrt(squares), "route": "dense"}


def run_plan(
    plan: Sequence[TensorPlan],
    base: TensorSource,
    experts: Sequence[Expert],
    write: Callable[[str, torch.Tensor], None],
    *,
    device: torch.device,
    compute_dtype: torch.dtype = torch.float32,
    expert_keys: Sequence[str] | None = None,
    progress: bool = True,
    block_bytes: int | None = None,
) -> list[TensorReport]:
    """Merge every planned tensor, hand each result to ``write(name, tensor, row_start=...)``, report per tensor.

    ``write`` receives whole tensors (``row_start=None``) or blocks of rows (see :func:`row_blocks`). Reads
    run one item ahead on a reader thread and writes one item behind on a writer thread (``write`` is
    called for one item at a time, in plan order), so disk and compute overlap; at most one merged
    result waits to be written.
    """
    itemsize = compute_dtype.itemsize
    work = [(entry, rows) for entry in plan for rows in row_blocks(entry, itemsize, block_bytes)]
    reports: dict[str, TensorReport] = {}
    done = 0
    total = sum(_numel(entry.shape) * entry.out_dtype.itemsize for entry in plan)
    writing: Future | None = None
    with (
        tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress, desc="merging") as bar,
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="specmerge-write") as writer,
    ):
        for entry, rows, base_tensor, items in _prefetched(work, base, experts):
            start = time.perf_counter()
            merged, diagnostics = merge_tensor(
                entry,
                base_tensor,
                items,
                device=device,
                compute_dtype=compute_dtype,
                expert_keys=expert_keys,
            )
            seconds = time.perf_counter() - start
            if writing is not None:
                writing.result()  # the previous item is on disk (or its error is raised here)
            writing = writer.submit(write, entry.name, merged, row_start=None if rows is None else rows[0])
            nbytes = merged.numel() * merged.dtype.itemsize
            del merged, base_tensor, items
            report = reports.get(entry.name)
            if report is None:
                reports[entry.name] = TensorReport(
                    entry.name, entry.shape, entry.action, entry.method, entry.reason, seconds, diagnostics
                )
            else:  # another block of the same tensor: add up time and the delta's norm
                report.seconds += seconds
                if "delta_norm" in diagnostics:
                    report.diagnostics["delta_norm"] = math.hypot(
                        report.diagnostics["delta_norm"], diagnostics["delta_norm"]
                    )
            if rows is None or rows[1] == entry.shape[0]:
                done += 1
            bar.set_postfix_str(f"{done}/{len(plan)} tensors", refresh=False)
            bar.update(nbytes)
        if writing is not None:
            writing.result()
    return list(reports.values())


def run_adapter_plan(
    plan: Sequence[TensorPlan],
    experts: Sequence[AdapterExpert],
    *,
    device: torch.device,
    compute_dtype: torch.dtype = torch.float32,
    max_rank: int | None = None,
    out_dtype: torch.dtype | None = None,
    expert_keys: Sequence[str] | None = None,
    progress: bool = True,
) -> tuple[dict[str, AdapterFactors], list[TensorReport]]:
    """Merge LoRA experts into LoRA factors per adapted tensor (for writing a PEFT adapter); the base is not read.

    Only tensors that some adapter changes and the plan merges or averages are worked on; every other
    tensor of the merged model is the base's. Each merged delta becomes :func:`adapter_factors` (exact, or
    truncated to ``max_rank`` with the discarded energy in the report); a zero delta writes no module.
    """
    work = [
        (entry, None)
        for entry in plan
        if entry.action != "keep_base" and any(expert.changes(entry.name) for expert in experts)
    ]
    factors: dict[str, AdapterFactors] = {}
    reports = []
    with tqdm(total=len(work), unit="tensor", disable=not progress, desc="merging adapters") as bar:
        for entry, _, _, items in _prefetched(work, None, experts):
            start = time.perf_counter()
            delta, diagnostics = merged_delta(
                entry, None, items, device=device, compute_dtype=compute_dtype, expert_keys=expert_keys
            )
            if delta is not None:
                f = adapter_factors(delta, max_rank=max_rank, dtype=out_dtype)
                diagnostics.update(adapter_rank=f.rank, discarded_energy=f.discarded_energy)
                if f.rank:
                    factors[entry.name] = AdapterFactors(f.B.cpu(), f.A.cpu(), f.discarded_energy)
            seconds = time.perf_counter() - start
            reports.append(
                TensorReport(entry.name, entry.shape, entry.action, entry.method, entry.reason, seconds, diagnostics)
            )
            bar.update()
    return factors, reports


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
