"""What a quantization scheme is to a reader: which stored tensors make up each dense weight, and how to decode it.

A :class:`Scheme` is built from a checkpoint's ``quantization_config`` (:mod:`.detect`). ``packed(infos)`` finds
every dense weight the checkpoint stores quantized, as a :class:`Packed` (its dense name and shape, and the stored
tensors it is made of, by role: codes, scale, zeros, group index), checking every shape against the scheme before
any data is read; ``dequantize`` gives rows of one dense weight in float32. ``dropped`` names stored tensors the
dense model has no use for (static activation scales): the reader leaves them out and says so.

Every problem is a :class:`QuantError` that names the tensor and the scheme.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from specmerge.io.formats.protocol import Rows, SourceError, TensorInfo

Read = Callable[[str, Rows], torch.Tensor]  # a stored tensor (or rows start:stop of it), in its stored dtype


class QuantError(SourceError):
    """A quantized checkpoint that cannot be read exactly; the message names the tensor, the scheme and what to do."""


@dataclass(frozen=True)
class Packed:
    """One dense weight stored quantized: its name and shape as the dense model has them, and its stored parts."""

    name: str
    shape: tuple[int, ...]
    parts: Mapping[str, str]  # role ("codes", "scale", "zeros", "groups", ...) -> stored tensor name
    detail: Mapping[str, object] = field(default_factory=dict)  # what the scheme read of it (bits, group size ...)


class Scheme:
    """A quantization scheme of one checkpoint (subclasses: one per family of layouts)."""

    label = ""  # how messages name it: "fp8 (128 x 128 blocks)", "GPTQ 4-bit, groups of 128", ...
    dropped_suffixes: tuple[str, ...] = ()  # stored tensors with no use in a dense model (activation scales)
    stores_dense = False  # the config names a quantization, but every weight is stored dense (nothing to decode)

    def __init__(self, where: str) -> None:
        self.where = where  # the checkpoint, for messages

    def packed(self, infos: Mapping[str, TensorInfo], read: Read) -> list[Packed]:
        """Every dense weight stored quantized, checked against the stored shapes and dtypes (``read``: tiny
        tensors some layouts keep the dense shape in)."""
        raise NotImplementedError

    def dequantize(self, packed: Packed, read: Read, rows: Rows) -> torch.Tensor:
        """Rows ``start:stop`` of the dense weight (all of it for None), in float32."""
        raise NotImplementedError

    def error(self, name: str, problem: str, fix: str = "") -> QuantError:
        """The one-line error for stored tensor ``name`` (``fix``: what to do, when not the usual)."""
        fix = (
            fix
            or "the checkpoint does not match its quantization_config: re-download it, or merge the unquantized release"
        )
        return QuantError(f"{self.where}: tensor '{name}' {problem} ({self.label}); {fix}")

    def check(self, infos: Mapping[str, TensorInfo], name: str, shape: tuple[int, ...] | None, kinds: str) -> None:
        """Refuse stored tensor ``name`` when it is missing, not of ``shape`` (None: any) or of another kind of
        number than ``kinds`` ("float", "int", "fp8")."""
        info = infos.get(name)
        if info is None:
            raise self.error(name, "is missing")
        if shape is not None and tuple(info.shape) != tuple(shape):
            raise self.error(name, f"has shape {tuple(info.shape)} where {tuple(shape)} was expected")
        if number_kind(info.dtype) not in kinds.split("|"):
            raise self.error(name, f"is {info.dtype}, not {kinds.replace('|', ' or ')}")

    def finite_scale(self, name: str, scale: torch.Tensor) -> torch.Tensor:
        """``scale`` in float32, refused when it holds NaN or Inf (every weight it scales would)."""
        scale = scale.to(torch.float32)
        bad = scale.numel() - int(torch.isfinite(scale).sum())
        if bad:
            raise self.error(
                name,
                f"holds {bad} NaN or infinite scales of {scale.numel()}",
                "the checkpoint is corrupt: re-download it",
            )
        return scale


def number_kind(dtype: torch.dtype) -> str:
    """``fp8`` (8-bit floats), ``float`` (other floats) or ``int`` (integers and bool)."""
    if dtype.is_floating_point:
        return "fp8" if dtype.itemsize == 1 else "float"
    return "int"


def row_slice(rows: Rows, length: int) -> slice:
    """``rows`` as a slice of a dimension of ``length``."""
    return slice(0, length) if rows is None else slice(rows[0], rows[1])


def block_rows(rows: Rows, block: int) -> Rows:
    """The rows of a per-block scale that rows ``start:stop`` of the weight need."""
    if rows is None:
        return None
    return rows[0] // block, math.ceil(rows[1] / block)


def module_of(name: str, suffix: str) -> str | None:
    """``name`` without ``.suffix`` (None when it does not end so)."""
    end = "." + suffix
    return name[: -len(end)] if name.endswith(end) else None
