"""What an expert holds for one tensor, as one of three typed values, and the task-vector stack built from them.

An expert (:mod:`specmerge.io.views.experts`) gives, for a tensor name and an optional block of rows, a
:data:`TaskVector`:

- :class:`Dense`: a full checkpoint's weight W_i; its task vector is W_i - W_0 (W_0: the base's tensor);
- :class:`LowRank`: a LoRA adapter's delta s B A (:class:`~specmerge.linalg.lowrank.LoraDelta`), the task
  vector itself;
- :class:`Zero`: the expert does not change this tensor (an adapter that does not target it).

Each value knows how to write its task vector into a buffer, add it to a running sum, give its low-rank
form and turn into the other orientation, so that the code that merges (the executor) and the code that
measures (``specmerge inspect``) never switch on the kind of expert. :func:`task_vector_stack` is the one
place the N x ... stack of task vectors is built; :func:`task_vector_sum` and :func:`low_rank_deltas` are the
running-sum and factored forms of the same inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from specmerge.linalg.lowrank import LoraDelta


def _require_base(base: torch.Tensor | None) -> torch.Tensor:
    if base is None:
        raise ValueError("a full checkpoint's task vector W_i - W_0 needs the base tensor W_0")
    return base


def count_nonfinite(tensor: torch.Tensor) -> int:
    """How many entries of ``tensor`` are NaN or +-Inf (0 for integer tensors)."""
    if not tensor.is_floating_point():
        return 0
    return tensor.numel() - int(torch.isfinite(tensor).sum())


@dataclass(frozen=True)
class Dense:
    """A full checkpoint's weight W_i for one tensor (or a block of its rows); its task vector is W_i - W_0."""

    weight: torch.Tensor
    kind: ClassVar[str] = "dense"

    def transposed(self) -> Dense:
        """The other orientation (a view)."""
        return Dense(self.weight.T)

    def select(self, index: int) -> Dense:
        """Entry ``index`` of a stack (dim 0): one expert's weight of an MoE stack (a view)."""
        return Dense(self.weight[index])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors read from the expert's files (checked for NaN and Inf)."""
        return (self.weight,)

    def low_rank(self, *, dtype: torch.dtype, device: torch.device | str) -> LoraDelta | None:
        """The task vector as a LoRA delta on ``device`` in ``dtype``; None: it has no low-rank form."""
        return None

    def write_into(self, out: torch.Tensor, base: torch.Tensor | None) -> None:
        """Write the task vector into ``out`` (a buffer of the tensor's shape, in the compute dtype), in place."""
        out.copy_(self.weight).sub_(_require_base(base))

    def add_into(self, total: torch.Tensor) -> int:
        """Add what this value holds to ``total``; return how many times the base must be subtracted (W_i: once)."""
        total.add_(self.weight.to(device=total.device))
        return 1

    def nonfinite_count(self) -> int:
        """How many entries are NaN or +-Inf."""
        return count_nonfinite(self.weight)


@dataclass(frozen=True)
class LowRank:
    """A LoRA adapter's delta s B A for one tensor (or a block of its rows): the task vector itself."""

    delta: LoraDelta
    kind: ClassVar[str] = "low_rank"

    def transposed(self) -> LowRank:
        """The other orientation: (s B A)^T = s A^T B^T (views)."""
        return LowRank(LoraDelta(self.delta.A.T, self.delta.B.T, self.delta.scale))

    def select(self, index: int) -> LowRank:
        """A LoRA delta is 2-D: it is no stack."""
        raise ValueError("a LoRA delta is one 2-D matrix, not a stack of experts' weights")

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.delta.B, self.delta.A)

    def low_rank(self, *, dtype: torch.dtype, device: torch.device | str) -> LoraDelta | None:
        return self.delta.to(device, dtype)

    def write_into(self, out: torch.Tensor, base: torch.Tensor | None) -> None:
        out.zero_()
        self.add_into(out)

    def add_into(self, total: torch.Tensor) -> int:
        d = self.delta.to(total.device, total.dtype)
        total.addmm_(d.B, d.A, alpha=d.scale)
        return 0

    def nonfinite_count(self) -> int:
        return count_nonfinite(self.delta.B) + count_nonfinite(self.delta.A)


