"""Synthetic inputs of the whole-model benchmarks: stable seeds and the tensor shapes of a Llama config."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any


def stable_seed(*parts: object) -> int:
    """A 64-bit seed from ``parts`` (e.g. a model and a tensor name), the same in every process and run."""
    return int.from_bytes(hashlib.blake2b("\0".join(map(str, parts)).encode(), digest_size=8).digest(), "little")


def llama_shapes(model: Mapping[str, Any], dtype: str = "float16") -> tuple[Any, dict[str, tuple[int, ...]]]:
    """(``transformers.LlamaConfig``, tensor name -> shape) of a ``LlamaForCausalLM`` with the settings ``model``.

    The shapes come from a model built on the meta device: no memory is allocated.
    """
    import torch
    import transformers

    config = transformers.LlamaConfig(**model, torch_dtype=dtype, architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in transformers.LlamaForCausalLM(config).state_dict().items()}
    return config, shapes
