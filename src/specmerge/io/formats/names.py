"""The file formats' names and codes, shared by the readers and the writers (one place for each).

Hugging Face model folders: ``model.safetensors`` or shards ``model-00001-of-0000K.safetensors`` named by
``model.safetensors.index.json``; PyTorch's ``pytorch_model.bin`` (and its index); ``config.json``. PEFT
adapter folders: ``adapter_config.json`` and ``adapter_model.safetensors`` (or ``.bin``), whose tensors are
named ``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``. safetensors dtype codes (``"BF16"``,
``"F32"``, ...) map to torch dtypes in :data:`SAFETENSORS_DTYPES`.
"""

from __future__ import annotations

import torch

SAFETENSORS_SUFFIX = ".safetensors"
SAFETENSORS_INDEX_SUFFIX = ".safetensors.index.json"
TORCH_INDEX_SUFFIX = ".bin.index.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
TORCH_INDEX = "pytorch_model.bin.index.json"
TORCH_FILE = "pytorch_model.bin"
TORCH_SUFFIXES = (".bin", ".pt", ".pth")
CONFIG_FILE = "config.json"

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")
PEFT_PREFIX = "base_model.model."  # what PEFT's save_pretrained puts before a module name

# Hugging Face cache repositories: <cache>/models--ORG--NAME/{snapshots/<rev>/<file> -> ../../blobs/<sha>, blobs/}.
HF_CACHE_REPO_PREFIXES = ("models--", "datasets--", "spaces--")

# safetensors dtype strings -> torch dtypes; the optional ones only where this torch build has them.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _code, _attr in (
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("F8_E8M0", "float8_e8m0fnu"),  # power-of-two scales (DeepSeek's ue8m0 FP8 checkpoints)
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
):
    if hasattr(torch, _attr):
        SAFETENSORS_DTYPES[_code] = getattr(torch, _attr)
DTYPE_CODES: dict[torch.dtype, str] = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors dtype string (``"BF16"``, ``"F32"``, ...) for a torch dtype."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored in safetensors; cast the tensor first") from None


def shard_name(index: int, count: int) -> str:
    """The file name of shard ``index`` (from 0) of ``count``: ``model.safetensors`` when there is one."""
    return SAFETENSORS_FILE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def lora_key(module: str, which: str, *, prefixed: bool = True) -> str:
    """The name of a PEFT LoRA factor: ``base_model.model.<module>.lora_<which>.weight`` (``which``: A or B)."""
    return f"{PEFT_PREFIX if prefixed else ''}{module}.lora_{which}.weight"
