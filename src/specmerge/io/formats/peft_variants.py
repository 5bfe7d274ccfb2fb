"""PEFT features beyond a plain LoRA delta that an adapter may carry, read as what ``merge_and_unload`` makes of them.

PEFT 0.21 saves, beside a module's ``lora_A`` / ``lora_B`` (names as :mod:`.peft` reads them):

- DoRA (``use_dora``): ``<m>.lora_magnitude_vector`` m, one per output row; the merged weight is
  W' = m / ||W + s B A||_row * (W + s B A) (PEFT's ``DoraLinearVariant.merge_safe``), not a low-rank change;
- LoRA biases (``lora_bias``): ``<m>.lora_B.bias`` b; the merged bias is bias + s b;
- ``modules_to_save``: whole trained copies of base modules, stored under the module's own name
  (``lm_head.weight``); the merged tensor is the copy;
- trainable tokens (``trainable_token_indices``): ``<m>.token_adapter.trainable_tokens_delta``, the new rows of
  the embedding for those token ids (``index_copy`` into the base's rows);
- LoRA on embeddings: ``<m>.lora_embedding_A`` [r, vocab] and ``lora_embedding_B`` [dim, r]: the delta of the
  embedding weight is s (B A)^T, low-rank (merged exactly in factored form, like any LoRA module); with them PEFT
  saves the embedding itself (``<m>.base_layer.weight``), which must be the base's.

:func:`split_variants` sorts an adapter's tensors into its LoRA factors and these :class:`Variants`; the pure
functions below give the merged tensors; :class:`specmerge.io.views.experts.AdapterExpert` serves them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from specmerge.io.formats.names import PEFT_PREFIX
from specmerge.io.formats.peft_fields import AdapterError
from specmerge.io.formats.protocol import TensorInfo

SUFFIXES = {
    ".lora_magnitude_vector": "magnitude",
    ".lora_B.bias": "bias",
    ".lora_embedding_A": "embedding_A",
    ".lora_embedding_B": "embedding_B",
    ".base_layer.weight": "base_layer",
    ".token_adapter.trainable_tokens_delta": "tokens",
}


@dataclass
class Variants:
    """An adapter's tensors beyond lora_A / lora_B, by module (the module's name without PEFT's prefix)."""

    magnitude: dict[str, str] = field(default_factory=dict)  # DoRA
    bias: dict[str, str] = field(default_factory=dict)  # lora_bias
    embedding_A: dict[str, str] = field(default_factory=dict)
    embedding_B: dict[str, str] = field(default_factory=dict)
    base_layer: dict[str, str] = field(default_factory=dict)  # saved with an embedding's LoRA: the base's own
    tokens: dict[str, str] = field(default_factory=dict)  # trainable tokens' rows
    saved: dict[str, str] = field(default_factory=dict)  # modules_to_save: base tensor name -> stored copy

    def kinds(self) -> list[str]:
        """What the adapter carries beyond LoRA deltas, in words (for messages)."""
        named = {"magnitude": "DoRA", "bias": "LoRA biases", "saved": "modules_to_save", "tokens": "trainable tokens"}
        return [what for key, what in named.items() if getattr(self, key)]


def _module(name: str) -> str:
    return name.removeprefix(PEFT_PREFIX)


def split_variants(
    infos: Mapping[str, TensorInfo], config: Mapping[str, Any]
) -> tuple[dict[str, TensorInfo], Variants]:
    """The adapter's tensors that are LoRA factors (``lora_A`` / ``lora_B`` weights), and its :class:`Variants`; a
    tensor that is neither stays with the factors (the factor reader names it as unexpected)."""
    variants = Variants()
    saving = [m for m in (config.get("modules_to_save") or []) if isinstance(m, str)]
    factors = {}
    for name, info in infos.items():
        suffix = next((suffix for suffix in SUFFIXES if name.endswith(suffix)), None)
        if suffix is not None:
            getattr(variants, SUFFIXES[suffix])[_module(name)[: -len(suffix)]] = name
            continue
        stripped = _module(name)
        owner = stripped.rsplit(".", 1)[0]
        if ".lora_" not in name and any(owner == m or owner.endswith("." + m) for m in saving):
            variants.saved[stripped] = name
            continue
        factors[name] = info
    if set(variants.embedding_A) != set(variants.embedding_B):
        lone = sorted(set(variants.embedding_A) ^ set(variants.embedding_B))[0]
        raise AdapterError(f"embedding module '{lone}' has only one of lora_embedding_A / lora_embedding_B")
    return factors, variants


def dora_weight(base: torch.Tensor, delta: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """PEFT's merged DoRA weight: m / ||W + delta||_row * (W + delta), in float32 (``delta`` is s B A)."""
    combined = base.to(torch.float32) + delta.to(torch.float32)
    norm = torch.linalg.norm(combined, dim=1)
    return combined.mul_((magnitude.to(torch.float32) / norm).unsqueeze(1))


def token_indices(config: Mapping[str, Any], module: str) -> Any:
    """The token ids whose rows ``module``'s trainable tokens hold: ``trainable_token_indices`` (a list, or a
    mapping from the embedding's last name to a list)."""
    indices = config.get("trainable_token_indices")
    return indices.get(module.rsplit(".", 1)[-1], []) if isinstance(indices, dict) else indices


def token_rows(base: torch.Tensor, indices: list[int], rows: torch.Tensor) -> torch.Tensor:
    """The embedding with the trainable tokens' rows put in (PEFT's ``index_copy``)."""
    index = torch.tensor(indices, dtype=torch.int64)
    return base.to(torch.float32).index_copy(0, index, rows.to(torch.float32))
