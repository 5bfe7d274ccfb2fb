"""FP8 checkpoints as transformers writes and reads them: ``quant_method: fp8`` and ``fbgemm_fp8``.

``fp8`` (DeepSeek-V3/R1, the Qwen3 "-FP8" releases; transformers' FineGrainedFP8): ``<m>.weight`` in float8 of
shape ``[..., out, in]`` and ``<m>.weight_scale_inv`` of shape ``[..., ceil(out/bo), ceil(in/bi)]`` for
``weight_block_size: [bo, bi]`` (one scalar when the block size is null: per-tensor); despite its name the
scale multiplies: W = float(codes) * scale over each block (``scale_fmt: ue8m0`` stores it as a power of two in
float8_e8m0fnu; the value is the same). ``fbgemm_fp8``: ``<m>.weight`` in float8 ``[out, in]`` and
``<m>.weight_scale`` ``[out, 1]`` (per output channel). Static activation scales (``input_scale``,
``activation_scale``) belong to the quantized matmul only and are dropped from a dense model.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from specmerge.io.formats.protocol import Rows, TensorInfo
from specmerge.io.quant.packing import blocks_needed
from specmerge.io.quant.scheme import Packed, QuantError, Read, Scheme, block_rows, module_of, number_kind

ACTIVATION_SCALES = ("input_scale", "activation_scale", "input_scale_ub")


def scaled_blocks(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, first: int = 0):
    """float(codes) times its scale, in float32: one scalar (``block`` None), or one per ``block`` = (bo, bi) over
    the last two dims, ``scale`` being ``[..., ceil(rows/bo), ceil(cols/bi)]``. ``first``: the row of the first
    block at which ``codes`` starts (a block of rows read from the middle of a 2-D weight)."""
    out = codes.to(torch.float32)
    if block is None:
        return out.mul_(scale.reshape(()))
    rows, cols = out.shape[-2:]
    per_row = scale.repeat_interleave(block[0], dim=-2)[..., first : first + rows, :]  # [..., rows, col blocks]
    full, rest = divmod(cols, block[1])
    out[..., : full * block[1]].unflatten(-1, (full, block[1])).mul_(per_row[..., :full, None])
    if rest:
        out[..., full * block[1] :].mul_(per_row[..., full : full + 1])
    return out


class FineGrainedFP8(Scheme):
    """``quant_method: fp8``: float8 weights with a float32 scale per block (or per tensor)."""

    dropped_suffixes = ACTIVATION_SCALES

    def __init__(self, where: str, config: Mapping) -> None:
        super().__init__(where)
        size = config.get("weight_block_size", [128, 128])
        if size is not None and not (
            isinstance(size, list | tuple) and len(size) == 2 and all(type(v) is int and v > 0 for v in size)
        ):
            raise QuantError(
                f"{where}: quantization_config weight_block_size is {size!r}; expected two positive integers "
                "or null: fix config.json"
            )
        self.block = None if size is None else (size[0], size[1])
        self.label = "fp8, " + ("per-tensor scale" if self.block is None else f"{size[0]} x {size[1]} blocks")

    def packed(self, infos: Mapping[str, TensorInfo], read: Read) -> list[Packed]:
        found = []
        for name, info in infos.items():
            module = module_of(name, "weight_scale_inv")
            if module is None:
                continue
            weight = f"{module}.weight"
            self.check(infos, weight, None, "fp8")
            shape = tuple(infos[weight].shape)
            if len(shape) < 2:
                raise self.error(weight, f"has shape {shape}; an fp8 weight has at least two dims")
            if self.block is None:
                if infos[name].numel != 1:
                    raise self.error(name, f"has shape {tuple(info.shape)}; a per-tensor scale is one number")
            else:
                expected = (*shape[:-2], *(blocks_needed(d, b) for d, b in zip(shape[-2:], self.block, strict=True)))
                self.check(infos, name, expected, "float|fp8")
            found.append(Packed(weight, shape, {"codes": weight, "scale": name}))
        claimed = {part for p in found for part in p.parts.values()}  # ue8m0 scales are 8-bit floats too
        for name, info in infos.items():
            if number_kind(info.dtype) == "fp8" and name not in claimed:
                raise self.error(name, "is stored in fp8 with no weight_scale_inv beside it")
        return found

    def dequantize(self, packed: Packed, read: Read, rows: Rows) -> torch.Tensor:
        codes = read(packed.parts["codes"], rows)
        name = packed.parts["scale"]
        if self.block is None:
            return scaled_blocks(codes, self.finite_scale(name, read(name, None)), None)
        if len(packed.shape) == 2 and rows is not None:  # the scale rows of the blocks that hold these rows
            scale = self.finite_scale(name, read(name, block_rows(rows, self.block[0])))
            return scaled_blocks(codes, scale, self.block, first=rows[0] % self.block[0])
        return scaled_blocks(codes, self.finite_scale(name, read(name, rows)), self.block)


class FbgemmFP8(Scheme):
    """``quant_method: fbgemm_fp8``: float8 weights with one float32 scale per output channel."""

    label = "fbgemm fp8, per-channel scale"
    dropped_suffixes = ACTIVATION_SCALES

    def packed(self, infos: Mapping[str, TensorInfo], read: Read) -> list[Packed]:
        found = []
        for name, info in infos.items():
            if number_kind(info.dtype) != "fp8":
                continue
            module = module_of(name, "weight")
            if module is None or len(info.shape) != 2:
                raise self.error(name, "is stored in fp8 but is not a 2-D weight")
            scale = f"{module}.weight_scale"
            self.check(infos, scale, (info.shape[0], 1), "float")
            found.append(Packed(name, tuple(info.shape), {"codes": name, "scale": scale}))
        return found

    def dequantize(self, packed: Packed, read: Read, rows: Rows) -> torch.Tensor:
        scale = self.finite_scale(packed.parts["scale"], read(packed.parts["scale"], rows))
        return read(packed.parts["codes"], rows).to(torch.float32).mul_(scale)
