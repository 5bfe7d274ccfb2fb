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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

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
BLOCK_BYTES = 64 * 2**20

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


def _read(
    entry: TensorPlan, rows: Rows, base: TensorSource, experts: Sequence[TensorSource]
) -> tuple[torch.Tensor, list]:
    base_tensor = base.load(entry.name, rows)
    if entry.action == "keep_base":
        return base_tensor, []
    return base_tensor, [expert.load(entry.name, rows) for expert in experts]


def _prefetched(
    work: Sequence[tuple[TensorPlan, Rows]], base: TensorSource, experts: Sequence[TensorSource]
) -> Iterator[tuple[TensorPlan, Rows, torch.Tensor, list]]:
    """Yield (entry, rows, base block, expert blocks), reading item k + 1 while the caller works on item k."""
    if not work:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="specmerge-read") as pool:
        pending = pool.submit(_read, *work[0], base, experts)
        for k, (entry, rows) in enumerate(work):
            base_tensor, expert_tensors = pending.result()
            if k + 1 < len(work):
                pending = pool.submit(_read, *work[k + 1], base, experts)
            yield entry, rows, base_tensor, expert_tensors


def merge_tensor(
    entry: TensorPlan,
    base_tensor: torch.Tensor,
    expert_tensors: Sequence[torch.Tensor],
    *,
    device: torch.device,
    compute_dtype: torch.dtype,
    expert_keys: Sequence[str] | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The merged tensor for one plan entry (in ``entry.out_dtype``, on the CPU) and its diagnostics."""
    if entry.action == "keep_base":
        return base_tensor.to(entry.out_dtype), {}
    base_c = base_tensor.to(device=device, dtype=compute_dtype)
    if entry.action == "average":  # running sum: two buffers, not N
        delta = torch.zeros_like(base_c)
        for t in expert_tensors:
            delta.add_(t.to(device=device))
        delta.div_(len(expert_tensors)).sub_(base_c).mul_(entry.params.get("scale", 1.0))
        diagnostics: dict[str, Any] = {}
    else:
        stack = base_c.new_empty((len(expert_tensors), *base_c.shape))
        for row, t in zip(stack, expert_tensors, strict=True):  # filled in place: no temporaries
            row.copy_(t).sub_(base_c)
        result = get_method(entry.method)(
            stack, dtype=compute_dtype, tensor_name=entry.name, expert_keys=expert_keys, **entry.params
        )
        delta, diagnostics = result.delta, result.diagnostics
        del stack, result
    return delta.add_(base_c).to(dtype=entry.out_dtype).cpu(), diagnostics


def run_plan(
    plan: Sequence[TensorPlan],
    base: TensorSource,
    experts: Sequence[TensorSource],
    write: Callable[[str, torch.Tensor], None],
    *,
    device: torch.device,
    compute_dtype: torch.dtype = torch.float32,
    expert_keys: Sequence[str] | None = None,
    progress: bool = True,
    block_bytes: int | None = None,
) -> list[TensorReport]:
    """Merge every planned tensor, hand each result to ``write(name, tensor, row_start=...)``, report per tensor.

    ``write`` receives whole tensors (``row_start=None``) or blocks of rows (see :func:`row_blocks`).
    """
    itemsize = compute_dtype.itemsize
    work = [(entry, rows) for entry in plan for rows in row_blocks(entry, itemsize, block_bytes)]
    reports: dict[str, TensorReport] = {}
    done = 0
    total = sum(_numel(entry.shape) * entry.out_dtype.itemsize for entry in plan)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress, desc="merging") as bar:
        for entry, rows, base_tensor, expert_tensors in _prefetched(work, base, experts):
            start = time.perf_counter()
            merged, diagnostics = merge_tensor(
                entry,
                base_tensor,
                expert_tensors,
                device=device,
                compute_dtype=compute_dtype,
                expert_keys=expert_keys,
            )
            seconds = time.perf_counter() - start
            write(entry.name, merged, row_start=None if rows is None else rows[0])
            nbytes = merged.numel() * merged.dtype.itemsize
            del merged, base_tensor, expert_tensors
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
    return list(reports.values())


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
