"""Checkpoints held in memory: a state dict read as a checkpoint, a PEFT model as an expert.

:class:`MemorySource` serves a mapping of names to tensors (a ``state_dict()``) the way the file readers serve a
checkpoint: ``infos()`` from the tensors' shapes and dtypes, ``load(name, rows)`` a new contiguous copy on the
CPU, detached from autograd. A merge therefore never aliases, moves or modifies the caller's tensors, whatever
they are: non-contiguous views, on a GPU, requiring grad. Tied weights (two names viewing the same memory, such
as ``embed_tokens`` and ``lm_head``) are one tensor, as Hugging Face stores them: the source serves the first
name and :attr:`MemorySource.aliases` maps the others to it.

A model wrapped by PEFT holds its base weights under ``base_layer`` (``original_module`` for modules_to_save)
next to the adapters' tensors; :func:`unwrapped_weights` gives the weights as the model had them before PEFT
wrapped it (the adapters not applied). :func:`peft_adapter` takes the active LoRA adapter of a PEFT model as the
tensors and config that ``save_pretrained`` would write, and :class:`MemoryAdapterExpert` serves them as an
:class:`~specmerge.io.views.experts.AdapterExpert`, whose task vectors are low-rank (merged exactly in factored form).
PEFT itself is not imported: a PEFT model is recognized by its ``peft_config``.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from specmerge.io.formats.peft import AdapterError, LoraAdapter
from specmerge.io.formats.protocol import Closing, SourceError, TensorInfo, TensorSource, no_such_tensor
from specmerge.io.quant.detect import quantized_marker, unstated
from specmerge.io.views.experts import AdapterExpert

# Name components of the tensors PEFT adds to a model (LoRA factors, DoRA magnitudes, modules_to_save copies).
PEFT_COMPONENTS = frozenset(
    {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector", "modules_to_save"}
)
LORA_FACTORS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"})
# Name components PEFT puts between a wrapped module and its own weights.
PEFT_WRAPPERS = frozenset({"base_layer", "original_module"})
PEFT_MODEL_PREFIX = "base_model.model."  # a PeftModel's state_dict names its wrapped model's tensors so


def is_peft_model(obj: Any) -> bool:
    """Whether ``obj`` is a PEFT model (``peft.PeftModel`` or one of its task classes): a module with a
    ``peft_config`` and ``get_base_model`` (the model it wrapped in place has the config, not the method)."""
    return (
        isinstance(obj, torch.nn.Module)
        and isinstance(getattr(obj, "peft_config", None), Mapping)
        and callable(getattr(obj, "get_base_model", None))
    )


def peft_tensor(names: Mapping[str, Any] | list[str]) -> str | None:
    """The first of ``names`` that PEFT added to a model (a LoRA factor, ...), or None when there is none."""
    return next((name for name in names if not PEFT_COMPONENTS.isdisjoint(name.split("."))), None)


def unwrapped_weights(tensors: Mapping[str, torch.Tensor], *, prefixed: bool) -> dict[str, torch.Tensor]:
    """The weights of a model that PEFT wrapped, in the names they had before (``q_proj.base_layer.weight`` is
    ``q_proj.weight``), without the tensors PEFT added; ``prefixed``: names start with ``base_model.model.``
    (a PeftModel's own state dict)."""
    out = {}
    for name, tensor in tensors.items():
        if peft_tensor([name]) is not None:
            continue
        if prefixed:
            name = name.removeprefix(PEFT_MODEL_PREFIX)
        out[".".join(part for part in name.split(".") if part not in PEFT_WRAPPERS)] = tensor
    return out


def storage_key(tensor: torch.Tensor) -> tuple | None:
    """What makes two tensors the same memory seen the same way (None for empty tensors: nothing to share)."""
    if tensor.numel() == 0:
        return None
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tensor.dtype,
        tuple(tensor.shape),
        tensor.stride(),
    )


MEMORY_FIX = (
    "a state dict in memory is merged as plain weights: dequantize the model first (transformers: load it with "
    "the quantization config's dequantize option, or merge the checkpoint folder, which specmerge dequantizes)"
)


