"""compressed-tensors checkpoints (llm-compressor's W4A16, W8A8, FP8 ...): ``quant_method: compressed-tensors``.

The config's ``format`` (or each config group's) says how weights are stored:

- ``pack-quantized``: ``<m>.weight_packed`` int32 ``[..., out, ceil(in*bits/32)]`` (code i of a row at bit
  i*bits, offset by 2**(bits-1) so that it is unsigned), ``<m>.weight_shape`` (the dense [out, in]),
  ``<m>.weight_scale``, and for asymmetric group/channel schemes ``<m>.weight_zero_point`` packed the same way
  along the output dim;
- ``naive-quantized``, ``int-quantized``, ``float-quantized``: ``<m>.weight`` in int8 or float8 with
  ``<m>.weight_scale`` (and ``<m>.weight_zero_point``, unpacked);
- ``dense``: ordinary weights (any scales beside them are the quantizer's and are dropped).

W = (codes - zero_point) * scale, the scale per tensor (one number), per output channel ``[out, 1]``, per group
of ``group_size`` input columns ``[out, in/group_size]`` (column c in group c // group_size, or
``weight_g_idx[c]`` when activation order was used) or per block ``[ceil(out/bo), ceil(in/bi)]``.
FP4 formats (nvfp4, mxfp4), tensor-group strategies, sparsity compression and transforms are refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from specmerge.io.formats.protocol import Rows, TensorInfo
from specmerge.io.quant.fp8 import ACTIVATION_SCALES, scaled_blocks
from specmerge.io.quant.packing import blocks_needed, contiguous_groups, unpack_int32
from specmerge.io.quant.scheme import Packed, QuantError, Read, Scheme, block_rows, module_of, row_slice

READ_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized", "float-quantized", "dense")
STRATEGIES = ("tensor", "channel", "group", "block")
# activation and KV-cache quantization parameters: the quantized kernels' business, not a dense model's
OTHER_SCALES = ("input_zero_point", "input_global_scale", "output_scale", "output_zero_point", "k_scale", "v_scale")


class WeightArgs:
    """A config group's ``weights``: bits, int or float, symmetric, strategy, group size or block shape."""

    def __init__(self, where: str, group: str, args: Mapping[str, Any]) -> None:
        def bad(problem: str) -> QuantError:
            return QuantError(f"{where}: quantization_config group '{group}' weights {problem}: fix config.json")

        self.bits, self.type = args.get("num_bits", 8), args.get("type", "int")
        self.symmetric, self.strategy = args.get("symmetric", True), args.get("strategy", "tensor")
        if type(self.bits) is not int or not 1 <= self.bits <= 8 or self.type not in ("int", "float"):
            raise bad(f"have num_bits {self.bits!r} and type {self.type!r}; read are int of 1-8 bits and float8")
        if self.type == "float" and self.bits != 8:
            raise bad(f"are {self.bits}-bit floats (an FP4 format), which specmerge does not read yet")
        if self.strategy not in STRATEGIES:
            raise bad(
                f"use strategy {self.strategy!r}, which specmerge does not read (it reads {', '.join(STRATEGIES)})"
            )
        self.group_size = args.get("group_size")
        if self.strategy == "group" and (type(self.group_size) is not int or self.group_size <= 0):
            raise bad(f"use strategy group with group_size {self.group_size!r}")
        block = args.get("block_structure")
        if self.strategy == "block" and not (
            isinstance(block, list) and len(block) == 2 and all(type(v) is int and v > 0 for v in block)
        ):
            raise bad(f"use strategy block with block_structure {block!r}")
        self.block = tuple(block) if self.strategy == "block" else None

    def key(self) -> tuple:
        return self.bits, self.type, self.symmetric, self.strategy, self.group_size, self.block

    def describe(self) -> str:
        per = {"group": f"groups of {self.group_size}", "block": f"{self.block} blocks"}.get(self.strategy)
        return f"{self.type}{self.bits}, {'symmetric' if self.symmetric else 'asymmetric'}, {per or self.strategy}"

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """The shape ``weight_scale`` has for a dense weight of ``shape`` (None: one number, any shape)."""
        lead, (rows, cols) = shape[:-2], shape[-2:]
        if self.strategy == "tensor":
            return None
        if self.strategy == "channel":
            return (*lead, rows, 1)
        if self.strategy == "group":
            return (*lead, rows, blocks_needed(cols, self.group_size))
        return (*lead, blocks_needed(rows, self.block[0]), blocks_needed(cols, self.block[1]))


