"""Lazy views of opened checkpoints in the output's tensor names, and a base that also serves the own modules.

A merge whose inputs were saved under different wrappers, or whose experts carry modules the base lacks (a
vision tower, a projector, a task head), is aligned before it is planned (:mod:`specmerge.pipeline.inputs.align`);
the plan, the executor and the writer then see ordinary inputs that share one set of names:

- :class:`RenamedSource` is a :class:`~specmerge.io.formats.protocol.TensorSource` under other names (output name ->
  the source's own name); :class:`RenamedExpert` is the same for an :class:`~specmerge.io.views.experts.Expert`
  (a LoRA adapter under the base's new names).
- :class:`OwnModulesSource` is the base as the plan sees it: the base's tensors plus the experts' own
  modules. An own module's tensor (or block of rows) is read from the experts that hold it: the tensor of
  the one expert named for it, bit for bit, or the plain average of several holders, summed in expert order
  in ``compute_dtype`` (float32 or float64) and cast to the holders' dtype (:func:`torch.promote_types` of
  theirs when they differ). The plan keeps such tensors "from the base", so the experts that lack a module
  are never read for it.

Views read nothing when made and close nothing: the opened sources they wrap are closed by their owner.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specmerge.errors import NonFiniteError
from specmerge.io.formats.protocol import Rows, SourceError, TensorInfo, TensorSource
from specmerge.io.views.experts import Expert
from specmerge.io.views.task_vectors import Dense, TaskVector, count_nonfinite


def _renamed_infos(infos: Mapping[str, TensorInfo], names: Mapping[str, str]) -> dict[str, TensorInfo]:
    return {out: TensorInfo(out, infos[name].shape, infos[name].dtype) for out, name in names.items()}


class RenamedSource:
    """``source`` under the names of ``names`` (output name -> the source's name), in that order."""

    def __init__(self, source: TensorSource, names: Mapping[str, str]) -> None:
        self.source = source
        self.path = source.path
        self.names = dict(names)
        self._infos = _renamed_infos(source.infos(), self.names)

    def infos(self) -> dict[str, TensorInfo]:
        return self._infos

    def load(self, name: str, rows: Rows = None) -> torch.Tensor:
        if name not in self.names:
            raise SourceError(f"{self.path}: no tensor '{name}'")
        return self.source.load(self.names[name], rows)

    def describe(self) -> str:
        return self.source.describe()

    def files(self) -> list[Path]:
        return self.source.files()

    def close(self) -> None:
        """Nothing: the wrapped source is closed by whoever opened it."""


class RenamedExpert:
    """``expert`` under the names of ``names`` (output name -> the expert's name), in that order."""

    def __init__(self, expert: Expert, names: Mapping[str, str]) -> None:
        self.expert = expert
        self.path = expert.path
        self.low_rank = expert.low_rank
        self.variant_kinds = getattr(expert, "variant_kinds", [])  # an adapter's DoRA, biases, ... (see AdapterExpert)
        self.names = dict(names)
        self._infos = _renamed_infos(expert.infos(), self.names)

    def infos(self) -> dict[str, TensorInfo]:
        return self._infos

    def changes(self, name: str) -> bool:
        return self.expert.changes(self.names[name])

    def kind(self, name: str) -> str:
        """The kind of value :meth:`read` gives (see :func:`specmerge.pipeline.estimate.cost.expert_kind`)."""
        inner = getattr(self.expert, "kind", None)
        if inner is not None:
            return inner(self.names[name])
        return "zero" if not self.changes(name) else "low_rank" if self.low_rank else "dense"

    def read(self, name: str, rows: Rows = None) -> TaskVector:
        return self.expert.read(self.names[name], rows)

    def stored_in_out_weights(self) -> frozenset[str]:
        inner = self.expert.stored_in_out_weights()
        return frozenset(out for out, name in self.names.items() if name in inner)

    def nonfinite(self, name: str, label: str) -> str | None:
        return self.expert.nonfinite(self.names[name], label)

    def describe(self) -> str:
        describe = getattr(self.expert, "describe", None)
        return describe() if describe else str(self.path)

    def files(self) -> list[Path]:
        return self.expert.files()

    def close(self) -> None:
        """Nothing: the wrapped expert is closed by whoever opened it."""


@dataclass(frozen=True)
class OwnTensor:
    """One tensor of an own module: its output info, the experts it is read from (one: copied; several:
    averaged) and their labels for messages (``"expert 'vision'"``)."""

    info: TensorInfo
    holders: tuple[Expert, ...]
    labels: tuple[str, ...]


class OwnModulesSource:
    """The base as the plan sees it: ``base``'s tensors (those named in ``order``) and the experts' ``own``
    tensors, in ``order``. See the module docstring for how an own tensor is read."""

    def __init__(
        self,
        base: TensorSource,
        own: Mapping[str, OwnTensor],
        order: Sequence[str],
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.base = base
        self.path = base.path
        self.own = dict(own)
        self.compute_dtype = compute_dtype
        base_infos = base.infos()
        self._infos = {name: self.own[name].info if name in self.own else base_infos[name] for name in order}

    def infos(self) -> dict[str, TensorInfo]:
        return self._infos

    def load(self, name: str, rows: Rows = None) -> torch.Tensor:
        own = self.own.get(name)
        if own is None:
            if name not in self._infos:
                raise SourceError(f"{self.path}: no tensor '{name}'")
            return self.base.load(name, rows)
        weights = [
            _dense(holder.read(name, rows), name, label) for holder, label in zip(own.holders, own.labels, strict=True)
        ]
        for weight, holder, label in zip(weights, own.holders, own.labels, strict=True):
            bad = count_nonfinite(weight)
            if bad:
                raise NonFiniteError(
                    f"tensor '{name}' (own module of {label}) holds NaN or Inf: {bad} of {weight.numel()} entries"
                    f"{' of the rows read' if rows else ''} in {label} ({holder.path}); specmerge merges finite "
                    "weights only: repair or re-export that checkpoint"
                )
        if len(weights) == 1:
            return weights[0]
        total = torch.zeros(weights[0].shape, dtype=self.compute_dtype)
        for weight in weights:
            total.add_(weight.to(self.compute_dtype))
        return total.div_(len(weights)).to(own.info.dtype)

    def describe(self) -> str:
        return f"{self.base.describe()} with {len(self.own)} tensors of the experts' own modules"

    def files(self) -> list[Path]:
        return self.base.files()

    def close(self) -> None:
        """Nothing: the base and the experts are closed by whoever opened them."""


def _dense(value: TaskVector, name: str, label: str) -> torch.Tensor:
    if not isinstance(value, Dense):
        raise SourceError(f"{label} holds no weights of its own for '{name}' (a LoRA adapter holds only deltas)")
    return value.weight


def average_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """The dtype of an own tensor read from holders of ``dtypes``: theirs, or :func:`torch.promote_types` of them."""
    result = dtypes[0]
    for dtype in dtypes[1:]:
        result = torch.promote_types(result, dtype)
    return result
