"""GPTQ and AWQ checkpoints: 2/4/8-bit integer codes packed into int32, with a scale and zero point per group.

Both store a linear layer transposed against ``nn.Linear``, as ``[in, out]``, and W = ((codes - zeros) * scales).T,
with ``scales`` ``[groups, out]`` in float16 (or bfloat16) and input row k in group ``g_idx[k]``:

- GPTQ (AutoGPTQ, GPTQModel; ``quant_method: gptq``): ``qweight`` ``[in*bits/32, out]`` packed along the input dim,
  ``qzeros`` ``[groups, out*bits/32]`` packed along the output dim (code i at bit i*bits of its run of words),
  ``g_idx`` ``[in]`` (rows reordered by activation order when ``desc_act``; k // group_size otherwise). The
  ``gptq`` checkpoint format (v1) stores each zero point minus one; ``gptq_v2`` stores it as it is.
- AWQ (AutoAWQ GEMM, ``quant_method: awq``, ``version: gemm``): ``qweight`` ``[in, out/8]`` and ``qzeros``
  ``[groups, out/8]`` packed along the output dim, the eight columns of each word in AutoAWQ's order
  (:data:`~specmerge.io.quant.packing.AWQ_ORDER`); input row k in group k // group_size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from specmerge.io.formats.protocol import Rows, TensorInfo
from specmerge.io.quant.packing import awq_columns, blocks_needed, contiguous_groups, unpack_int32
from specmerge.io.quant.scheme import Packed, QuantError, Read, Scheme, module_of, row_slice

PACKED_BITS = (2, 4, 8)  # codes that never straddle two int32 words


class GroupedInt(Scheme):
    """What GPTQ and AWQ share: their config, tensors by module, and the grouped dequantization."""

    method = ""

    def __init__(self, where: str, config: Mapping[str, Any]) -> None:
        super().__init__(where)
        self.bits = config.get("bits", config.get("w_bit", 4))
        self.group_size = config.get("group_size", config.get("q_group_size", 128))
        if self.bits not in self.allowed_bits or type(self.bits) is not int:
            raise QuantError(
                f"{where}: quantization_config ({self.method}) has bits {self.bits!r}; specmerge reads "
                f"{', '.join(map(str, self.allowed_bits))}-bit {self.method} checkpoints: merge the dense release"
            )
        if type(self.group_size) is not int or not (self.group_size > 0 or self.group_size == -1):
            raise QuantError(
                f"{where}: quantization_config group_size {self.group_size!r} is not a positive integer or -1"
            )
        pack = config.get("pack_dtype", "int32")
        if pack not in ("int32", "torch.int32"):
            raise QuantError(f"{where}: {self.method} codes packed in {pack}; specmerge reads codes packed in int32")

    allowed_bits: tuple[int, ...] = PACKED_BITS

    def shapes(self, infos: Mapping[str, TensorInfo], module: str) -> tuple[int, int, int]:
        """(in, out, groups) of ``module``, from its stored tensors."""
        raise NotImplementedError

    def packed(self, infos: Mapping[str, TensorInfo], read: Read) -> list[Packed]:
        found = []
        for name in infos:
            module = module_of(name, "qweight")
            if module is None:
                continue
            parts = {"codes": name, "zeros": f"{module}.qzeros", "scale": f"{module}.scales"}
            self.check(infos, name, None, "int")
            if len(infos[name].shape) != 2:
                raise self.error(name, f"has shape {tuple(infos[name].shape)}; a packed {self.method} weight is 2-D")
            fan_in, fan_out, groups = self.shapes(infos, module)
            self.check(infos, parts["scale"], (groups, fan_out), "float")
            self.check(infos, parts["zeros"], self.zero_shape(groups, fan_out), "int")
            if f"{module}.g_idx" in infos:
                parts["groups"] = f"{module}.g_idx"
                self.check(infos, parts["groups"], (fan_in,), "int")
            found.append(Packed(f"{module}.weight", (fan_out, fan_in), parts, {"groups": groups}))
        for name in infos:
            for stray in ("qzeros", "scales", "g_idx"):
                module = module_of(name, stray)
                if module is not None and f"{module}.qweight" not in infos:
                    raise self.error(name, f"has no {module}.qweight beside it")
        return found

    def zero_shape(self, groups: int, fan_out: int) -> tuple[int, int]:
        return groups, blocks_needed(fan_out * self.bits, 32)

    def group_count(self, fan_in: int) -> int:
        return 1 if self.group_size == -1 else blocks_needed(fan_in, self.group_size)

    def dequantize(self, packed: Packed, read: Read, rows: Rows) -> torch.Tensor:
        fan_out, fan_in = packed.shape
        cols = row_slice(rows, fan_out)  # rows of W are columns of the stored [in, out]
        codes = self.codes(read(packed.parts["codes"], None), fan_in, fan_out)[:, cols]
        zeros = self.zeros(read(packed.parts["zeros"], None), fan_out)[:, cols]
        scale = self.finite_scale(packed.parts["scale"], read(packed.parts["scale"], None)[:, cols])
        if "groups" in packed.parts:
            index = read(packed.parts["groups"], None).to(torch.int64)
            if int(index.min()) < 0 or int(index.max()) >= packed.detail["groups"]:
                raise self.error(packed.parts["groups"], f"names groups outside 0..{packed.detail['groups'] - 1}")
        else:
            index = contiguous_groups(fan_in, fan_in if self.group_size == -1 else self.group_size)
        out = codes.to(torch.float32).sub_(zeros.index_select(0, index)).mul_(scale.index_select(0, index))
        return out.T.contiguous()

    def codes(self, stored: torch.Tensor, fan_in: int, fan_out: int) -> torch.Tensor:
        raise NotImplementedError

    def zeros(self, stored: torch.Tensor, fan_out: int) -> torch.Tensor:
        raise NotImplementedError


class GPTQ(GroupedInt):
    """``quant_method: gptq`` (checkpoint formats ``gptq`` and ``gptq_v2``)."""

    method = "GPTQ"

    def __init__(self, where: str, config: Mapping[str, Any]) -> None:
        super().__init__(where, config)
        fmt = config.get("checkpoint_format", config.get("format", "gptq"))
        if fmt not in ("gptq", "gptq_v2"):
            raise QuantError(
                f"{where}: GPTQ checkpoint_format '{fmt}' (a kernel-specific repacking); specmerge reads the formats "
                "gptq and gptq_v2: merge the gptq-format release"
            )
        self.zero_offset = 1 if fmt == "gptq" else 0
        group = "one group" if self.group_size == -1 else f"groups of {self.group_size}"
        self.label = f"GPTQ {self.bits}-bit, {group}, format {fmt}"

    def shapes(self, infos: Mapping[str, TensorInfo], module: str) -> tuple[int, int, int]:
        packed_in, fan_out = infos[f"{module}.qweight"].shape
        g_idx, scales = infos.get(f"{module}.g_idx"), infos.get(f"{module}.scales")
        fan_in = g_idx.shape[0] if g_idx is not None and len(g_idx.shape) == 1 else packed_in * 32 // self.bits
        if blocks_needed(fan_in * self.bits, 32) != packed_in:
            raise self.error(f"{module}.qweight", f"has {packed_in} rows, which cannot hold {fan_in} inputs")
        if g_idx is None or scales is None or len(scales.shape) != 2:
            return fan_in, fan_out, self.group_count(fan_in)
        return fan_in, fan_out, scales.shape[0]  # g_idx says which group each input row is in

    def codes(self, stored: torch.Tensor, fan_in: int, fan_out: int) -> torch.Tensor:
        return unpack_int32(stored, self.bits, fan_in, dim=0)

    def zeros(self, stored: torch.Tensor, fan_out: int) -> torch.Tensor:
        return (unpack_int32(stored, self.bits, fan_out, dim=1) + self.zero_offset).to(torch.float32)


class AWQ(GroupedInt):
    """``quant_method: awq`` with ``version: gemm`` (AutoAWQ's GEMM layout)."""

    method = "AWQ"
    allowed_bits = (4,)

    def __init__(self, where: str, config: Mapping[str, Any]) -> None:
        super().__init__(where, config)
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantError(
                f"{where}: AWQ version '{version}'; specmerge reads the GEMM layout (version gemm) only: merge the "
                "GEMM release or the dense model"
            )
        if config.get("zero_point", True) is not True:
            raise QuantError(f"{where}: AWQ without zero points (zero_point: false) is not read by specmerge")
        if self.group_size == -1:
            raise QuantError(f"{where}: AWQ with group_size -1 is not read by specmerge")
        self.label = f"AWQ 4-bit GEMM, groups of {self.group_size}"

    def shapes(self, infos: Mapping[str, TensorInfo], module: str) -> tuple[int, int, int]:
        fan_in, packed_out = infos[f"{module}.qweight"].shape
        return fan_in, packed_out * 8, self.group_count(fan_in)

    def codes(self, stored: torch.Tensor, fan_in: int, fan_out: int) -> torch.Tensor:
        return awq_columns(unpack_int32(stored, 4, fan_out, dim=1))

    def zeros(self, stored: torch.Tensor, fan_out: int) -> torch.Tensor:
        return awq_columns(unpack_int32(stored, 4, fan_out, dim=1)).to(torch.float32)
