"""Writing a merged LoRA adapter as PEFT saves one: ``adapter_config.json`` and ``adapter_model.safetensors``.

:func:`adapter_config` is the config of factors of given ranks, each at scale 1; :func:`write_adapter` writes the
factors in PEFT's names and layouts (``fan_in_fan_out`` Conv1D modules transposed, embeddings as
``lora_embedding_A`` / ``lora_embedding_B``). :mod:`.peft` reads what this writes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specmerge.io.formats.names import ADAPTER_CONFIG, ADAPTER_FILES, PEFT_PREFIX, lora_key
from specmerge.linalg.lowrank import AdapterFactors


def adapter_config(
    ranks: Mapping[str, int], *, base_model: str, like: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A PEFT LoRA config for modules of the given ranks, each with scale 1 (lora_alpha = r per module).

    ``ranks`` maps base weight names (``....q_proj.weight``) to ranks. The most common rank is ``r``;
    the others go to ``rank_pattern`` / ``alpha_pattern`` under their full, regex-escaped module names
    (PEFT matches pattern keys as regular expressions on the module name's end). ``task_type`` and
    ``fan_in_fan_out`` are taken from ``like`` (an input adapter's config).
    """
    like = like or {}
    modules = {name.removesuffix(".weight"): rank for name, rank in ranks.items()}
    counts: dict[int, int] = {}
    for rank in modules.values():
        counts[rank] = counts.get(rank, 0) + 1
    r = max(sorted(counts), key=lambda k: counts[k]) if counts else 1
    patterns = {re.escape(m): rank for m, rank in sorted(modules.items()) if rank != r}
    return {
        "peft_type": "LORA",
        "task_type": like.get("task_type"),
        "base_model_name_or_path": base_model,
        "r": r,
        "lora_alpha": r,
        "rank_pattern": patterns,
        "alpha_pattern": dict(patterns),
        "target_modules": sorted(modules),
        "fan_in_fan_out": bool(like.get("fan_in_fan_out", False)),
        "use_rslora": False,
        "use_dora": False,
        "lora_dropout": 0.0,
        "bias": "none",
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_adapter(
    folder: Path, factors: Mapping[str, AdapterFactors], config: Mapping[str, Any], embeddings: Collection[str] = ()
) -> None:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` for factors keyed by base weight name.

    The factors are in the base weight's layout (delta W = B A); with ``fan_in_fan_out`` (GPT-2's Conv1D,
    weights stored d_in x d_out) PEFT's factors are their transposes, lora_B = A^T and lora_A = B^T; for an
    embedding (``embeddings``: base weight names) PEFT's lora_embedding_A = B^T and lora_embedding_B = A^T.
    """
    transposed = bool(config.get("fan_in_fan_out"))
    tensors: dict[str, torch.Tensor] = {}
    for name, f in factors.items():
        module = name.removesuffix(".weight")
        if name in embeddings:
            tensors[f"{PEFT_PREFIX}{module}.lora_embedding_A"] = f.B.T.contiguous()
            tensors[f"{PEFT_PREFIX}{module}.lora_embedding_B"] = f.A.T.contiguous()
            continue
        lora_B, lora_A = (f.A.T, f.B.T) if transposed else (f.B, f.A)
        tensors[lora_key(module, "A")] = lora_A.contiguous()
        tensors[lora_key(module, "B")] = lora_B.contiguous()
    save_file(tensors, str(folder / ADAPTER_FILES[0]), metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG).write_text(json.dumps(dict(config), indent=2) + "\n")
