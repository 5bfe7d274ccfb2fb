"""Stream a merge plan through the methods: one tensor name at a time, reading the next while computing.

For every planned tensor: read it from the base and the N experts (on a background thread, one
tensor ahead), stack the deltas tau_i = W_i - W_0 on the device in the compute dtype, apply the
planned action, form W_0 + delta, cast to the output dtype and hand it to the writer. Peak memory
is about two sets of N + 1 tensors (the one being merged and the one being read), never a model.
"""

from __future__ import annotations

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


def _read(plan: TensorPlan, base: TensorSource, experts: Sequence[TensorSource]) -> tuple[torch.Tensor, list]:
    base_tensor = base.load(plan.name)
    if plan.action == "keep_base":
        return base_tensor, []
    return base_tensor, [expert.load(plan.name) for expert in experts]


def _prefetched(
    plan: Sequence[TensorPlan], base: TensorSource, experts: Sequence[TensorSource]
) -> Iterator[tuple[TensorPlan, torch.Tensor, list]]:
    """Yield (entry, base tensor, expert tensors), reading entry k + 1 while the caller works on entry k."""
    if not plan:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="specmerge-read") as pool:
        pending = pool.submit(_read, plan[0], base, experts)
        for k, entry in enumerate(plan):
            base_tensor, expert_tensors = pending.result()
            if k + 1 < len(plan):
                pending = pool.submit(_read, plan[k + 1], base, experts)
            yield entry, base_tensor, expert_tensors


def merge_tensor(
    entry: TensorPlan,
    base_tensor: torch.Tensor,
    expert_tensors: Sequence[torch.Tensor],
    *,
    device: torch.device,
    compute_dtype: torch.dtype,
    average_scale: float = 1.0,
    expert_keys: Sequence[str] | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The merged tensor for one plan entry (in ``entry.out_dtype``, on the CPU) and its diagnostics."""
    if entry.action == "keep_base":
        return base_tensor.to(entry.out_dtype), {}
    base_c = base_tensor.to(device=device, dtype=compute_dtype)
    stack = torch.stack([t.to(device=device, dtype=compute_dtype) for t in expert_tensors]) - base_c
    if entry.action == "average":
        delta, diagnostics = average_scale * stack.mean(dim=0), {}
    else:
        result = get_method(entry.method)(
            stack, dtype=compute_dtype, tensor_name=entry.name, expert_keys=expert_keys, **entry.params
        )
        delta, diagnostics = result.delta, result.diagnostics
    return (base_c + delta).to(dtype=entry.out_dtype).cpu(), diagnostics


def run_plan(
    plan: Sequence[TensorPlan],
    base: TensorSource,
    experts: Sequence[TensorSource],
    write: Callable[[str, torch.Tensor], None],
    *,
    device: torch.device,
    compute_dtype: torch.dtype = torch.float32,
    average_scale: float = 1.0,
    expert_keys: Sequence[str] | None = None,
    progress: bool = True,
) -> list[TensorReport]:
    """Merge every planned tensor, hand each result to ``write(name, tensor)``, and report per tensor."""
    total = sum(_nbytes(entry) for entry in plan)
    reports = []
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress, desc="merging") as bar:
        for done, (entry, base_tensor, expert_tensors) in enumerate(_prefetched(plan, base, experts), start=1):
            start = time.perf_counter()
            merged, diagnostics = merge_tensor(
                entry,
                base_tensor,
                expert_tensors,
                device=device,
                compute_dtype=compute_dtype,
                average_scale=average_scale,
                expert_keys=expert_keys,
            )
            seconds = time.perf_counter() - start
            write(entry.name, merged)
            del merged, base_tensor, expert_tensors
            reports.append(
                TensorReport(entry.name, entry.shape, entry.action, entry.method, entry.reason, seconds, diagnostics)
            )
            bar.set_postfix_str(f"{done}/{len(plan)} tensors", refresh=False)
            bar.update(_nbytes(entry))
    return reports


def _nbytes(entry: TensorPlan) -> int:
    count = 1
    for dim in entry.shape:
        count *= dim
    return count * entry.out_dtype.itemsize