class MemorySource(Closing):
    """A mapping of names to tensors read as a checkpoint (see the module docstring). ``label`` names it in
    messages (``path`` is ``Path(label)``); the mapping is copied, the tensors are not."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], label: str) -> None:
        self.path = Path(label)
        self.label = label
        self._tensors: dict[str, torch.Tensor] = {}
        self.aliases: dict[str, str] = {}  # a tied name -> the first name viewing the same memory
        first: dict[tuple, str] = {}
        for name, tensor in tensors.items():
            _check_tensor(name, tensor, label)
            key = storage_key(tensor)
            if key is not None and key in first:
                self.aliases[name] = first[key]
                continue
            if key is not None:
                first[key] = name
            self._tensors[name] = tensor
        self._infos = {n: TensorInfo(n, tuple(t.shape), t.dtype) for n, t in self._tensors.items()}
        marker = quantized_marker(self._infos)
        if marker is not None:  # a quantized model's state dict: its codes are not weights
            raise unstated(label, *marker, fix=MEMORY_FIX)

    def infos(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def load(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        tensor = self._tensors.get(name)
        if tensor is None:
            raise no_such_tensor(self.describe(), name, list(self._tensors))
        if rows is not None:
            if not tensor.dim() or not 0 <= rows[0] <= rows[1] <= tensor.shape[0]:
                raise SourceError(f"{self.label}: rows {rows} out of range for tensor '{name}' of {tensor.shape}")
            tensor = tensor[rows[0] : rows[1]]
        return tensor.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)

    def describe(self) -> str:
        return f"in-memory state dict {self.label} ({len(self._tensors)} tensors)"

    def files(self) -> list[Path]:
        return []

    def close(self) -> None:
        self._tensors.clear()


def _check_tensor(name: Any, tensor: Any, label: str) -> None:
    if not isinstance(name, str):
        raise SourceError(f"{label}: tensor names are strings, got {type(name).__name__} {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise SourceError(
            f"{label}: '{name}' is a {type(tensor).__name__}, not a torch.Tensor: a state dict maps names to tensors"
        )
    if tensor.layout != torch.strided:
        raise SourceError(f"{label}: tensor '{name}' is {tensor.layout}: give it dense (tensor.to_dense())")
    if tensor.device.type == "meta":
        raise SourceError(f"{label}: tensor '{name}' is on the meta device (no values): load the weights first")


def peft_adapter(model: torch.nn.Module, label: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The active adapter of PEFT model ``model`` as ``save_pretrained`` writes it: its config (JSON values) and
    its tensors named ``base_model.model.<module>.lora_A.weight`` (the adapter's name left out), not copied."""
    name = getattr(model, "active_adapter", None)
    if not isinstance(name, str) or name not in model.peft_config:
        raise AdapterError(
            f"{label}: a PEFT model with one active adapter is expected, got active adapter {name!r}: "
            "set one with model.set_adapter(name)"
        )
    config = model.peft_config[name]
    values = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    config_dict = json.loads(json.dumps(values, default=_json_value))
    tensors = {}
    for key, tensor in model.state_dict().items():
        parts = key.split(".")
        at = next((i for i, part in enumerate(parts[:-1]) if part in PEFT_COMPONENTS), None)
        if at is None or parts[at + 1] != name:
            continue  # a base weight, or another adapter's tensor
        tensors[".".join(parts[: at + 1] + parts[at + 2 :])] = tensor
    return config_dict, tensors


def _json_value(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value)
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"{type(value).__name__} {value!r} is not a JSON value")


class MemoryAdapterExpert(AdapterExpert):
    """A LoRA adapter given as its config and tensors (:func:`peft_adapter`), as an expert of a base model: read by
    the same code as an adapter folder (:class:`~specmerge.io.formats.peft.LoraAdapter`, with its checks and messages),
    from a :class:`MemorySource` of its tensors; messages name it ``label``."""

    def __init__(
        self,
        config: Mapping[str, Any],
        tensors: Mapping[str, torch.Tensor],
        base_infos: Mapping,
        label: str,
        base: TensorSource | None = None,
    ) -> None:
        adapter = LoraAdapter(
            Path(label), dict(config), MemorySource(tensors, label), config_name=f"{label}'s adapter config"
        )
        try:
            super().__init__(adapter, base_infos, base)
        except BaseException:
            adapter.close()
            raise

    def describe(self) -> str:
        return f"PEFT LoRA adapter {self.path} (in memory)"