@dataclass(frozen=True)
class Zero:
    """An expert that does not change this tensor (of ``shape``): its task vector is zero."""

    shape: tuple[int, ...]
    kind: ClassVar[str] = "zero"

    def transposed(self) -> Zero:
        return Zero(tuple(self.shape[::-1]))

    def select(self, index: int) -> Zero:
        return Zero(tuple(self.shape[1:]))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return ()

    def low_rank(self, *, dtype: torch.dtype, device: torch.device | str) -> LoraDelta | None:
        """The rank-0 delta (of a 2-D tensor)."""
        return LoraDelta.zero(self.shape, dtype, device)

    def write_into(self, out: torch.Tensor, base: torch.Tensor | None) -> None:
        out.zero_()

    def add_into(self, total: torch.Tensor) -> int:
        return 0

    def nonfinite_count(self) -> int:
        return 0


@dataclass(frozen=True)
class StackedLowRank:
    """A LoRA on an MoE expert stack (PEFT's ``target_parameters``): one low-rank delta per expert slice, each in
    the slices' stored layout. A stack is merged slice by slice (:func:`specmerge.pipeline.run.compute.stacked_delta`
    takes each slice's :class:`LowRank`); linear methods and averages fill the whole stack at once."""

    deltas: tuple[LoraDelta, ...]
    kind: ClassVar[str] = "low_rank"

    def select(self, index: int) -> LowRank:
        return LowRank(self.deltas[index])

    def rows(self, start: int, stop: int) -> StackedLowRank:
        return StackedLowRank(self.deltas[start:stop])

    def transposed(self) -> StackedLowRank:
        raise ValueError("a stack of experts' deltas is transposed slice by slice, not as a whole")

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for d in self.deltas for t in (d.B, d.A))

    def low_rank(self, *, dtype: torch.dtype, device: torch.device | str) -> LoraDelta | None:
        return None  # a stack has no single low-rank form

    def write_into(self, out: torch.Tensor, base: torch.Tensor | None) -> None:
        out.zero_()
        self.add_into(out)

    def add_into(self, total: torch.Tensor) -> int:
        for slice_, delta in zip(total, self.deltas, strict=True):
            d = delta.to(total.device, total.dtype)
            slice_.addmm_(d.B, d.A, alpha=d.scale)
        return 0

    def nonfinite_count(self) -> int:
        return sum(count_nonfinite(t) for t in self.tensors())


TaskVector = Dense | LowRank | Zero | StackedLowRank


def task_vector_stack(
    values: Sequence[TaskVector],
    base: torch.Tensor | None,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """The N x ... stack of task vectors tau_i on ``device`` in ``dtype``: W_i - W_0, s B A or 0.

    ``base`` is W_0 (any dtype and device; None only when no value is :class:`Dense`, then ``shape`` gives the
    tensor's shape). Each row is written in place (W_i converted, then W_0 subtracted; s B A added to zeros
    with one ``addmm``), so the stack is the only N-sized buffer.
    """
    base_c = None if base is None else base.to(device=device, dtype=dtype)
    size = tuple(base_c.shape) if base_c is not None else tuple(shape)
    stack = torch.empty((len(values), *size), dtype=dtype, device=device)
    for row, value in zip(stack, values, strict=True):  # filled in place: no temporaries
        value.write_into(row, base_c)
    return stack


def task_vector_sum(
    values: Sequence[TaskVector],
    base: torch.Tensor | None,
    shape: Sequence[int],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """sum_i tau_i (of a tensor of ``shape``) on ``device`` in ``dtype`` with two buffers, not N: sum_i W_i and
    s_i B_i A_i added in order, then W_0 (``base``, None only when no value is dense) subtracted once per full
    checkpoint."""
    base_c = None if base is None else base.to(device=device, dtype=dtype)
    total = torch.zeros(tuple(shape), dtype=dtype, device=device)
    full = sum(value.add_into(total) for value in values)
    if full:
        total.sub_(_require_base(base_c), alpha=full)
    return total


def low_rank_deltas(
    values: Sequence[TaskVector], *, dtype: torch.dtype, device: torch.device | str
) -> list[LoraDelta] | None:
    """Every task vector as a LoRA delta on ``device`` in ``dtype`` (rank 0 for :class:`Zero`), or None when some
    value has no low-rank form (a full checkpoint's weight)."""
    if any(value.kind == "dense" for value in values):
        return None
    return [value.low_rank(dtype=dtype, device=device) for value in values]
