"""PEFT's LoRA on parameters (``target_parameters``): MoE expert stacks adapted as E low-rank updates at once.

For a stack ``<owner>.<leaf>`` of shape ``[E, in, out]`` (gpt-oss, Llama 4; transformers' fused ``[E, out, in]``
for Mixtral and kin), PEFT 0.21's ``ParamWrapper`` saves ``lora_A`` ``[E*r, in]`` (expert-major rows) and ``lora_B``
``[out, r*E]`` (rank-major columns): expert e's update is s * B[:, :, e] @ A[e] with A reshaped ``[E, r, in]`` and
B ``[out, r, E]`` (``ParamWrapper.get_delta_weight``), laid into the stack transposed (``[in, out]``) or not. Several
parameters of one module nest: the first of ``target_parameters`` is wrapped innermost, so its factors are saved
under the most ``.base_layer`` levels (``<owner>.base_layer.lora_A`` for the first of two, ``<owner>.lora_A`` for the
second). Each slice's update is low-rank, so a stack merges as E linear layers (``specmerge.io.formats.stacks``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from specmerge.io.formats.peft_fields import AdapterError
from specmerge.io.formats.protocol import TensorInfo
from specmerge.linalg.lowrank import LoraDelta

BASE_LAYER = ".base_layer"


def targeted_parameter(module: str, config: Mapping[str, Any]) -> str | None:
    """The stack (``<owner>.<leaf>``) that factors saved under ``module`` adapt, for a ``target_parameters``
    adapter; None when ``module`` is an ordinary LoRA module."""
    targets = [t for t in (config.get("target_parameters") or []) if isinstance(t, str)]
    if not targets:
        return None
    owner, depth = module, 0
    while owner.endswith(BASE_LAYER):
        owner, depth = owner[: -len(BASE_LAYER)], depth + 1
    mine = [t for t in targets if f"{owner}.{t.rsplit('.', 1)[-1]}".endswith(t)]
    if not mine:
        return None
    if depth >= len(mine):
        raise AdapterError(f"'{module}' is nested {depth} deep, but target_parameters names {len(mine)} of its stacks")
    return f"{owner}.{mine[len(mine) - 1 - depth].rsplit('.', 1)[-1]}"


def stack_rank(A: TensorInfo, B: TensorInfo, r: int, name: str) -> int:
    """The number of experts E of a parameter LoRA whose factors hold ``r`` ranks per expert."""
    rows = A.shape[0]
    if r < 1 or rows % r or rows != B.shape[1]:
        raise AdapterError(
            f"'{name}': lora_A {list(A.shape)} and lora_B {list(B.shape)} are not r = {r} ranks per expert (the "
            "factors of LoRA on an expert stack hold experts x r rows): the config does not describe these weights"
        )
    return rows // r


def stack_deltas(A: torch.Tensor, B: torch.Tensor, experts: int, scale: float, swapped: bool) -> list[LoraDelta]:
    """Each expert's update in the stack's slice layout: ``[in, out]`` (``swapped`` False, as gpt-oss stores it)
    or ``[out, in]``."""
    rank = A.shape[0] // experts
    A3 = A.reshape(experts, rank, A.shape[-1])  # [E, r, in]
    B3 = B.reshape(B.shape[0], rank, experts)  # [out, r, E]
    deltas = []
    for e in range(experts):
        left, right = B3[:, :, e].contiguous(), A3[e].contiguous()  # delta_e (out, in) = s left @ right
        deltas.append(
            LoraDelta(left, right, scale) if swapped else LoraDelta(right.T.contiguous(), left.T.contiguous(), scale)
        )
    return deltas
