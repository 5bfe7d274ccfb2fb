"""A merged model written in FP8 (``--quantize fp8-block`` or ``same``): each linear weight as float8 codes and scales.

``fp8-block`` writes what DeepSeek-V3 and the Qwen3 "-FP8" releases ship and transformers loads
(``quant_method: fp8``): ``<m>.weight`` in float8_e4m3fn and ``<m>.weight_scale_inv`` in float32, one scale per
128 x 128 block (the block's largest magnitude / 448, so that every code is finite), W = codes * scale.
``same`` writes the base's own FP8 scheme (transformers' ``fp8`` with its block size, or per tensor; or
``fbgemm_fp8``, a scale per output channel), for the weights the base stored quantized, with the base's
``quantization_config``. Every quantized weight's relative error ||deq(q(W)) - W||_F / ||W||_F is recorded.

:class:`OutputQuantizer` is given the dense tensors the merge writes (names, shapes, dtypes) and which of them to
quantize; it gives the stored tensors' infos (for the shard writer) and a sink that quantizes on the way to the
writer (a tensor written in blocks of rows is gathered first: one tensor in memory).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from specmerge.io.formats.protocol import TensorInfo
from specmerge.io.quant.fp8 import scaled_blocks

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
BLOCK = (128, 128)
FP8_BLOCK_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def fp8_codes(weight: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 codes of a 2-D ``weight`` and its float32 scales: one per ``block`` (``[ceil(rows/bo),
    ceil(cols/bi)]``), or one number (None). Each scale is its block's largest magnitude / 448 (1 for a zero block)."""
    w = weight.to(torch.float32)
    rows, cols = w.shape
    bo, bi = block or (rows, cols)
    pr, pc = math.ceil(rows / bo) * bo, math.ceil(cols / bi) * bi
    padded = torch.nn.functional.pad(w, (0, pc - cols, 0, pr - rows)).reshape(pr // bo, bo, pc // bi, bi)
    amax = padded.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (padded / scale[:, None, :, None]).reshape(pr, pc)[:rows, :cols].to(FP8).contiguous()
    return codes, (scale if block else scale.reshape(()))


def fp8_channel_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 codes of a 2-D ``weight`` and a float32 scale per output channel ``[out, 1]`` (fbgemm_fp8)."""
    w = weight.to(torch.float32)
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / scale).to(FP8), scale


class OutputQuantizer:
    """Writes the ``targets`` of a merged model quantized in ``layout``: ``("block", (bo, bi))``, ``("tensor",
    None)`` (transformers' fp8) or ``("channel", None)`` (fbgemm_fp8); ``config``: the output's
    quantization_config."""

    def __init__(self, targets: Sequence[str], layout: tuple[str, Any], config: Mapping[str, Any]) -> None:
        self.targets, self.layout, self.config = frozenset(targets), layout, dict(config)
        self.errors: dict[str, float] = {}
        self._pending: dict[str, tuple[torch.Tensor, int]] = {}  # rows written so far of a target written in blocks
        self._lock = threading.Lock()

    @property
    def scale_suffix(self) -> str:
        return "weight_scale" if self.layout[0] == "channel" else "weight_scale_inv"

    def scale_name(self, name: str) -> str:
        return f"{name.removesuffix('.weight')}.{self.scale_suffix}"

    def stored(self, infos: Sequence[TensorInfo]) -> list[TensorInfo]:
        """The tensors written for the dense ``infos``: each target as its codes and its scales."""
        out = []
        for info in infos:
            if info.name not in self.targets:
                out.append(info)
                continue
            rows, cols = info.shape
            codes = TensorInfo(info.name, (rows, cols), FP8)
            out += [codes, TensorInfo(self.scale_name(info.name), self.scale_shape(rows, cols), torch.float32)]
        return out

    def scale_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        """The shape of a ``rows x cols`` weight's scales in this layout."""
        kind, block = self.layout
        if kind == "block":
            return math.ceil(rows / block[0]), math.ceil(cols / block[1])
        return (rows, 1) if kind == "channel" else ()

    def sink(self, write: Callable[..., None], shapes: Mapping[str, tuple[int, ...]]) -> Callable[..., None]:
        """``write(name, tensor, row_start=...)`` that quantizes the targets (gathering a target's row blocks)."""

        def quantizing(name: str, tensor: torch.Tensor, *, row_start: int | None = None) -> None:
            if name not in self.targets:
                write(name, tensor, row_start=row_start)
                return
            if row_start is not None:
                with self._lock:
                    whole, done = self._pending.get(name) or (torch.empty(shapes[name], dtype=tensor.dtype), 0)
                    whole[row_start : row_start + tensor.shape[0]] = tensor
                    done += tensor.shape[0]
                    self._pending[name] = (whole, done)
                    if done < shapes[name][0]:
                        return
                    del self._pending[name]
                tensor = whole
            codes, scale = self.quantize(tensor)
            dense = tensor.to(torch.float64)
            back = scaled_blocks(codes, scale, self.layout[1]) if self.layout[0] != "channel" else codes.float() * scale
            norm = float(dense.norm())
            self.errors[name] = float((back.to(torch.float64) - dense).norm()) / norm if norm else 0.0
            write(name, codes)
            write(self.scale_name(name), scale)

        return quantizing

    def quantize(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kind, block = self.layout
        return fp8_channel_codes(tensor) if kind == "channel" else fp8_codes(tensor, block if kind == "block" else None)

    def summary(self) -> dict[str, Any]:
        """report.json's ``quantization``: the scheme, each weight's relative error, the largest one."""
        worst = max(self.errors.items(), key=lambda kv: kv[1], default=(None, 0.0))
        return {
            "config": self.config,
            "weights": len(self.errors),
            "relative_error": dict(self.errors),
            "largest": {"tensor": worst[0], "relative_error": worst[1]},
        }
