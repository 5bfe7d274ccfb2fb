"""Which quantization a checkpoint uses, from its config.json and its tensors, and refusal of what is not read.

:func:`scheme_of` reads ``quantization_config`` (or the older ``compression_config``) of a checkpoint's config
and builds the :class:`~specmerge.io.quant.scheme.Scheme` that reads it (:data:`SCHEMES`); any other
``quant_method`` is refused by name. :func:`quantized_marker` finds a stored tensor that only a quantized
checkpoint holds (packed codes, scales, an fp8 or integer weight), so that a checkpoint whose config says
nothing, or whose scheme does not account for such a tensor, is refused instead of merged as raw codes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from specmerge.io.formats.protocol import TensorInfo
from specmerge.io.quant.bnb import Bitsandbytes
from specmerge.io.quant.compressed import CompressedTensors
from specmerge.io.quant.fp8 import FbgemmFP8, FineGrainedFP8
from specmerge.io.quant.gptq import AWQ, GPTQ
from specmerge.io.quant.mxfp4 import MXFP4
from specmerge.io.quant.scheme import QuantError, Scheme, number_kind

SCHEMES: dict[str, Callable[[str, Mapping[str, Any]], Scheme]] = {
    "fp8": FineGrainedFP8,
    "fbgemm_fp8": lambda where, config: FbgemmFP8(where),
    "compressed-tensors": CompressedTensors,
    "gptq": GPTQ,
    "awq": AWQ,
    "mxfp4": lambda where, config: MXFP4(where),
    "bitsandbytes": lambda where, config: Bitsandbytes(where),
}
CONFIG_KEYS = ("quantization_config", "compression_config")
INTEGER_CODES = (torch.int8, torch.uint8, torch.int16, torch.int32)  # what quantized weights are stored in

# Endings of stored tensor names that only quantized checkpoints have, and what they are.
MARKER_SUFFIXES = {
    ".qweight": "GPTQ/AWQ packed codes",
    ".qzeros": "GPTQ/AWQ packed zero points",
    ".weight_scale_inv": "an fp8 block scale",
    ".weight_scale": "a quantization scale",
    ".weight_packed": "compressed-tensors packed codes",
    ".weight_zero_point": "a quantization zero point",
    ".absmax": "a bitsandbytes 4-bit scale",
    ".quant_map": "a bitsandbytes 4-bit code book",
    ".nested_absmax": "a bitsandbytes nested scale",
    ".quant_state.bitsandbytes__nf4": "a bitsandbytes nf4 quantization state",
    ".quant_state.bitsandbytes__fp4": "a bitsandbytes fp4 quantization state",
    ".SCB": "a bitsandbytes int8 scale",
}


def quantization_config(config: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The quantization section of a config.json (None when there is none)."""
    if not config:
        return None
    for key in CONFIG_KEYS:
        if config.get(key) is not None:
            return config[key]
    return None


def scheme_of(config: Mapping[str, Any] | None, where: str) -> Scheme | None:
    """The scheme ``config`` (a parsed config.json) states, or None when it states none; refuses one not read."""
    section = quantization_config(config)
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise QuantError(f"{where}: quantization_config in config.json is not an object: fix config.json")
    method = section.get("quant_method")
    make = SCHEMES.get(method) if isinstance(method, str) else None
    if make is None:
        shown = f"'{method}'" if isinstance(method, str) else "no quant_method"
        raise QuantError(
            f"{where}: config.json says the weights are quantized ({shown}), which specmerge does not read (it reads "
            f"{', '.join(SCHEMES)}): merge the unquantized release of the model, or dequantize it first"
        )
    return make(where, section)


def quantized_marker(infos: Mapping[str, TensorInfo], skip: frozenset[str] = frozenset()) -> tuple[str, str] | None:
    """A stored tensor (not in ``skip``) that only a quantized checkpoint has, and what it looks like; None when
    there is none."""
    names = set(infos)
    for name, info in infos.items():
        if name in skip:
            continue
        for suffix, what in MARKER_SUFFIXES.items():
            if name.endswith(suffix):
                return name, what
        kind = number_kind(info.dtype)
        if kind == "fp8":
            return name, f"an fp8 ({info.dtype}) tensor"
        if info.dtype in INTEGER_CODES and name.endswith(".weight") and len(info.shape) >= 2:
            return name, f"an integer ({info.dtype}) weight"
        if name.endswith("_blocks") and name[: -len("_blocks")] + "_scales" in names:
            return name, "MXFP4 blocks"
    return None


FOLDER_FIX = (
    "no quantization_config says how to read it (a quantized checkpoint given without its config.json?): pass "
    "the model folder with its config.json, or merge the unquantized release"
)


def unstated(where: str, name: str, what: str, fix: str = FOLDER_FIX) -> QuantError:
    """The error for a quantized-looking tensor in a checkpoint whose config states no quantization."""
    return QuantError(f"{where}: tensor '{name}' is {what}, but {fix}; merging raw codes would give a wrong model")
