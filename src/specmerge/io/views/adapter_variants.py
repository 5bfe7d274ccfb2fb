"""An adapter's DoRA, LoRA biases, saved modules and trainable tokens as the base tensors they change, and how.

:func:`dense_variants` checks what :mod:`specmerge.io.formats.peft_variants` found in an adapter against the base's
tensors (each must change a base tensor of the right shape: the adapter was trained on this base) and names the base
tensors they change; :func:`variant_weight` gives one such tensor as ``merge_and_unload`` would leave it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from specmerge.io.formats.peft import AdapterError, LoraAdapter
from specmerge.io.formats.peft_variants import dora_weight, token_indices, token_rows
from specmerge.io.formats.protocol import TensorInfo, TensorSource


def dense_variants(adapter: LoraAdapter, base: Mapping[str, TensorInfo]) -> dict[str, str]:
    """Base tensor name -> what changes it beyond a LoRA delta ("DoRA weight", "LoRA bias", "saved module",
    "trainable tokens"), checked against the base's shapes."""
    variants, modules, path = adapter.variants, adapter.modules(), adapter.path
    dense: dict[str, str] = {}

    def need(name: str, shape: tuple[int, ...], what: str) -> None:
        info = base.get(name)
        if info is None or tuple(info.shape) != tuple(shape):
            found = "not in the base" if info is None else f"{list(info.shape)} in the base"
            raise AdapterError(
                f"{path}: its {what} changes '{name}' as {list(shape)}, which is {found}; was the adapter trained "
                "on another base?"
            )

    stored = adapter.stored_infos()
    for module, name in variants.magnitude.items():
        weight = f"{module}.weight"
        if weight not in modules or modules[weight].transposed or modules[weight].embedding:
            raise AdapterError(f"{path}: DoRA magnitude '{name}' of a module that is not a LoRA linear layer it reads")
        need(weight, (stored[name].shape[0], modules[weight].shape[1]), "DoRA magnitude")
        dense[weight] = "DoRA weight"
    for module, name in variants.bias.items():
        need(f"{module}.bias", tuple(stored[name].shape), "LoRA bias")
        if f"{module}.weight" not in modules:
            raise AdapterError(f"{path}: LoRA bias '{name}' of module '{module}', which has no lora_A / lora_B")
        dense[f"{module}.bias"] = "LoRA bias"
    for base_name, name in variants.saved.items():
        need(base_name, tuple(stored[name].shape), "saved copy (modules_to_save)")
        dense[base_name] = "saved module"
    for module, name in variants.tokens.items():
        ids = token_indices(adapter.config, module)
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise AdapterError(f"{adapter.config_name}: trainable_token_indices {ids!r} is not a list of token ids")
        weight = f"{module}.weight"
        rows, dim = stored[name].shape
        info = base.get(weight)
        if info is None or len(ids) != rows or info.shape[1:] != (dim,) or any(not 0 <= i < info.shape[0] for i in ids):
            raise AdapterError(
                f"{path}: trainable tokens '{name}' ({rows} rows of {dim}) do not fit the base's '{weight}' with "
                f"token ids {ids[:5]}...; was the adapter trained on another base?"
            )
        dense[weight] = "trainable tokens"
    for module, name in variants.base_layer.items():  # an embedding saved with its LoRA: the base's own
        need(f"{module}.weight", tuple(stored[name].shape), "saved embedding (base_layer)")
    return dense


def variant_weight(adapter: LoraAdapter, name: str, kind: str, base: TensorSource) -> torch.Tensor:
    """Base tensor ``name`` as ``merge_and_unload`` leaves it, in float32."""
    variants = adapter.variants
    module = name.rsplit(".", 1)[0]
    if kind == "saved module":
        return adapter.load_stored(variants.saved[name]).to(torch.float32)
    w0 = base.load(name)
    if kind == "DoRA weight":
        delta = adapter.load(name).dense()
        return dora_weight(w0, delta, adapter.load_stored(variants.magnitude[module]))
    if kind == "LoRA bias":
        scale = adapter.modules()[f"{module}.weight"].scale
        return w0.to(torch.float32) + scale * adapter.load_stored(variants.bias[module]).to(torch.float32)
    return token_rows(w0, token_indices(adapter.config, module), adapter.load_stored(variants.tokens[module]))
