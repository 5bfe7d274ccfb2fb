"""bitsandbytes checkpoints as transformers serializes them (``quant_method: bitsandbytes``): nf4/fp4 and int8.

4-bit (``load_in_4bit``; QLoRA bases such as the "-bnb-4bit" releases): ``<m>.weight`` holds the codes, two a byte
(the high nibble first), flattened and padded to whole bytes (stored as uint8, or viewed as another dtype with
``bnb_4bit_quant_storage``); ``<m>.weight.quant_map`` the 16 values a code stands for; ``<m>.weight.absmax`` a scale
per ``blocksize`` consecutive values (the last block may be partial); ``<m>.weight.quant_state.bitsandbytes__nf4``
(or ``__fp4``) the JSON of the rest: ``shape``, ``blocksize``, ``dtype``, and with double quantization
``nested_blocksize`` and ``nested_offset``, the absmax then being uint8 codes of ``<m>.weight.nested_quant_map``
scaled per nested block by ``<m>.weight.nested_absmax``, plus the offset. W = quant_map[code] * absmax[block].

8-bit (``load_in_8bit``, LLM.int8): ``<m>.weight`` int8 ``[out, in]`` and ``<m>.SCB`` float32 ``[out]`` (each row's
absolute maximum), ``<m>.weight_format`` (``row``, the only layout); W = code * SCB * (1/127 in float32,
as bitsandbytes computes it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import torch

from specmerge.io.formats.protocol import Rows, TensorInfo
from specmerge.io.quant.scheme import Packed, QuantError, Read, Scheme, row_slice

STATE = ".quant_state.bitsandbytes__"
INV_127 = 7.874015718698502e-3  # bitsandbytes multiplies by this float32 rounding of 1/127


class Bitsandbytes(Scheme):
    """``quant_method: bitsandbytes``, 4-bit (nf4, fp4; nested or not) and 8-bit, by the tensors each module holds."""

    label = "bitsandbytes"
    dropped_suffixes = ("weight_format",)

    def packed(self, infos: Mapping[str, TensorInfo], read: Read) -> list[Packed]:
        found = []
        for name in infos:
            if STATE in name:
                found.append(self._four_bit(infos, name, read))
            elif name.endswith(".SCB"):
                found.append(self._eight_bit(infos, name))
        return found

    def _four_bit(self, infos: Mapping[str, TensorInfo], name: str, read: Read) -> Packed:
        weight = name[: name.index(STATE)]
        kind = name[name.index(STATE) + len(STATE) :]
        try:
            state = json.loads(bytes(read(name, None).to(torch.uint8).tolist()).decode("utf-8"))
            shape, blocksize = tuple(int(d) for d in state["shape"]), int(state["blocksize"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
            raise self.error(name, f"is not a bitsandbytes quantization state ({err})") from None
        count = math.prod(shape)
        if kind not in ("nf4", "fp4") or blocksize <= 0 or len(shape) != 2:
            raise self.error(name, f"states {kind} with blocksize {blocksize} for shape {shape}")
        self.check(infos, weight, None, "int|float|fp8")
        if infos[weight].nbytes != math.ceil(count / 2):
            raise self.error(weight, f"holds {infos[weight].nbytes} bytes, not the {math.ceil(count / 2)} of {shape}")
        blocks = math.ceil(count / blocksize)
        parts = {"codes": weight, "state": name, "map": f"{weight}.quant_map", "absmax": f"{weight}.absmax"}
        self.check(infos, parts["map"], (16,), "float")
        detail = {"blocksize": blocksize}
        if "nested_blocksize" in state:
            nested = int(state["nested_blocksize"])
            parts |= {"nested_absmax": f"{weight}.nested_absmax", "nested_map": f"{weight}.nested_quant_map"}
            self.check(infos, parts["absmax"], (blocks,), "int")
            self.check(infos, parts["nested_map"], (256,), "float")
            self.check(infos, parts["nested_absmax"], (math.ceil(blocks / max(nested, 1)),), "float")
            detail |= {"nested_blocksize": nested, "offset": float(state.get("nested_offset", 0.0))}
        else:
            self.check(infos, parts["absmax"], (blocks,), "float")
        return Packed(weight, shape, parts, detail)

    def _eight_bit(self, infos: Mapping[str, TensorInfo], name: str) -> Packed:
        weight = f"{name[: -len('.SCB')]}.weight"
        self.check(infos, weight, None, "int")
        shape = tuple(infos[weight].shape)
        if len(shape) != 2 or infos[weight].dtype != torch.int8:
            raise self.error(weight, f"is {infos[weight].dtype} of shape {shape}; LLM.int8 weights are 2-D int8")
        self.check(infos, name, (shape[0],), "float")
        return Packed(weight, shape, {"codes": weight, "scale": name}, {"int8": True})

    def dequantize(self, packed: Packed, read: Read, rows: Rows) -> torch.Tensor:
        parts, detail = packed.parts, packed.detail
        if detail.get("int8"):
            scale = self.finite_scale(parts["scale"], read(parts["scale"], rows))
            return read(parts["codes"], rows).to(torch.float32).mul_(scale.unsqueeze(1)).mul_(INV_127)
        stored = read(parts["codes"], None).contiguous().view(torch.uint8).reshape(-1)
        codes = torch.empty(stored.numel() * 2, dtype=torch.int64)
        codes[0::2], codes[1::2] = stored >> 4, stored & 0x0F
        count = math.prod(packed.shape)
        values = read(parts["map"], None).to(torch.float32)[codes[:count]]
        absmax = self._absmax(packed, read)
        size = detail["blocksize"]
        values = torch.nn.functional.pad(values, (0, absmax.numel() * size - count)).reshape(-1, size)
        dense = values.mul_(absmax.unsqueeze(1)).reshape(-1)[:count].reshape(packed.shape)
        return dense[row_slice(rows, packed.shape[0])]

    def _absmax(self, packed: Packed, read: Read) -> torch.Tensor:
        parts, detail = packed.parts, packed.detail
        if "nested_map" not in parts:
            return self.finite_scale(parts["absmax"], read(parts["absmax"], None))
        codes = read(parts["absmax"], None).to(torch.int64)
        nested = self.finite_scale(parts["nested_absmax"], read(parts["nested_absmax"], None))
        size = detail["nested_blocksize"]
        values = read(parts["nested_map"], None).to(torch.float32)[codes]
        padded = torch.nn.functional.pad(values, (0, nested.numel() * size - values.numel())).reshape(-1, size)
        absmax = padded.mul_(nested.unsqueeze(1)).reshape(-1)[: values.numel()] + detail["offset"]
        if not bool(torch.isfinite(absmax).all()):
            raise QuantError(f"{self.where}: '{parts['absmax']}' decodes to NaN or infinite scales; re-download it")
        return absmax
