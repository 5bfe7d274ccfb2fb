"""A quantized checkpoint read as a dense one: every quantized weight dequantized when, and only when, it is read.

:func:`dequantized` wraps a :class:`~specmerge.io.formats.protocol.TensorSource` whose config states a
quantization (:func:`~specmerge.io.quant.detect.scheme_of`) in a :class:`QuantizedSource`: its ``infos()`` are
the dense model's (each quantized weight under its dense name and shape, in the dtype the model was quantized
from; the codes, scales and zero points it is made of are gone), and ``load`` dequantizes one weight (or a block
of its rows) in float32, so the merge sees the dense weights and memory stays one tensor at a time. A checkpoint
whose config states no quantization but that holds quantized-looking tensors is refused.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

from specmerge.io.formats.layout import config_file, read_config
from specmerge.io.formats.protocol import Closing, Rows, SourceError, TensorInfo, TensorSource, no_such_tensor
from specmerge.io.quant.detect import quantization_config, quantized_marker, scheme_of, unstated
from specmerge.io.quant.scheme import Packed, QuantError, Scheme

LOG = logging.getLogger("specmerge.inputs")  # what the console says of the inputs (see specmerge.io.hub.ids)
DENSE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class QuantizedSource(Closing):
    """A quantized checkpoint seen as the dense one it stands for (see the module docstring)."""

    def __init__(self, raw: TensorSource, scheme: Scheme, config: dict[str, Any], config_path: Path | None) -> None:
        self.raw, self.scheme, self.path = raw, scheme, raw.path
        self._config, self._config_path = config, config_path
        self._infos: dict[str, TensorInfo] | None = None  # read when first asked for, as the readers do
        self._lock = threading.Lock()

    def _prepare(self) -> dict[str, TensorInfo]:
        """The dense model's infos, found (and every stored tensor checked against the scheme) on first use."""
        with self._lock:
            if self._infos is None:
                self._infos = self._dense_infos()
            return self._infos

    def _dense_infos(self) -> dict[str, TensorInfo]:
        raw, scheme = self.raw, self.scheme
        stored = raw.infos()
        packed = scheme.packed(stored, raw.load)
        self.packed: dict[str, Packed] = {p.name: p for p in packed}
        parts = {part for p in packed for part in p.parts.values()}
        self.dropped = [
            n for n in stored if n not in parts and any(n.endswith("." + s) for s in scheme.dropped_suffixes)
        ]
        marker = quantized_marker(stored, skip=frozenset(parts) | frozenset(self.dropped))
        if marker is not None:
            raise scheme.error(marker[0], f"is {marker[1]}, which the scheme does not account for")
        if not packed and not self.dropped and not scheme.stores_dense:
            raise QuantError(
                f"{raw.describe()}: config.json says the weights are quantized ({scheme.label}), but no tensor is "
                "stored quantized: the config does not match the weights; fix or remove its quantization_config"
            )
        self.dense_dtype = dense_dtype(self._config, stored, packed)
        by_codes = {p.parts["codes"]: p for p in packed}
        infos: dict[str, TensorInfo] = {}
        for name, info in stored.items():
            if name in by_codes:
                p = by_codes[name]
                if p.name in stored and p.name != name:
                    raise scheme.error(p.name, f"is stored beside {name}, which stands for the same weight")
                infos[p.name] = TensorInfo(p.name, tuple(p.shape), self.dense_dtype)
            elif name not in parts and name not in self.dropped:
                infos[name] = info
        dropped = f"; {len(self.dropped)} activation scales dropped (a dense model has no use for them)"
        LOG.info(
            f"{raw.path}: {scheme.label}: {len(packed)} weights dequantized on read (float32), "
            f"standing for {self.dense_dtype}".replace("torch.", "")
            + (dropped if self.dropped else "")
        )
        return infos

    def infos(self) -> dict[str, TensorInfo]:
        return dict(self._prepare())

    def load(self, name: str, rows: Rows = None) -> torch.Tensor:
        infos = self._prepare()
        packed = self.packed.get(name)
        if packed is None:
            if name not in infos:
                raise no_such_tensor(self.describe(), name, list(infos))
            return self.raw.load(name, rows)
        shape = packed.shape
        if rows is not None and not 0 <= rows[0] <= rows[1] <= shape[0]:
            raise SourceError(f"{self.path}: rows {rows} out of range for tensor '{name}' of shape {shape}")
        dense = self.scheme.dequantize(packed, self.raw.load, rows)
        expected = shape if rows is None else (rows[1] - rows[0], *shape[1:])
        if tuple(dense.shape) != tuple(expected):  # a scheme's own slip, never the user's input
            raise QuantError(f"{self.path}: '{name}' dequantized to shape {tuple(dense.shape)}, not {expected}")
        return dense

    def describe(self) -> str:
        return f"{self.raw.describe()}, quantized: {self.scheme.label}"

    def files(self) -> list[Path]:
        config = [Path(os.path.realpath(self._config_path))] if self._config_path is not None else []
        return self.raw.files() + config

    def close(self) -> None:
        self.raw.close()

    @property
    def quantization_config(self) -> dict[str, Any]:
        """The config.json section that states the scheme."""
        return dict(quantization_config(self._config) or {})

    def summary(self) -> dict[str, Any]:
        """What report.json says of this input: the scheme, how many weights were dequantized, what was dropped."""
        self._prepare()
        return {"scheme": self.scheme.label, "dequantized": len(self.packed), "dropped": list(self.dropped)}


def quantization_note(item: Any) -> dict[str, Any] | None:
    """What report.json says of an opened input (a source, or an expert reading one) that was quantized; None
    when it was not."""
    source = getattr(item, "source", item)
    return source.summary() if isinstance(source, QuantizedSource) else None


def dense_dtype(config: dict[str, Any], stored: dict[str, TensorInfo], packed: list[Packed]) -> torch.dtype:
    """The dtype the model was quantized from: config.json's ``torch_dtype`` (or ``dtype``), else the scales'."""
    for key in ("torch_dtype", "dtype"):
        if config.get(key) in DENSE_DTYPES:
            return DENSE_DTYPES[config[key]]
    scales = [stored[p.parts["scale"]].dtype for p in packed if p.parts.get("scale") in stored]
    floats = [d for d in scales if d in DENSE_DTYPES.values() and d != torch.float32]
    return floats[0] if floats else torch.bfloat16


def dequantized(raw: TensorSource, base: str | os.PathLike) -> TensorSource:
    """``raw`` (opened from ``base``) as a dense checkpoint: wrapped in a :class:`QuantizedSource` when its
    config.json states a quantization, as it is when nothing about it is quantized; refused otherwise."""
    config = read_config(base)
    where = raw.describe()
    scheme = scheme_of(config, where)
    if scheme is None:

        def refuse_codes(infos: dict[str, TensorInfo]) -> None:
            marker = quantized_marker(infos)
            if marker is not None:
                raise unstated(where, *marker)

        checks = getattr(raw, "checks", None)
        if checks is None:
            refuse_codes(raw.infos())
        else:  # when the reader first reads its infos: opening stays lazy
            checks.append(refuse_codes)
        return raw
    return QuantizedSource(raw, scheme, config or {}, config_file(base))
