"""NaN and Inf in a merge's inputs: found before any result is written, and named by file.

Every floating input read (base and experts, full tensors, row blocks and LoRA factors, for every action)
is checked before its result is written: the chunked linear route reads it off the sum of squares it
computes anyway (a non-finite input makes it non-finite, even at scale 0), the other routes with one
min/max pass over the stack or the inputs. The compute step raises :class:`NonFiniteInput` (which inputs,
by index, and how many entries of the given blocks); the job turns it into a :class:`NonFiniteError` naming
every input that holds such values by its path, counted over the whole tensor (:func:`locate_nonfinite`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NoReturn

import torch

from specmerge.errors import NonFiniteError
from specmerge.io.formats.protocol import TensorSource
from specmerge.io.views.experts import Expert, source_nonfinite
from specmerge.io.views.task_vectors import TaskVector, count_nonfinite
from specmerge.pipeline.plan.rules import TensorPlan


class NonFiniteInput(NonFiniteError):
    """NaN or Inf in inputs of one tensor; ``counts`` maps an input (-1: the base, i: expert i) to its count."""

    def __init__(self, tensor: str, counts: dict[int, int]) -> None:
        self.tensor = tensor
        self.counts = dict(counts)
        where = ", ".join(f"{c} in {'the base' if i < 0 else f'experts[{i}]'}" for i, c in self.counts.items())
        super().__init__(f"tensor '{tensor}' holds NaN or Inf ({where}); specmerge merges finite weights only")


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether no entry is NaN or +-Inf: one min/max pass (NaN and Inf reach the min or the max), no temporaries."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def check_inputs(entry: TensorPlan, base_tensor: torch.Tensor | None, values: Sequence[TaskVector]) -> None:
    """Raise :class:`NonFiniteInput` when the base tensor (if given) or a value holds NaN or Inf."""
    tensors = [] if base_tensor is None else [base_tensor]
    for value in values:
        tensors += value.tensors()
    if not all(all_finite(t) for t in tensors):
        refuse_nonfinite(entry, base_tensor, values)


def refuse_nonfinite(entry: TensorPlan, base_tensor: torch.Tensor | None, values: Sequence[TaskVector]) -> NoReturn:
    """Raise for a non-finite result of ``entry``: :class:`NonFiniteInput` counting every input's NaN and Inf
    entries, or, when all inputs are finite, an overflow of the compute dtype."""
    counts = {i: value.nonfinite_count() for i, value in enumerate(values)}
    counts = {-1: 0 if base_tensor is None else count_nonfinite(base_tensor), **counts}
    if any(counts.values()):
        raise NonFiniteInput(entry.name, {i: c for i, c in counts.items() if c})
    raise NonFiniteError(
        f"tensor '{entry.name}': its inputs are finite but the merge overflows the compute dtype "
        "(values beyond its largest number): use compute_dtype float64 or a smaller scale"
    )


def check_finite(
    entry: TensorPlan,
    base_tensor: torch.Tensor | None,
    values: Sequence[TaskVector],
    base: TensorSource | None,
    experts: Sequence[Expert],
) -> None:
    """Raise :class:`NonFiniteError` when the base tensor or an expert's value read for ``entry`` holds NaN or
    Inf, naming each such input of ``base`` and ``experts`` by path (see :func:`locate_nonfinite`)."""
    try:
        check_inputs(entry, base_tensor, values)
    except NonFiniteInput as err:
        raise locate_nonfinite(entry, base, experts, err) from None


def locate_nonfinite(
    entry: TensorPlan, base: TensorSource | None, experts: Sequence[Expert], error: NonFiniteInput
) -> NonFiniteError:
    """The error for NaN or Inf in ``entry``'s inputs, naming each input that holds some by its path, with its
    count over the whole tensor (read again, in row blocks); ``error`` if no input holds any now."""
    found = [] if base is None else [source_nonfinite(base, entry.name, "the base")]
    if entry.action != "keep_base":
        found += [expert.nonfinite(entry.name, "expert") for expert in experts]
    found = [what for what in found if what]
    if not found:
        return error
    return NonFiniteError(
        f"tensor '{entry.name}' holds NaN or Inf: {'; '.join(found)}; specmerge merges finite weights only: "
        "repair or re-export that checkpoint (a diverged fine-tune or a broken conversion?)"
    )
