"""Stream a merge plan through the methods: one tensor name at a time, reading the next while computing.

For every planned tensor: read it from the base and the N experts (on a background thread, one
block ahead), stack the deltas tau_i = W_i - W_0 on the device in the compute dtype, apply the
planned action, form W_0 + delta, cast to the output dtype and hand it to the writer. Work that is
the same row by row (keep_base, average, weight_average, task_arithmetic) goes in blocks of rows of
at most ``block_bytes`` per checkpoint, so a large embedding costs a block, not N + 1 copies of
itself. Peak memory is about two sets of N + 1 inputs of the largest matrix-merged tensor plus its
solver's workspace, never a model.

Every floating input read (base and experts, full tensors, row blocks and LoRA factors, for every action)
is checked for NaN and Inf before its result is written: the chunked linear route reads it off the
sum of squares it computes anyway (a non-finite input makes it non-finite, even at scale 0), the other
routes with one min/max pass over the stack or the inputs. A failure raises :class:`NonFiniteError`
naming the tensor, every input that holds such values (by path) and how many entries.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
from tqdm.auto import tqdm

from specmerge.errors import NonFiniteError
from specmerge.io.adapters import AdapterExpert
from specmerge.io.layout import CONV1D_LAYOUT, transpose_item, transpose_result
from specmerge.io.sources import TensorSource
from specmerge.linalg.lowrank import AdapterFactors, FactoredResult, LoraDelta, adapter_factors, merge_factored
from specmerge.methods.registry import get_method
from specmerge.pipeline.plan import TensorPlan
from specmerge.pipeline.threads import io_thread_setup


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
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="specmerge-read", initializer=io_thread_setup) as pool:
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

    A weight stored (in, out) (``entry.transposed``, a Conv1D) is given to a matrix method as (out, in),
    tau_i^T, and the merged delta is returned transposed back, in the stored layout (a view when dense);
    elementwise methods and averages do not depend on the orientation and see the stored layout.
    """
    n = len(items)
    if all(item is None for item in items):
        return None, {"route": "unchanged"}
    if entry.transposed and entry.action == "merge" and get_method(entry.method).needs_matrix:
        oriented = dataclasses.replace(entry, shape=entry.shape[::-1], transposed=False)
        delta, diagnostics = merged_delta(
            oriented,
            None if base_c is None else base_c.T,
            [transpose_item(item) for item in items],
            device=device,
            compute_dtype=compute_dtype,
            expert_keys=expert_keys,
        )
        return transpose_result(delta), {**diagnostics, "layout": CONV1D_LAYOUT}
    all_factored = all(item is None or isinstance(item, LoraDelta) for item in items)
    method = get_method(entry.method) if entry.action == "merge" else None
    shape = entry.shape if base_c is None else tuple(base_c.shape)
    if all_factored and len(shape) == 2 and (method is None or method.factored):
        _check_inputs(entry, None, items)  # the factors: small; the base is checked by the caller
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
        if not _all_finite(delta):  # NaN or Inf in any input reaches the sum (inf * 0 is NaN)
            _refuse_nonfinite(entry, base_c, items)
        return delta, {"route": "dense"}
    stack = torch.empty((n, *shape), dtype=compute_dtype, device=device)
    for row, item in zip(stack, items, strict=True):  # filled in place: no temporaries
        if isinstance(item, torch.Tensor):
            row.copy_(item).sub_(_needs_base(base_c, entry))
        else:
            row.zero_()
            if item is not None:
                _add_low_rank(row, item, device, compute_dtype)
    if not _all_finite(stack):  # before the method: TIES would drop NaN, TSV-M an expert, silently
        _refuse_nonfinite(entry, base_c, items)
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
    """The merged tensor for one plan entry (in ``entry.out_dtype``, on the CPU) and its diagnostics.

    Raises :class:`NonFiniteError` when an input holds NaN or Inf (``NonFiniteInput``: which inputs, by
    index, and how many entries of the given blocks), or when finite inputs overflow the compute dtype.
    """
    if entry.action == "keep_base":
        _check_inputs(entry, base_tensor, ())
        return base_tensor.to(entry.out_dtype), {}
    coefficient = _linear_coefficient(entry, len(items))
    if coefficient is not None and device.type == "cpu" and all(isinstance(i, torch.Tensor) for i in items):
        return _linear_merge(entry, base_tensor, items, coefficient, compute_dtype)
    base_c = base_tensor.to(device=device, dtype=compute_dtype)
    _check_inputs(entry, base_c, ())  # merged_delta checks the experts
    delta, diagnostics = merged_delta(
        entry, base_c, items, device=device, compute_dtype=compute_dtype, expert_keys=expert_keys
    )
    if isinstance(delta, FactoredResult):
        merged = base_c.addmm_(delta.left, delta.right)
    elif delta is not None:  # a transposed view (a Conv1D weight's delta) goes into base_c: a contiguous result
        merged = delta.add_(base_c) if delta.is_contiguous() else base_c.add_(delta)
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

    NaN or Inf in any input makes its chunk's sum of squares non-finite (even at c = 0: inf * 0 is NaN),
    so the check for them costs one float test per chunk; only then are the inputs searched.
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
        chunk_squares = float(torch.dot(a, a))
        if not math.isfinite(chunk_squares):
            chunk_squares = _recheck_chunk(entry, a, base_tensor, items, start, stop)
        squares += chunk_squares
        flat_out[start:stop].copy_(a.add_(b))
    if entry.action == "average":
        return out, {"route": "dense"}
    return out, {"n_experts": len(items), "delta_norm": math.sqrt(squares), "route": "dense"}


