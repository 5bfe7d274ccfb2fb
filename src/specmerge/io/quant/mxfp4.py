"""MXFP4 checkpoints (gpt-oss: ``quant_method: mxfp4``): MoE expert stacks in 4-bit floats with a shared exponent.

An expert stack ``<p>`` (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``) is stored as ``<p>_blocks``, uint8
``[E, out, G, 16]`` (two E2M1 codes a byte, the low nibble first: 32 values of one output row's G-th group of 32
inputs) and ``<p>_scales``, uint8 ``[E, out, G]`` (each group's power of two, biased by 127: E8M0). The dense
stack is ``[E, G*32, out]`` = ``[E, in, out]``, as gpt-oss stores it unquantized (transformers' own
``convert_moe_packed_tensors`` gives the same). A scale of 255 is E8M0's NaN and is refused.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from specmerge.io.formats.protocol import Rows, TensorInfo
from specmerge.io.quant.scheme import Packed, Read, Scheme

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # code -> value


class MXFP4(Scheme):
    """``quant_method: mxfp4``: expert stacks as E2M1 blocks of 32 with an E8M0 scale."""

    label = "mxfp4 (E2M1 blocks of 32, E8M0 scales)"

    def packed(self, infos: Mapping[str, TensorInfo], read: Read) -> list[Packed]:
        found = []
        for name, info in infos.items():
            if not name.endswith("_blocks"):
                continue
            stack = name[: -len("_blocks")]
            scales = f"{stack}_scales"
            shape = tuple(info.shape)
            if len(shape) != 4 or shape[-1] != 16:
                raise self.error(name, f"has shape {shape}; MXFP4 blocks are [experts, out, groups, 16]")
            self.check(infos, name, shape, "int")
            self.check(infos, scales, shape[:-1], "int")
            experts, out, groups, _ = shape
            found.append(Packed(stack, (experts, groups * 32, out), {"codes": name, "scale": scales}))
        for name in infos:
            if name.endswith("_scales") and name[: -len("_scales")] + "_blocks" not in infos:
                raise self.error(name, f"has no {name[: -len('_scales')]}_blocks beside it")
        return found

    def dequantize(self, packed: Packed, read: Read, rows: Rows) -> torch.Tensor:
        blocks = read(packed.parts["codes"], rows).to(torch.uint8)
        exponents = read(packed.parts["scale"], rows).to(torch.int32)
        nan = int((exponents == 255).sum())
        if nan:
            raise self.error(
                packed.parts["scale"], f"holds {nan} NaN scales (E8M0 255)", "the checkpoint is corrupt: re-download it"
            )
        table = torch.tensor(E2M1, dtype=torch.float32)
        values = torch.stack([table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]], dim=-1)  # [E, out, G, 16, 2]
        values = values.reshape(*blocks.shape[:-1], 32)  # [E, out, G, 32], low nibble first
        values = torch.ldexp(values, (exponents - 127).unsqueeze(-1).to(torch.float32))
        return values.reshape(*blocks.shape[:2], -1).transpose(1, 2).contiguous()  # [E, in, out]
