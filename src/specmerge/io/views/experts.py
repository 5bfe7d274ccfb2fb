"""Experts of a base model, whatever their format: what each one changes, tensor by tensor.

An expert is a fine-tuned full checkpoint (:class:`CheckpointExpert`, any format :func:`open_source` reads,
or a GGUF file read in the base's names) or a PEFT LoRA adapter of the base (:class:`AdapterExpert`). Both follow
:class:`Expert`: ``read(name, rows)`` gives the tensor's :data:`~specmerge.io.views.task_vectors.TaskVector`
(dense W_i, low-rank s B A, or zero), ``infos()`` the tensors it has (an adapter has every base tensor: those it
does not adapt are the base's own), ``files()`` the real files it reads. :func:`open_expert` opens either from a path.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from specmerge.io.formats.gguf_format import GGUF_SUFFIX, open_gguf
from specmerge.io.formats.peft import AdapterError, LoraAdapter, is_adapter, open_adapter
from specmerge.io.formats.protocol import Closing, Rows, TensorInfo, TensorSource, row_ranges
from specmerge.io.formats.sources import open_source
from specmerge.io.views.adapter_variants import dense_variants, variant_weight
from specmerge.io.views.task_vectors import Dense, LowRank, StackedLowRank, TaskVector, Zero, count_nonfinite
from specmerge.linalg.lowrank import LoraDelta

NONFINITE_BLOCK_BYTES = 16 * 2**20  # a tensor searched for NaN and Inf is read in blocks of rows this large


class Expert(Protocol):
    """One expert of a base model, read one tensor (or block of rows) at a time."""

    path: Path
    low_rank: bool  # every task vector it gives is low-rank or zero (a LoRA adapter)

    def infos(self) -> dict[str, TensorInfo]:
        """The tensors the expert has (name -> stored shape and dtype)."""
        ...

    def changes(self, name: str) -> bool:
        """Whether the expert may change tensor ``name`` (False: its task vector is certainly zero)."""
        ...

    def read(self, name: str, rows: Rows = None) -> TaskVector:
        """What the expert holds for tensor ``name`` (its rows ``start:stop`` when given)."""
        ...

    def stored_in_out_weights(self) -> frozenset[str]:
        """The base weights that this expert says are stored (in, out) (see :mod:`specmerge.io.formats.layout`)."""
        ...

    def nonfinite(self, name: str, label: str) -> str | None:
        """How many NaN or Inf entries tensor ``name`` holds, said for a message about ``label`` ("expert");
        None when it holds none."""
        ...

    def files(self) -> list[Path]:
        """The real paths (links resolved) of every file the expert reads."""
        ...

    def close(self) -> None: ...


def source_nonfinite(source: TensorSource, name: str, label: str) -> str | None:
    """``N of M entries in <label> '<path>'`` for NaN and Inf in tensor ``name`` of ``source`` (read in blocks
    of rows, so that counting costs a block, not a tensor), or None when it has none."""
    shape = source.infos()[name].shape
    total = math.prod(shape)
    blocks = row_ranges(shape, 4, NONFINITE_BLOCK_BYTES)
    count = sum(count_nonfinite(source.load(name, block)) for block in blocks)
    return f"{count} of {total} entries in {label} '{source.path}'" if count else None


class CheckpointExpert(Closing):
    """A full fine-tuned checkpoint as an expert: every tensor is its weight W_i (:class:`Dense`)."""

    low_rank = False

    def __init__(self, source: TensorSource) -> None:
        self.source = source
        self.path = source.path

    def infos(self) -> dict[str, TensorInfo]:
        return self.source.infos()

    def changes(self, name: str) -> bool:
        return True

    def read(self, name: str, rows: Rows = None) -> Dense:
        return Dense(self.source.load(name, rows))

    def stored_in_out_weights(self) -> frozenset[str]:
        return frozenset()  # a checkpoint's layout comes from the base's config.json

    def nonfinite(self, name: str, label: str) -> str | None:
        return source_nonfinite(self.source, name, label)

    def describe(self) -> str:
        return self.source.describe()

    def files(self) -> list[Path]:
        return self.source.files()

    def close(self) -> None:
        self.source.close()


class AdapterExpert(Closing):
    """A LoRA adapter as an expert of a base model: every base tensor, changed by s B A on the adapted weights.

    ``infos()`` lists the base's tensors (an adapter expert has them all: the ones it does not adapt are
    the base's own, a :class:`Zero` delta); ``read(name)`` is the :class:`LowRank` delta of an adapted weight.
    Checks on construction that every adapted module is a base weight of the delta's shape.

    What the adapter carries beyond LoRA deltas (:mod:`specmerge.io.formats.peft_variants`: DoRA, LoRA biases,
    ``modules_to_save``, trainable tokens) is read as the weight ``merge_and_unload`` gives (:class:`Dense`),
    computed from the base's tensor (``base``, which these need); :meth:`kind` says which tensors those are.
    """

    low_rank = True  # an adapter: it names the base's tensors and carries no tokenizer of its own

    def __init__(
        self, adapter: LoraAdapter, base_infos: Mapping[str, TensorInfo], base: TensorSource | None = None
    ) -> None:
        adapter.check_base(dict(base_infos))
        self.adapter = adapter
        self.path = adapter.path
        self._infos = dict(base_infos)
        self._modules = adapter.modules()
        self._dense = dense_variants(adapter, self._infos)  # name -> what it is (DoRA, bias, saved, tokens)
        if self._dense and base is None:
            raise AdapterError(f"{self.path}: its {', '.join(self.variant_kinds)} are read against the base's tensors")
        self._base = base

    def kind(self, name: str) -> str:
        """What :meth:`read` gives for ``name``, known before reading: ``dense`` (a variant's merged weight),
        ``low_rank`` (a LoRA delta) or ``zero``."""
        return "dense" if name in self._dense else "low_rank" if name in self._modules else "zero"

    @property
    def variant_kinds(self) -> list[str]:
        """What the adapter carries that is not a LoRA delta, in words (empty for a plain LoRA)."""
        return self.adapter.variants.kinds()

    @property
    def fan_in_fan_out(self) -> bool:
        """Whether the adapter's modules are Conv1D layers whose weights are stored (in, out) (PEFT's flag)."""
        return bool(self.adapter.config.get("fan_in_fan_out"))

    def infos(self) -> dict[str, TensorInfo]:
        return self._infos

    def changes(self, name: str) -> bool:
        """Whether the adapter changes base tensor ``name``."""
        return name in self._modules or name in self._dense

    def load_delta(self, name: str, rows: Rows = None) -> LoraDelta | None:
        """The delta of ``name`` (rows ``start:stop`` of it when given), or None where the adapter changes nothing."""
        if name not in self._modules:
            return None
        delta = self.adapter.load(name)
        return delta if rows is None else delta.rows(*rows)

    def read(self, name: str, rows: Rows = None) -> LowRank | Zero | Dense | StackedLowRank:
        if name in self._dense:
            weight = variant_weight(self.adapter, name, self._dense[name], self._base)
            return Dense(weight if rows is None else weight[rows[0] : rows[1]])
        module = self._modules.get(name)
        if module is not None and module.experts:  # LoRA on an expert stack: a delta per expert
            stack = StackedLowRank(tuple(self.adapter.load_stack(name)))
            return stack if rows is None else stack.rows(*rows)
        delta = self.load_delta(name, rows)
        if delta is not None:
            return LowRank(delta)
        shape = self._infos[name].shape
        return Zero(shape if rows is None or not shape else (rows[1] - rows[0], *shape[1:]))

    def stored_in_out_weights(self) -> frozenset[str]:
        """PEFT sets ``fan_in_fan_out`` exactly for Conv1D modules: then every adapted weight is stored (in, out)."""
        return frozenset(self._modules) if self.fan_in_fan_out else frozenset()

    def nonfinite(self, name: str, label: str) -> str | None:
        if name in self._dense:
            count = count_nonfinite(variant_weight(self.adapter, name, self._dense[name], self._base))
            return f"{count} entries of the merged {self._dense[name]} of {label} '{self.path}'" if count else None
        if name in self._modules and self._modules[name].experts:
            stack = self.read(name)
            count, total = stack.nonfinite_count(), sum(t.numel() for t in stack.tensors())
            return f"{count} of the {total} entries of the LoRA factors of {label} '{self.path}'" if count else None
        delta = self.load_delta(name)
        if delta is None:
            return None
        count = LowRank(delta).nonfinite_count()
        total = delta.B.numel() + delta.A.numel()
        return f"{count} of the {total} entries of the LoRA factors of {label} '{self.path}'" if count else None

    def describe(self) -> str:
        return f"PEFT LoRA adapter {self.path}"

    def files(self) -> list[Path]:
        """The real paths of the files the adapter reads (see :meth:`LoraAdapter.files`)."""
        return self.adapter.files()

    def close(self) -> None:
        self.adapter.close()


def open_expert(
    path: str | os.PathLike, base_infos: Mapping[str, TensorInfo], base: TensorSource | None = None
) -> CheckpointExpert | AdapterExpert:
    """An expert checkpoint (full weights), GGUF file or PEFT LoRA adapter folder, checked against the base's
    tensors (``base``: the base itself, which adapters with DoRA, biases, saved modules or tokens read)."""
    if str(path).endswith(GGUF_SUFFIX) and os.path.isfile(path):  # named as the base names its tensors
        return CheckpointExpert(open_gguf(path, base_infos))
    if not is_adapter(path):
        return CheckpointExpert(open_source(path))
    adapter = open_adapter(path)
    try:
        return AdapterExpert(adapter, base_infos, base)
    except BaseException:
        adapter.close()
        raise