def _recheck_chunk(
    entry: TensorPlan, a: torch.Tensor, base: torch.Tensor, items: Sequence[torch.Tensor], start: int, stop: int
) -> float:
    """The sum of squares of a chunk whose float32 sum was not finite: raises for NaN or Inf in an input or
    in the delta itself (finite inputs overflowing the compute dtype); else it only overflowed, so recount."""
    flat = [base.reshape(-1), *(item.reshape(-1) for item in items)]
    if not all(_all_finite(x[start:stop]) for x in flat):
        _refuse_nonfinite(entry, base, items)
    if not _all_finite(a):
        _refuse_nonfinite(entry, base, items)
    return float(torch.dot(a.double(), a.double()))


class NonFiniteInput(NonFiniteError):
    """NaN or Inf in inputs of one tensor; ``counts`` maps an input (-1: the base, i: expert i) to its count."""

    def __init__(self, tensor: str, counts: dict[int, int]) -> None:
        self.tensor = tensor
        self.counts = dict(counts)
        where = ", ".join(f"{c} in {'the base' if i < 0 else f'experts[{i}]'}" for i, c in self.counts.items())
        super().__init__(f"tensor '{tensor}' holds NaN or Inf ({where}); specmerge merges finite weights only")


def _all_finite(tensor: torch.Tensor) -> bool:
    """Whether no entry is NaN or +-Inf: one min/max pass (NaN and Inf reach the min or the max), no temporaries."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def nonfinite_count(item: Item) -> int:
    """How many entries of a tensor (of both factors of a LoRA delta) are NaN or +-Inf; 0 for None or integers."""
    if item is None:
        return 0
    if isinstance(item, LoraDelta):
        return nonfinite_count(item.B) + nonfinite_count(item.A)
    if not item.is_floating_point():
        return 0
    return item.numel() - int(torch.isfinite(item).sum())


def _check_inputs(entry: TensorPlan, base_tensor: torch.Tensor | None, items: Sequence[Item]) -> None:
    """Raise :class:`NonFiniteInput` when the base tensor (if given) or an item holds NaN or Inf."""
    tensors = [] if base_tensor is None else [base_tensor]
    for item in items:
        tensors += [item.B, item.A] if isinstance(item, LoraDelta) else [] if item is None else [item]
    if not all(_all_finite(t) for t in tensors):
        _refuse_nonfinite(entry, base_tensor, items)


def _refuse_nonfinite(entry: TensorPlan, base_tensor: torch.Tensor | None, items: Sequence[Item]) -> NoReturn:
    """Raise for a non-finite result of ``entry``: :class:`NonFiniteInput` counting every input's NaN and Inf
    entries, or, when all inputs are finite, an overflow of the compute dtype."""
    counts = {i: nonfinite_count(item) for i, item in enumerate(items)}
    counts = {-1: 0 if base_tensor is None else nonfinite_count(base_tensor), **counts}
    if any(counts.values()):
        raise NonFiniteInput(entry.name, {i: c for i, c in counts.items() if c})
    raise NonFiniteError(
        f"tensor '{entry.name}': its inputs are finite but the merge overflows the compute dtype "
        "(values beyond its largest number): use compute_dtype float64 or a smaller scale"
    )


def check_finite(
    entry: TensorPlan,
    base_tensor: torch.Tensor | None,
    items: Sequence[Item],
    base: TensorSource | None,
    experts: Sequence[Expert],
) -> None:
    """Raise :class:`NonFiniteError` when the base tensor or an expert's item read for ``entry`` holds NaN or
    Inf, naming each such input of ``base`` and ``experts`` by path (see :func:`locate_nonfinite`)."""
    try:
        _check_inputs(entry, base_tensor, items)
    except NonFiniteInput as err:
        raise locate_nonfinite(entry, base, experts, err) from None


def locate_nonfinite(
    entry: TensorPlan, base: TensorSource | None, experts: Sequence[Expert], error: NonFiniteInput
) -> NonFiniteError:
    """The error for NaN or Inf in ``entry``'s inputs, naming each input that holds some by its path, with its
    count over the whole tensor (read again, in row blocks); ``error`` if no input holds any now."""
    sources: list[tuple[int, TensorSource | Expert]] = [] if base is None else [(-1, base)]
    if entry.action != "keep_base":
        sources += list(enumerate(experts))
    found = []
    for index, source in sources:
        label = "the base" if index < 0 else "expert"
        if isinstance(source, AdapterExpert):
            delta = source.load_delta(entry.name)
            count = nonfinite_count(delta)
            total = 0 if delta is None else delta.B.numel() + delta.A.numel()
            what = f"{count} of the {total} entries of the LoRA factors of {label} '{source.path}'"
        else:
            count, total = 0, math.prod(entry.shape)
            for rows in row_blocks(entry, 4):
                count += nonfinite_count(source.load(entry.name, rows))
            what = f"{count} of {total} entries in {label} '{source.path}'"
        if count:
            found.append(what)
    if not found:
        return error
    return NonFiniteError(
        f"tensor '{entry.name}' holds NaN or Inf: {'; '.join(found)}; specmerge merges finite weights only: "
        "repair or re-export that checkpoint (a diverged fine-tune or a broken conversion?)"
    )


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
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="specmerge-write", initializer=io_thread_setup) as writer,
    ):
        for entry, rows, base_tensor, items in _prefetched(work, base, experts):
            start = time.perf_counter()
            try:
                merged, diagnostics = merge_tensor(
                    entry,
                    base_tensor,
                    items,
                    device=device,
                    compute_dtype=compute_dtype,
                    expert_keys=expert_keys,
                )
            except NonFiniteInput as err:
                raise locate_nonfinite(entry, base, experts, err) from None
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
            try:
                delta, diagnostics = merged_delta(
                    entry, None, items, device=device, compute_dtype=compute_dtype, expert_keys=expert_keys
                )
            except NonFiniteInput as err:
                raise locate_nonfinite(entry, None, experts, err) from None
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