class CompressedTensors(Scheme):
    """``quant_method: compressed-tensors`` in one of :data:`READ_FORMATS`."""

    dropped_suffixes = ACTIVATION_SCALES

    def __init__(self, where: str, config: Mapping[str, Any]) -> None:
        super().__init__(where)
        for key in ("sparsity_config", "transform_config"):
            value = config.get(key)
            if value and not (key == "sparsity_config" and value.get("format", "dense") == "dense"):
                raise QuantError(
                    f"{where}: quantization_config has a {key} ({value.get('format', '?')}), which specmerge does not "
                    "read: merge the dense release of this model"
                )
        groups = config.get("config_groups") or {}
        if not isinstance(groups, dict):
            raise QuantError(f"{where}: quantization_config config_groups is not a mapping: fix config.json")
        default_format = config.get("format", "dense")
        self.groups: list[tuple[str, list[str], WeightArgs, str]] = []
        for group, scheme in groups.items():
            fmt = scheme.get("format") or default_format
            if fmt not in READ_FORMATS:
                raise QuantError(
                    f"{where}: quantization_config group '{group}' uses format '{fmt}', which specmerge does not "
                    f"read yet (it reads {', '.join(READ_FORMATS)}): merge the dense release of this model"
                )
            if scheme.get("weights"):
                targets = scheme.get("targets") or []
                self.groups.append((group, list(targets), WeightArgs(where, group, scheme["weights"]), fmt))
        if not self.groups:
            raise QuantError(f"{where}: quantization_config (compressed-tensors) quantizes no weights: fix config.json")
        self.label = "compressed-tensors " + "; ".join(sorted({f"{f} {a.describe()}" for _, _, a, f in self.groups}))
        # scales of weights stored dense (format dense) are the quantizer's, of no use in a dense model
        dense = (
            ("weight_scale", "weight_zero_point", "weight_g_idx") if any(f == "dense" for *_, f in self.groups) else ()
        )
        self.dropped_suffixes = (*ACTIVATION_SCALES, *OTHER_SCALES, *dense)
        self.stores_dense = all(f == "dense" for *_, f in self.groups)

    def args_of(self, module: str) -> tuple[WeightArgs, str]:
        """The weights' args and format of ``module``: those of the one config group whose targets name it (a
        ``re:`` pattern or a module name), or of all groups when they agree."""
        named = [g for g in self.groups if any(_names(t, module) for t in g[1])]
        chosen = named or self.groups
        if len({(a.key(), f) for _, _, a, f in chosen}) > 1:
            shown = ", ".join(g[0] for g in chosen)
            raise QuantError(
                f"{self.where}: module '{module}' may belong to config groups {shown}, which quantize differently, "
                "and specmerge matches groups to modules by name only (targets 're:<pattern>' or module names): "
                "merge the dense release of this model"
            )
        return chosen[0][2], chosen[0][3]

    def packed(self, infos: Mapping[str, TensorInfo], read: Read) -> list[Packed]:
        found = []
        for name, _info in infos.items():
            module = module_of(name, "weight_packed") or module_of(name, "weight_scale")
            if module is None or (name.endswith("weight_scale") and f"{module}.weight_packed" in infos):
                continue
            args, fmt = self.args_of(module)
            if fmt == "dense":
                continue
            codes = f"{module}.weight_packed" if fmt == "pack-quantized" else f"{module}.weight"
            kinds = "fp8" if args.type == "float" else "int"
            self.check(infos, codes, None, kinds)
            parts = {"codes": codes, "scale": f"{module}.weight_scale"}
            shape = self._dense_shape(infos, module, codes, args, fmt, read)
            if fmt == "pack-quantized":
                parts["shape"] = f"{module}.weight_shape"
            if shape[-2] == 0 or shape[-1] == 0 or len(shape) < 2:
                raise self.error(codes, f"stands for a weight of shape {shape}")
            expected = args.scale_shape(shape)
            self.check(infos, parts["scale"], expected, "float|fp8")
            if expected is None and infos[parts["scale"]].numel != 1:
                raise self.error(parts["scale"], "is not one number (strategy tensor)")
            if not args.symmetric:
                if args.strategy == "block":
                    raise self.error(codes, "has an asymmetric block zero point, which specmerge does not read")
                parts["zeros"] = f"{module}.weight_zero_point"
                zero_shape = expected or (1,)
                if fmt == "pack-quantized" and args.strategy in ("group", "channel"):
                    zero_shape = (*expected[:-2], blocks_needed(expected[-2] * args.bits, 32), expected[-1])
                self.check(infos, parts["zeros"], zero_shape if expected else None, "int|float|fp8")
            if f"{module}.weight_g_idx" in infos:
                parts["groups"] = f"{module}.weight_g_idx"
                self.check(infos, parts["groups"], (shape[-1],), "int")
            found.append(Packed(f"{module}.weight", shape, parts, {"args": args, "format": fmt}))
        return found

    def _dense_shape(self, infos, module, codes, args, fmt, read) -> tuple[int, ...]:
        stored = tuple(infos[codes].shape)
        if fmt != "pack-quantized":
            return stored
        shape_name = f"{module}.weight_shape"
        self.check(infos, shape_name, (2,), "int")
        shape = tuple(int(v) for v in read(shape_name, None).tolist())
        dense = (*stored[:-2], *shape) if len(stored) > 2 else shape
        if min(shape) < 0 or stored != (*dense[:-1], blocks_needed(dense[-1] * args.bits, 32)):
            raise self.error(codes, f"has shape {stored}, which cannot hold {args.bits}-bit codes of shape {shape}")
        return dense

    def dequantize(self, packed: Packed, read: Read, rows: Rows) -> torch.Tensor:
        args: WeightArgs = packed.detail["args"]
        parts, shape = packed.parts, packed.shape
        lead = len(shape) > 2  # rows of a stack are whole leading entries (experts)
        codes = read(parts["codes"], rows)
        if packed.detail["format"] == "pack-quantized":
            codes = unpack_int32(codes, args.bits, shape[-1], dim=-1) - (1 << (args.bits - 1))
        if args.strategy == "block":
            scale_name = parts["scale"]
            if rows is not None and not lead:  # the scale rows of the blocks that hold these rows
                scale = self.finite_scale(scale_name, read(scale_name, block_rows(rows, args.block[0])))
                return scaled_blocks(codes, scale, args.block, first=rows[0] % args.block[0])
            return scaled_blocks(codes, self.finite_scale(scale_name, read(scale_name, rows)), args.block)
        scale_rows = rows if args.strategy != "tensor" else None
        scale = self._scale_rows(parts["scale"], read, scale_rows)
        zeros = self._zeros(packed, read, scale_rows, shape)
        out = codes.to(torch.float32)
        del codes
        if args.strategy == "group" and "groups" not in parts and shape[-1] % args.group_size == 0:
            grouped = out.unflatten(-1, (shape[-1] // args.group_size, args.group_size))  # a view: no spread copy
            if zeros is not None:
                grouped.sub_(zeros.unsqueeze(-1))
            grouped.mul_(scale.unsqueeze(-1))
            return out
        if zeros is not None:
            out.sub_(zeros if args.strategy != "group" else self._spread(packed, read, zeros))
        if args.strategy == "group":
            scale = self._spread(packed, read, scale)
        return out.mul_(scale.reshape(()) if args.strategy == "tensor" else scale)

    def _spread(self, packed: Packed, read: Read, per_group: torch.Tensor) -> torch.Tensor:
        """A per-group tensor ``[..., rows, groups]`` over the columns."""
        if "groups" in packed.parts:
            index = read(packed.parts["groups"], None).to(torch.int64)
            if int(index.min()) < 0 or int(index.max()) >= per_group.shape[-1]:
                raise self.error(packed.parts["groups"], f"names groups outside 0..{per_group.shape[-1] - 1}")
        else:
            index = contiguous_groups(packed.shape[-1], packed.detail["args"].group_size)
        return per_group.index_select(-1, index)

    def _scale_rows(self, name: str, read: Read, rows: Rows) -> torch.Tensor:
        return self.finite_scale(name, read(name, rows))

    def _zeros(self, packed: Packed, read: Read, rows: Rows, shape: tuple[int, ...]) -> torch.Tensor | None:
        name = packed.parts.get("zeros")
        if name is None:
            return None
        args: WeightArgs = packed.detail["args"]
        if packed.detail["format"] == "pack-quantized" and args.strategy in ("group", "channel"):
            stored = read(name, None)
            zeros = unpack_int32(stored, args.bits, shape[-2], dim=-2) - (1 << (args.bits - 1))
            return zeros[row_slice(rows, zeros.shape[0])].to(torch.float32)  # dim 0: rows, or a stack's experts
        return read(name, rows).to(torch.float32)


def _names(target: str, module: str) -> bool:
    """Whether a config group's target names ``module``: ``re:<pattern>`` matched from the start, or the module's
    name itself (or a dotted ending of it); class names (``Linear``) name no module in particular."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target or module.endswith("." + target)
